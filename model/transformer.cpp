#include "model/transformer.h"

#include <algorithm>
#include <cmath>

#include "kernels/check.h"
#include "kernels/rope.h"

namespace fp8moe {

struct Transformer::BlockSaved {
  const float* x = nullptr;  // (N, D) block input, held by the stage run
  Tensor h1, rstd1;          // attention norm output (N, D), (N)
  Tensor q, k, v;            // after RoPE: (N, H*hd), (N, KVH*hd)
  Tensor attn, lse;          // (N, H*hd), (B, H, T)
  LinearSaved lq, lk, lv, lo;
  Tensor x_mid;              // (N, D) after the attention residual
  Tensor h2, rstd2;          // FFN norm output, (N)
  FfnSaved dense;
  MoeSaved moe;
  int64_t B = 0, T = 0;
  bool kept = false;         // false: recomputed in backward

  // Activation bytes held for backward, the block input included.
  int64_t bytes(int64_t D) const {
    const size_t b = h1.bytes() + rstd1.bytes() + q.bytes() + k.bytes() + v.bytes() + attn.bytes() + lse.bytes() +
                     x_mid.bytes() + h2.bytes() + rstd2.bytes();
    return int64_t(b) + B * T * D * int64_t(sizeof(float)) + lq.fp8_activation_bytes() + lk.fp8_activation_bytes() +
           lv.fp8_activation_bytes() + lo.fp8_activation_bytes() + dense.bytes() + moe.bytes();
  }
};

namespace {
GridPosition position_in(const ModelGroups& g) {
  GridPosition at;
  if (g.tensor) at.tensor_rank = g.tensor->rank(), at.tensor = g.tensor->size();
  if (g.pipeline) at.stage = g.pipeline->rank(), at.stages = g.pipeline->size();
  if (g.expert) at.expert_rank = g.expert->rank(), at.experts = g.expert->size();
  return at;
}

int64_t count_targets(const int32_t* targets, int64_t N, int32_t pad) {
  return std::count_if(targets, targets + N, [&](int32_t t) { return t != pad; });
}
}  // namespace

Transformer::Transformer(Backend& be, const Config& cfg, ModelGroups groups)
    : be_(be), cfg_(cfg), table_(build_param_table(cfg.model)), groups_(groups),
      placement_(cfg.model, position_in(groups)) {
  if (groups.expert && groups.expert->size() > 1) {
    FP8MOE_ASSERT(groups.expert_counts, "expert parallelism needs the expert group's host communicator");
    dispatcher_ = std::make_unique<ExpertDispatcher>(be, *groups.expert, *groups.expert_counts, cfg.model.moe.n_experts);
  }
  std::vector<Shard> shards;
  for (const ParamSpec& p : table_.params) shards.push_back(placement_.shard(p));
  store_ = std::make_unique<ParamStore>(be, table_, shards, uint64_t(cfg.train.seed));
  weights_.resize(table_.params.size());
  fp8_counts_ = Tensor::zeros(be, DType::u64, {2});
  loads_h_ = HostBuffer<int64_t>(be, cfg.model.moe.n_experts);
  ensure_rope(cfg.train.seq_len);
}

Transformer::~Transformer() = default;

size_t Transformer::slot(const std::string& name) const {
  const int64_t i = table_.index_of(name);
  FP8MOE_ASSERT(i >= 0, "no parameter named ", name);
  return size_t(i);
}

void Transformer::ensure_rope(int64_t T) {
  const int64_t hd = cfg_.model.head_dim, half = hd / 2;
  if (T <= rope_T_) return;
  // Built once per length in double on the host (cpu::rope_table: the same table on every backend)
  // and kept in device memory; a longer sequence rebuilds it (generation beyond train.seq_len).
  std::vector<float> cs(size_t(T * half)), sn(cs.size()), csi(cs.size()), sni(cs.size());
  cpu::rope_table(T, hd, cfg_.model.rope_theta, false, cs.data(), sn.data());
  cpu::rope_table(T, hd, cfg_.model.rope_theta, true, csi.data(), sni.data());
  rope_cs_ = tensor_from(be_, cs, {T, half}), rope_sn_ = tensor_from(be_, sn, {T, half});
  rope_cs_inv_ = tensor_from(be_, csi, {T, half}), rope_sn_inv_ = tensor_from(be_, sni, {T, half});
  rope_T_ = T;
}

void Transformer::tp_sum(float* x, int64_t n) {
  if (tp_size() > 1) groups_.tensor->allreduce_sum(x, n);
}

void Transformer::embed_forward(const int32_t* tokens, int64_t N, float* out) {
  const int64_t D = local().d_model, Vl = local().vocab_size, v0 = placement_.vocab_first();
  be_.embedding_forward(P("embed.weight"), tokens, N, D, v0, Vl, out);
  tp_sum(out, N * D);  // each token's row comes from the one rank holding it
}

void Transformer::embed_backward(const float* dx, const int32_t* tokens, int64_t N) {
  const int64_t D = local().d_model, Vl = local().vocab_size, v0 = placement_.vocab_first();
  be_.embedding_backward(dx, tokens, N, D, v0, Vl, G("embed.weight"));
}

void Transformer::cross_entropy(const float* logits, const int32_t* targets, int64_t N, float grad_scale,
                                float* dlogits, double* loss_sum) {
  const int64_t Vl = local().vocab_size, v0 = placement_.vocab_first();
  const int32_t pad = cfg_.model.pad_id;
  if (tp_size() == 1) return be_.cross_entropy(logits, targets, N, Vl, pad, grad_scale, dlogits, loss_sum);
  // Row max, sum of exponentials and the target's logit over the whole vocabulary: three
  // all-reduces of N values over the tensor group.
  Tensor mx(be_, DType::f32, {N}), se(be_, DType::f64, {N}), tl(be_, DType::f64, {N});
  be_.ce_row_max(logits, N, Vl, mx.f32());
  groups_.tensor->allreduce_max(mx.f32(), N);
  be_.ce_partials(logits, targets, N, Vl, v0, pad, mx.f32(), se.data<double>(), tl.data<double>());
  groups_.tensor->allreduce_sum(se.data<double>(), N);
  groups_.tensor->allreduce_sum(tl.data<double>(), N);
  be_.ce_finish(logits, targets, N, Vl, v0, pad, mx.f32(), se.data<double>(), tl.data<double>(), grad_scale, dlogits,
                loss_sum);
}

LinearFp8 Transformer::fp8_for(const std::string& weight, LinearClass cls, bool record) {
  const Fp8Layers& on = cfg_.fp8.layers;
  const bool enabled = (cls == LinearClass::attention && on.attention) || (cls == LinearClass::mlp && on.mlp) ||
                       (cls == LinearClass::experts && on.experts) || (cls == LinearClass::shared_experts && on.shared_experts);
  LinearFp8 f;
  if (enabled && cfg_.fp8.recipe != Fp8Recipe::off) {
    f.cfg = &cfg_.fp8;
    f.state = &scaling_[weight];
    f.counts = fp8_counts();
    // A training pass and its recomputation use the step's FP8 weight; an evaluation quantizes
    // the current weights afresh and leaves the cache alone.
    if (record || recompute_) f.weight = &weights_[slot(weight)], f.step = step_id_;
    // Per-tensor amax: over the tensor group (a split tensor's amax is the whole tensor's; the
    // quantization then does not depend on tp), and for delayed scaling also over the replicas.
    Communicator* tp = tp_size() > 1 ? groups_.tensor : nullptr;
    Communicator* g = cls == LinearClass::experts ? groups_.expert_data : groups_.data;
    if (!(cfg_.fp8.recipe == Fp8Recipe::delayed && g && g->size() > 1 && record)) g = nullptr;
    if (tp || g)
      f.reduce = [tp, g](float* amax, int64_t n) {
        if (tp) tp->allreduce_max(amax, n);
        if (g) g->allreduce_max(amax, n);
      };
  }
  f.record = record;
  f.reuse_last_scale = !record && recompute_;
  f.backward_follows = saving_;
  return f;
}

FfnWeights Transformer::ffn_weights(const std::string& prefix) const {
  return {P(prefix + "w1"), P(prefix + "w3"), P(prefix + "w2")};
}
FfnGrads Transformer::ffn_grads(const std::string& prefix) { return {G(prefix + "w1"), G(prefix + "w3"), G(prefix + "w2")}; }
FfnFp8 Transformer::ffn_fp8(const std::string& prefix, LinearClass cls, bool record) {
  return {fp8_for(prefix + "w1", cls, record), fp8_for(prefix + "w3", cls, record), fp8_for(prefix + "w2", cls, record)};
}

MoeWeights Transformer::moe_weights(int layer) const {
  const std::string p = "layers." + std::to_string(layer) + ".moe.";
  MoeWeights w;
  w.router = P(p + "router");
  w.router_bias = P(p + "router_bias");
  w.shared = cfg_.model.moe.n_shared_experts > 0 ? ffn_weights(p + "shared.") : FfnWeights{nullptr, nullptr, nullptr};
  for (int e = placement_.first_expert(); e < placement_.first_expert() + placement_.local_experts(); ++e)
    w.experts.push_back(ffn_weights(p + "experts." + std::to_string(e) + "."));
  return w;
}

bool Transformer::recomputed(int layer) const {
  switch (cfg_.train.recompute) {
    case Recompute::full: return true;
    case Recompute::moe: return layer >= cfg_.model.first_dense_layers;
    default: return false;
  }
}

void Transformer::block_forward(int l, const float* x, int64_t B, int64_t T, float* out, BlockSaved* s, bool record,
                                double* aux) {
  const ModelConfig& m = local();  // heads and widths of this tensor-parallel rank
  const int64_t N = B * T, D = m.d_model, H = m.n_heads, KVH = m.n_kv_heads, hd = m.head_dim;
  const std::string p = "layers." + std::to_string(l) + ".";
  s->B = B, s->T = T;
  s->x = x;
  // A backward reads this pass's state after a recomputation, or after a training forward of a
  // block that is not recomputed (otherwise the state is dropped at the end of the forward).
  saving_ = recompute_ || (record && !recomputed(l));
  s->h1 = Tensor(be_, DType::f32, {N, D});
  s->rstd1 = Tensor(be_, DType::f32, {N});
  be_.rmsnorm_forward(x, P(p + "attn_norm.weight"), N, D, float(m.norm_eps), s->h1.f32(), s->rstd1.f32());
  s->q = Tensor(be_, DType::f32, {N, H * hd});
  s->k = Tensor(be_, DType::f32, {N, KVH * hd});
  s->v = Tensor(be_, DType::f32, {N, KVH * hd});
  linear_forward(be_, s->h1.f32(), N, D, P(p + "attn.wq"), H * hd, fp8_for(p + "attn.wq", LinearClass::attention, record), s->q.f32(), &s->lq);
  linear_forward(be_, s->h1.f32(), N, D, P(p + "attn.wk"), KVH * hd, fp8_for(p + "attn.wk", LinearClass::attention, record), s->k.f32(), &s->lk);
  linear_forward(be_, s->h1.f32(), N, D, P(p + "attn.wv"), KVH * hd, fp8_for(p + "attn.wv", LinearClass::attention, record), s->v.f32(), &s->lv);
  if (!s->lq.needs_fp32_input() && !s->lk.needs_fp32_input() && !s->lv.needs_fp32_input())
    s->h1.reset();  // q, k, v keep their input in FP8
  be_.rope(s->q.f32(), B, T, H, hd, rope_cs_.f32(), rope_sn_.f32());
  be_.rope(s->k.f32(), B, T, KVH, hd, rope_cs_.f32(), rope_sn_.f32());
  s->attn = Tensor(be_, DType::f32, {N, H * hd});
  s->lse = Tensor(be_, DType::f32, {B * H * T});
  be_.attention_forward(s->q.f32(), s->k.f32(), s->v.f32(), B, T, H, KVH, hd, s->attn.f32(), s->lse.f32());
  Tensor o(be_, DType::f32, {N, D});
  linear_forward(be_, s->attn.f32(), N, H * hd, P(p + "attn.wo"), D, fp8_for(p + "attn.wo", LinearClass::attention, record), o.f32(), &s->lo);
  tp_sum(o.f32(), N * D);  // row-parallel: partial sums over the heads of each rank
  s->x_mid = Tensor(be_, DType::f32, {N, D});
  be_.add(x, o.f32(), s->x_mid.f32(), N * D);

  s->h2 = Tensor(be_, DType::f32, {N, D});
  s->rstd2 = Tensor(be_, DType::f32, {N});
  be_.rmsnorm_forward(s->x_mid.f32(), P(p + "ffn_norm.weight"), N, D, float(m.norm_eps), s->h2.f32(), s->rstd2.f32());
  Tensor f(be_, DType::f32, {N, D});
  if (l < m.first_dense_layers) {
    ffn_forward(be_, s->h2.f32(), N, D, m.d_ff_dense, ffn_weights(p + "mlp."), ffn_fp8(p + "mlp.", LinearClass::mlp, record),
                f.f32(), &s->dense);
    if (!s->dense.l1.needs_fp32_input() && !s->dense.l3.needs_fp32_input()) s->h2.reset();
  } else {
    MoeFp8 fp8{ffn_fp8(p + "moe.shared.", LinearClass::shared_experts, record), {}};
    for (int e = placement_.first_expert(); e < placement_.first_expert() + placement_.local_experts(); ++e)
      fp8.experts.push_back(ffn_fp8(p + "moe.experts." + std::to_string(e) + ".", LinearClass::experts, record));
    moe_forward(be_, s->h2.f32(), N, D, m.moe, moe_weights(l), fp8, f.f32(), &s->moe, dispatcher_.get(), aux,
                &loads_h_);
  }
  tp_sum(f.f32(), N * D);  // row-parallel W2 (dense, shared and routed experts alike)
  be_.add(s->x_mid.f32(), f.f32(), out, N * D);
}

void Transformer::block_backward(int l, const BlockSaved& s, const float* dout, float* dx, float aux_grad_scale) {
  const ModelConfig& m = local();
  const int64_t B = s.B, T = s.T, N = B * T, D = m.d_model, H = m.n_heads, KVH = m.n_kv_heads, hd = m.head_dim;
  const std::string p = "layers." + std::to_string(l) + ".";
  // FFN branch: x_out = x_mid + FFN(RMSNorm(x_mid)).
  Tensor dh2(be_, DType::f32, {N, D}), dx_mid(be_, DType::f32, {N, D});
  if (l < m.first_dense_layers) {
    ffn_backward(be_, s.dense, ffn_weights(p + "mlp."), dout, ffn_fp8(p + "mlp.", LinearClass::mlp, true), dh2.f32(),
                 ffn_grads(p + "mlp."));
    tp_sum(dh2.f32(), N * D);  // column-parallel W1, W3: partial input gradients
  } else {
    MoeFp8 fp8{ffn_fp8(p + "moe.shared.", LinearClass::shared_experts, true), {}};
    MoeGrads g{G(p + "moe.router"), m.moe.n_shared_experts > 0 ? ffn_grads(p + "moe.shared.") : FfnGrads{}, {}};
    for (int e = placement_.first_expert(); e < placement_.first_expert() + placement_.local_experts(); ++e) {
      const std::string q = p + "moe.experts." + std::to_string(e) + ".";
      fp8.experts.push_back(ffn_fp8(q, LinearClass::experts, true));
      g.experts.push_back(ffn_grads(q));
    }
    moe_backward(be_, s.moe, D, m.moe, moe_weights(l), dout, aux_grad_scale, fp8, dh2.f32(), g, dispatcher_.get(),
                 tp_size() > 1 ? groups_.tensor : nullptr);
  }
  be_.rmsnorm_backward(s.x_mid.f32(), P(p + "ffn_norm.weight"), s.rstd2.f32(), dh2.f32(), N, D, dx_mid.f32(),
                       G(p + "ffn_norm.weight"));
  be_.add(dx_mid.f32(), dout, dx_mid.f32(), N * D);

  // Attention branch: x_mid = x + Wo(Attention(RoPE(Wq h1), RoPE(Wk h1), Wv h1)), h1 = RMSNorm(x).
  Tensor da(be_, DType::f32, {N, H * hd}), dq(be_, DType::f32, {N, H * hd}), dk(be_, DType::f32, {N, KVH * hd}),
      dv(be_, DType::f32, {N, KVH * hd});
  linear_backward(be_, s.lo, P(p + "attn.wo"), dx_mid.f32(), fp8_for(p + "attn.wo", LinearClass::attention, true),
                  da.f32(), G(p + "attn.wo"));
  be_.attention_backward(s.q.f32(), s.k.f32(), s.v.f32(), s.attn.f32(), s.lse.f32(), da.f32(), B, T, H, KVH, hd,
                         dq.f32(), dk.f32(), dv.f32());
  be_.rope(dq.f32(), B, T, H, hd, rope_cs_inv_.f32(), rope_sn_inv_.f32());
  be_.rope(dk.f32(), B, T, KVH, hd, rope_cs_inv_.f32(), rope_sn_inv_.f32());
  Tensor dh1(be_, DType::f32, {N, D}), part(be_, DType::f32, {N, D});
  linear_backward(be_, s.lq, P(p + "attn.wq"), dq.f32(), fp8_for(p + "attn.wq", LinearClass::attention, true), dh1.f32(),
                  G(p + "attn.wq"));
  linear_backward(be_, s.lk, P(p + "attn.wk"), dk.f32(), fp8_for(p + "attn.wk", LinearClass::attention, true),
                  part.f32(), G(p + "attn.wk"));
  be_.add(dh1.f32(), part.f32(), dh1.f32(), N * D);
  linear_backward(be_, s.lv, P(p + "attn.wv"), dv.f32(), fp8_for(p + "attn.wv", LinearClass::attention, true),
                  part.f32(), G(p + "attn.wv"));
  be_.add(dh1.f32(), part.f32(), dh1.f32(), N * D);
  tp_sum(dh1.f32(), N * D);  // column-parallel q, k, v
  be_.rmsnorm_backward(s.x, P(p + "attn_norm.weight"), s.rstd1.f32(), dh1.f32(), N, D, dx, G(p + "attn_norm.weight"));
  be_.add(dx, dx_mid.f32(), dx, N * D);
}

std::vector<float> Transformer::next_token_logits(const int32_t* tokens, int64_t T) {
  FP8MOE_ASSERT(tp_size() == 1 && !dispatcher_, "generation runs on one rank holding the whole model");
  const ModelConfig& m = cfg_.model;
  const int64_t D = m.d_model, V = m.vocab_size;
  for (int64_t i = 0; i < T; ++i)
    FP8MOE_ASSERT(tokens[i] >= 0 && tokens[i] < V, "token ", tokens[i], " outside the vocabulary of ", V);
  ensure_rope(T);
  const Tensor ids = tensor_from(be_, std::vector<int32_t>(tokens, tokens + T), {T});
  Tensor x(be_, DType::f32, {T, D}), y(be_, DType::f32, {T, D});
  be_.embedding_forward(P("embed.weight"), ids.data<int32_t>(), T, D, 0, V, x.f32());
  for (int l = 0; l < m.n_layers; ++l) {
    BlockSaved s;
    block_forward(l, x.f32(), 1, T, y.f32(), &s, /*record=*/false, nullptr);
    std::swap(x, y);
  }
  Tensor h(be_, DType::f32, {D}), rstd(be_, DType::f32, {1}), logits(be_, DType::f32, {V});
  be_.rmsnorm_forward(x.f32() + (T - 1) * D, P("final_norm.weight"), 1, D, float(m.norm_eps), h.f32(), rstd.f32());
  be_.sgemm(false, true, 1, V, D, 1.0f, h.f32(), D, P("head.weight"), D, 0.0f, logits.f32(), V);
  return to_host<float>(logits);
}

void Transformer::update_router_biases(const std::vector<std::vector<int64_t>>& expert_load) {
  const ModelConfig& m = cfg_.model;
  FP8MOE_ASSERT(int64_t(expert_load.size()) == m.n_layers - m.first_dense_layers, "expert loads of ",
                expert_load.size(), " MoE layers");
  for (int l = std::max(m.first_dense_layers, placement_.layer_begin()); l < placement_.layer_end(); ++l) {
    const std::vector<int64_t>& load = expert_load[size_t(l - m.first_dense_layers)];
    if (load.empty()) continue;
    const Tensor d = tensor_from(be_, load, {int64_t(load.size())});
    be_.bias_update(store_->param(slot("layers." + std::to_string(l) + ".moe.router_bias")), d.data<int64_t>(),
                    int64_t(load.size()), m.moe.bias_update_rate);
  }
}

std::map<std::string, HostLinearScaling> Transformer::fp8_scaling_to_host() const {
  std::map<std::string, HostLinearScaling> out;
  for (const auto& [name, s] : scaling_)
    out[name] = {delayed_to_host(be_, s.x), delayed_to_host(be_, s.w), delayed_to_host(be_, s.dy)};
  return out;
}

void Transformer::set_fp8_scaling(const std::map<std::string, HostLinearScaling>& scaling) {
  scaling_.clear();
  for (const auto& [name, s] : scaling)
    scaling_[name] = {delayed_from_host(be_, s.x), delayed_from_host(be_, s.w), delayed_from_host(be_, s.dy)};
}

struct StageRun::Impl {
  int64_t B = 0, T = 0, N = 0;
  const int32_t* tokens = nullptr;   // first stage: for the embedding's backward (the caller's memory)
  std::vector<Tensor> xs;            // block inputs of this stage, then its output
  std::vector<Transformer::BlockSaved> saved;
  Tensor hf, rstd, dlogits;          // last stage
  Tensor dx;                         // after backward: the gradient of this stage's input
  Tensor own_tokens, own_targets;    // forward_backward: the batch uploaded
  StepResult result;
  bool backward = false;
  float aux_grad_scale = 1.0f;
};

StageRun::StageRun() = default;
StageRun::~StageRun() = default;
StageRun::StageRun(StageRun&&) noexcept = default;
StageRun& StageRun::operator=(StageRun&&) noexcept = default;
const StepResult& StageRun::result() const { return impl_->result; }
const float* StageRun::output() const { return impl_->xs.back().f32(); }
const float* StageRun::input_grad() const { return impl_->dx.f32(); }
int64_t StageRun::activation_size() const { return impl_->xs.back().numel(); }

StepResult Transformer::forward_backward(const int32_t* tokens, const int32_t* targets, int64_t B, int64_t T,
                                         bool backward, float loss_scale, int64_t mean_over, double aux_weight) {
  FP8MOE_ASSERT(placement_.first_stage() && placement_.last_stage(), "forward_backward on one pipeline stage of several");
  const ModelConfig& m = cfg_.model;
  const int64_t N = B * T, moe_layers = m.n_layers - m.first_dense_layers;
  for (int64_t i = 0; i < N; ++i)
    FP8MOE_ASSERT(tokens[i] >= 0 && tokens[i] < m.vocab_size, "token ", tokens[i], " outside the vocabulary of ",
                  m.vocab_size);
  Tensor ids = tensor_from(be_, std::vector<int32_t>(tokens, tokens + N), {N});
  Tensor tgt = tensor_from(be_, std::vector<int32_t>(targets, targets + N), {N});
  Tensor losses = Tensor::zeros(be_, DType::f64, {1 + moe_layers});
  const int64_t counted = count_targets(targets, N, m.pad_id);
  if (backward) begin_step();
  StageRun run = stage_forward(ids.data<int32_t>(), tgt.data<int32_t>(), counted, B, T, nullptr, backward,
                               {losses.data<double>(), losses.data<double>() + 1}, loss_scale, mean_over, aux_weight);
  if (backward) stage_backward(run, nullptr);
  // The losses as the training loop combines them (app/stage_runner.cpp).
  StepResult r = run.result();
  const std::vector<double> h = to_host<double>(losses);
  const int64_t denom = mean_over > 0 ? mean_over : counted;
  r.ce = denom > 0 ? h[0] / double(denom) : 0.0;
  for (int64_t l = 0; l < moe_layers; ++l) r.aux += h[size_t(1 + l)];
  r.aux *= aux_weight;
  r.loss = r.ce + r.aux;
  return r;
}

StageRun Transformer::stage_forward(const int32_t* tokens, const int32_t* targets, int64_t counted, int64_t B,
                                    int64_t T, const float* x_in, bool backward, const LossSlots& slots,
                                    float loss_scale, int64_t mean_over, double aux_weight) {
  const ModelConfig& m = cfg_.model;
  const int64_t N = B * T, D = m.d_model, V = local().vocab_size;  // V: this rank's vocabulary
  const int L0 = placement_.layer_begin(), L1 = placement_.layer_end();
  ensure_rope(T);
  StageRun run;
  run.impl_ = std::make_unique<StageRun::Impl>();
  StageRun::Impl& st = *run.impl_;
  st.B = B, st.T = T, st.N = N, st.backward = backward;
  st.aux_grad_scale = float(loss_scale * aux_weight);
  StepResult& result = st.result;

  for (int l = L0; l <= L1; ++l) st.xs.emplace_back(be_, DType::f32, Shape{N, D});
  if (placement_.first_stage()) {
    embed_forward(tokens, N, st.xs[0].f32());
    st.tokens = tokens;
  } else {
    be_.copy(st.xs[0].f32(), x_in, size_t(N * D) * sizeof(float));
  }
  st.saved.resize(size_t(L1 - L0));
  result.expert_load.resize(size_t(m.n_layers - m.first_dense_layers));
  result.routing.resize(size_t(m.n_layers - m.first_dense_layers));
  int64_t saved_bytes = 0;
  for (int l = L0; l < L1; ++l) {
    BlockSaved& sv = st.saved[size_t(l - L0)];
    const int moe = l - m.first_dense_layers;
    block_forward(l, st.xs[size_t(l - L0)].f32(), B, T, st.xs[size_t(l - L0 + 1)].f32(), &sv, /*record=*/backward,
                  moe >= 0 && slots.aux ? slots.aux + moe : nullptr);
    sv.kept = !recomputed(l);
    if (moe >= 0) {
      result.expert_load[size_t(moe)] = sv.moe.routing.load_host;
      result.dropped += sv.moe.routing.dropped();
      if (keep_routing_) result.routing[size_t(moe)] = to_host<int32_t>(sv.moe.routing.expert);
    }
    if (!sv.kept) {  // keep only the block input and the MoE routing; the rest is recomputed in backward
      MoeRouting routing = std::move(sv.moe.routing);
      const int64_t keepB = sv.B, keepT = sv.T;
      sv = BlockSaved{};
      sv.B = keepB, sv.T = keepT;
      sv.moe.routing = std::move(routing);
      saved_bytes += N * D * int64_t(sizeof(float)) + sv.moe.routing.bytes();
    } else {
      saved_bytes += sv.bytes(D);
    }
  }
  saved_bytes_per_token_ = N > 0 && L1 > L0 ? double(saved_bytes) / double(N) / double(L1 - L0) : 0.0;
  if (placement_.last_stage()) {
    st.hf = Tensor(be_, DType::f32, {N, D});
    st.rstd = Tensor(be_, DType::f32, {N});
    Tensor logits(be_, DType::f32, {N, V});
    be_.rmsnorm_forward(st.xs.back().f32(), P("final_norm.weight"), N, D, float(m.norm_eps), st.hf.f32(), st.rstd.f32());
    be_.sgemm(false, true, N, V, D, 1.0f, st.hf.f32(), D, P("head.weight"), D, 0.0f, logits.f32(), V);  // FP32 head
    if (backward) st.dlogits = Tensor(be_, DType::f32, {N, V});
    const int64_t denom = mean_over > 0 ? mean_over : counted;
    const float scale = denom > 0 ? loss_scale / float(denom) : 0.0f;  // d (scaled mean) / d logits
    Tensor scratch;
    double* loss_sum = slots.ce_sum;
    if (!loss_sum) scratch = Tensor(be_, DType::f64, {1}), loss_sum = scratch.data<double>();
    cross_entropy(logits.f32(), targets, N, scale, backward ? st.dlogits.f32() : nullptr, loss_sum);
    result.tokens = counted;
  }
  if (!backward) st.saved.clear(), st.xs.erase(st.xs.begin(), st.xs.end() - 1);
  return run;
}

void Transformer::stage_backward(StageRun& run, const float* dy) {
  StageRun::Impl& st = *run.impl_;
  FP8MOE_ASSERT(st.backward, "stage_backward of a forward without backward");
  const ModelConfig& m = cfg_.model;
  const int64_t N = st.N, B = st.B, T = st.T, D = m.d_model, V = local().vocab_size;
  const int L0 = placement_.layer_begin(), L1 = placement_.layer_end();
  Tensor dx(be_, DType::f32, {N, D}), dnext(be_, DType::f32, {N, D});
  if (placement_.last_stage()) {
    Tensor dh(be_, DType::f32, {N, D});
    be_.sgemm(true, false, V, D, N, 1.0f, st.dlogits.f32(), V, st.hf.f32(), D, 1.0f, G("head.weight"), D);
    be_.sgemm(false, false, N, D, V, 1.0f, st.dlogits.f32(), V, P("head.weight"), D, 0.0f, dh.f32(), D);
    tp_sum(dh.f32(), N * D);  // vocabulary-parallel head
    be_.rmsnorm_backward(st.xs.back().f32(), P("final_norm.weight"), st.rstd.f32(), dh.f32(), N, D, dx.f32(),
                         G("final_norm.weight"));
    st.dlogits.reset(), st.hf.reset();
  } else {
    be_.copy(dx.f32(), dy, size_t(N * D) * sizeof(float));
  }
  for (int l = L1 - 1; l >= L0; --l) {
    BlockSaved& sv = st.saved[size_t(l - L0)];
    if (!sv.kept) {  // recompute with the forward's scales, weights and routing, advancing no history
      Tensor scratch(be_, DType::f32, {N, D});
      recompute_ = true;
      block_forward(l, st.xs[size_t(l - L0)].f32(), B, T, scratch.f32(), &sv, false, nullptr);
      recompute_ = false;
    }
    block_backward(l, sv, dx.f32(), dnext.f32(), st.aux_grad_scale);
    sv = BlockSaved{};
    std::swap(dx, dnext);
  }
  if (placement_.first_stage()) embed_backward(dx.f32(), st.tokens, N);
  st.dx = std::move(dx);
  st.saved.clear();
  st.xs.erase(st.xs.begin(), st.xs.end() - 1);
}

}  // namespace fp8moe
