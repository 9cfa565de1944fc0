#include "model/block.h"

#include "kernels/check.h"
#include "model/param_table.h"

namespace fp8moe {

FfnParams::FfnParams(const Fp8State& fp8, const std::string& prefix)
    : w1(fp8.linear(prefix + "w1")), w3(fp8.linear(prefix + "w3")), w2(fp8.linear(prefix + "w2")) {}

FfnFp8 FfnParams::fp8(Fp8State& state, const Pass& pass) const {
  return {state.context(w1, pass), state.context(w3, pass), state.context(w2, pass)};
}

int64_t BlockSaved::bytes(int64_t D, int64_t x_value_bytes) const {
  const size_t b = h1.bytes() + rstd1.bytes() + x_mid.bytes() + h2.bytes() + rstd2.bytes();
  return int64_t(b) + B * T * D * x_value_bytes + (attn ? attn->bytes() : 0) + dense.bytes() + moe.bytes();
}

void BlockSaved::finish(bool keep) {
  kept = keep;
  if (kept) return;
  MoeRouting routing = std::move(moe.routing);
  Tensor gate_rows = std::move(moe.gate_rows);  // train.moe_gates expert: sent once, with the routing
  const int64_t b = B, t = T;
  *this = BlockSaved{};
  B = b, T = t;
  moe.routing = std::move(routing);
  moe.gate_rows = std::move(gate_rows);
}

Block::Block(const ModelContext& ctx, int layer, bool recomputed) : ctx_(ctx), layer_(layer), recomputed_(recomputed) {
  const ModelConfig& m = ctx.model;
  const std::string p = block_prefix(m, layer);
  attn_norm_ = ctx.fp8.weight(p + "attn_norm.weight");
  ffn_norm_ = ctx.fp8.weight(p + "ffn_norm.weight");
  attn_ = make_attention(ctx, layer);
  if (!is_moe()) {
    dense_ = FfnParams(ctx.fp8, p + "mlp.");
    return;
  }
  const std::string q = p + "moe.";
  const Weight router = ctx.fp8.weight(q + "router");
  moe_.router = router.w, moe_grads_.router = router.g;
  moe_.router_bias = ctx.fp8.weight(q + "router_bias").w;
  moe_.router_gemm = ctx.hp_gemm;
  moe_.gates = ctx.moe_gates;
  moe_.shared = {nullptr, nullptr, nullptr};
  if (m.moe.n_shared_experts > 0) {
    shared_ = FfnParams(ctx.fp8, q + "shared.");
    moe_.shared = shared_.weights(), moe_grads_.shared = shared_.grads();
  }
  const int e0 = ctx.placement.first_expert();
  for (int e = e0; e < e0 + ctx.placement.local_experts(); ++e) {
    experts_.emplace_back(ctx.fp8, q + "experts." + std::to_string(e) + ".");
    moe_.experts.push_back(experts_.back().weights());
    moe_grads_.experts.push_back(experts_.back().grads());
  }
}

MoeFp8 Block::moe_fp8(const Pass& pass) const {
  MoeFp8 fp8;
  if (ctx_.model.moe.n_shared_experts > 0) fp8.shared = shared_.fp8(ctx_.fp8, pass);
  for (const FfnParams& e : experts_) fp8.experts.push_back(e.fp8(ctx_.fp8, pass));
  return fp8;
}

void Block::forward(const float* x, int64_t B, int64_t T, float* out, BlockSaved* s, const Pass& pass, double* aux) {
  const ModelConfig& m = ctx_.local;  // heads and widths of this tensor-parallel rank
  const int64_t N = B * T, D = m.d_model;
  Backend& be = ctx_.be;
  s->B = B, s->T = T;
  s->x = x;
  s->h1 = Tensor(be, DType::f32, {N, D});
  s->rstd1 = Tensor(be, DType::f32, {N});
  be.rmsnorm_forward(x, attn_norm_.w, N, D, float(m.norm_eps), s->h1.f32(), s->rstd1.f32());
  ctx_.round_activation(s->h1);  // train.activations bf16: every norm output, projection and sum below
  Tensor o(be, DType::f32, {N, D});
  s->attn = attn_->forward(s->h1.f32(), B, T, o.f32(), pass);
  if (!s->attn->needs_h1()) s->h1.reset();  // its linear layers keep it in FP8
  ctx_.tp_sum(o.f32(), N * D);  // row-parallel: partial sums over the heads of each rank
  s->x_mid = Tensor(be, DType::f32, {N, D});
  be.add(x, o.f32(), s->x_mid.f32(), N * D);
  ctx_.round_activation(s->x_mid);

  s->h2 = Tensor(be, DType::f32, {N, D});
  s->rstd2 = Tensor(be, DType::f32, {N});
  be.rmsnorm_forward(s->x_mid.f32(), ffn_norm_.w, N, D, float(m.norm_eps), s->h2.f32(), s->rstd2.f32());
  ctx_.round_activation(s->h2);
  Tensor f(be, DType::f32, {N, D});
  bool h2_held = false;  // a linear layer holds a pointer to h2 (it reads it in FP32 in backward)
  if (!is_moe()) {
    ffn_forward(be, s->h2.f32(), N, D, m.d_ff_dense, dense_.weights(), dense_.fp8(ctx_.fp8, pass), f.f32(), &s->dense,
                ctx_.activations, ctx_.selective);
    if (!s->dense.l1.needs_fp32_input() && !s->dense.l3.needs_fp32_input()) s->h2.reset();
    h2_held = !s->h2.empty();
  } else {
    moe_forward(be, s->h2.f32(), N, D, m.moe, moe_, moe_fp8(pass), f.f32(), &s->moe, ctx_.dispatcher, aux, ctx_.loads,
                ctx_.activations, ctx_.selective);
    h2_held = s->moe.shared.l1.needs_fp32_input() || s->moe.shared.l3.needs_fp32_input();
  }
  ctx_.tp_sum(f.f32(), N * D);  // row-parallel W2 (dense, shared and routed experts alike)
  be.add(s->x_mid.f32(), f.f32(), out, N * D);
  if (pass.saving) {  // what the backward reads, in BF16 under train.activations bf16
    ctx_.stash(&s->x_mid);
    // MoE: h2 is the router's input for its weight gradient; train.recompute selective makes it
    // again from x_mid in backward.
    if (!h2_held && ctx_.selective) s->h2.reset();
    if (!h2_held) ctx_.stash(&s->h2);
  }
}

void Block::backward(BlockSaved& s, const float* dout, float* dx, float aux_grad_scale, LaterWork* weights) {
  const ModelConfig& m = ctx_.local;
  const int64_t N = s.B * s.T, D = m.d_model;
  Backend& be = ctx_.be;
  const Pass pass = Pass::backward();
  // FFN branch: x_out = x_mid + FFN(RMSNorm(x_mid)).
  Tensor dh2(be, DType::f32, {N, D});
  if (!is_moe()) {
    ffn_backward(be, s.dense, dense_.weights(), dout, dense_.fp8(ctx_.fp8, pass), dh2.f32(), dense_.grads(), weights);
    ctx_.tp_sum(dh2.f32(), N * D);  // column-parallel W1, W3: partial input gradients
  }
  if (is_moe()) {
    // The router's input (the FFN norm's output) in FP32, made for the router's backward, the
    // layer's last op: widened from its BF16 copy, or (train.recompute selective dropped it) the
    // forward's norm again on x_mid as kept, the same bits.
    auto router_input = [&](Tensor* h2w) -> const float* {
      if (!s.h2.empty()) return ctx_.unstash(s.h2, h2w);
      Tensor rstd(be, DType::f32, {N});
      *h2w = Tensor(be, DType::f32, {N, D});
      ctx_.norm_forward(s.x_mid, ffn_norm_.w, N, D, float(m.norm_eps), h2w->f32(), rstd.f32());  // (x_mid as kept)
      ctx_.round_activation(*h2w);
      return h2w->f32();
    };
    moe_backward(be, s.moe, D, m.moe, moe_, dout, aux_grad_scale, moe_fp8(pass), dh2.f32(), moe_grads_,
                 ctx_.dispatcher, ctx_.tp, ctx_.activations, router_input, weights);
  }
  Tensor dx_mid(be, DType::f32, {N, D});
  ctx_.norm_backward(s.x_mid, ffn_norm_.w, s.rstd2.f32(), dh2.f32(), N, D, dx_mid.f32(), ffn_norm_.g);
  // The FFN branch's state is read: freed before the attention's backward (the block's peak).
  s.moe = MoeSaved{}, s.dense = FfnSaved{}, s.x_mid.reset(), s.h2.reset(), s.rstd2.reset(), dh2.reset();
  be.add(dx_mid.f32(), dout, dx_mid.f32(), N * D);

  // Attention branch: x_mid = x + Attention(h1), h1 = RMSNorm(x).
  Tensor dh1(be, DType::f32, {N, D});
  attn_->backward(*s.attn, dx_mid.f32(), dh1.f32(), weights);
  norm_backward(s.x, s.x_kept, attn_norm_, s.rstd1.f32(), dh1.f32(), N, dx);
  be.add(dx, dx_mid.f32(), dx, N * D);
}

void Block::norm_backward(const float* x, const Tensor* kept, const Weight& norm, const float* rstd, const float* dy,
                          int64_t N, float* dx) const {
  const int64_t D = ctx_.local.d_model;
  if (x)
    ctx_.be.rmsnorm_backward(x, norm.w, rstd, dy, N, D, dx, norm.g);
  else
    ctx_.norm_backward(*kept, norm.w, rstd, dy, N, D, dx, norm.g);
}

void Block::recompute_if_dropped(const float* x, BlockSaved* s) {
  if (s->kept) return;
  Tensor scratch(ctx_.be, DType::f32, {s->B * s->T, ctx_.model.d_model});
  forward(x, s->B, s->T, scratch.f32(), s, Pass::recomputation(), nullptr);
}

}  // namespace fp8moe
