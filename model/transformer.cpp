#include "model/transformer.h"

#include <algorithm>
#include <cmath>

#include "kernels/check.h"
#include "kernels/rope.h"

namespace fp8moe {

struct Transformer::BlockSaved {
  const float* x = nullptr;  // (N, D) block input, held by the stage run
  Tensor h1, rstd1;          // attention norm output (N, D), (N)
  // After RoPE, GQA: (N, H*hd), (N, KVH*hd), (N, KVH*hd); MLA: (N, H*qk), (N, H*qk), (N, H*v) with
  // qk = qk_nope + qk_rope, every head's key holding the one shared rotated key.
  Tensor q, k, v;
  Tensor attn, lse;          // (N, H*v), (B, H, T)
  LinearSaved lq, lk, lv, lo;  // lq: wq (GQA, MLA without q_lora) or wq_b
  // MLA: the query latent (N, q_lora) before and after its RMSNorm (the normalised one only while
  // wq_b needs its FP32 input), the key-value latent (N, kv_lora) likewise, the norms' 1 / rms.
  Tensor cq, rstd_q, cqn, ckv, rstd_kv, ckvn;
  LinearSaved lq_a, lkv_a, lkv_b;
  Tensor x_mid;              // (N, D) after the attention residual
  Tensor h2, rstd2;          // FFN norm output, (N)
  FfnSaved dense;
  MoeSaved moe;
  int64_t B = 0, T = 0;
  bool kept = false;         // false: recomputed in backward

  // Activation bytes held for backward, the block input included.
  int64_t bytes(int64_t D) const {
    const size_t b = h1.bytes() + rstd1.bytes() + q.bytes() + k.bytes() + v.bytes() + attn.bytes() + lse.bytes() +
                     x_mid.bytes() + h2.bytes() + rstd2.bytes() + cq.bytes() + rstd_q.bytes() + cqn.bytes() +
                     ckv.bytes() + rstd_kv.bytes() + ckvn.bytes();
    int64_t fp8 = 0;
    for (const LinearSaved* l : {&lq, &lk, &lv, &lo, &lq_a, &lkv_a, &lkv_b}) fp8 += l->fp8_activation_bytes();
    return int64_t(b) + B * T * D * int64_t(sizeof(float)) + fp8 + dense.bytes() + moe.bytes();
  }
  // Everything dropped but B, T and the MoE routing: the block is recomputed in backward (with the
  // forward's routing: no synchronisation of its own).
  void keep_only_routing() {
    MoeRouting routing = std::move(moe.routing);
    const int64_t b = B, t = T;
    *this = BlockSaved{};
    B = b, T = t;
    moe.routing = std::move(routing);
  }
  // Whether a linear layer reading the attention norm's output h1 needs it in FP32 for its backward
  // (q_latent: MLA with q_lora_rank > 0, whose wq_b reads the query latent instead).
  bool h1_needed(bool q_latent) const {
    return lq_a.needs_fp32_input() || lkv_a.needs_fp32_input() || lk.needs_fp32_input() || lv.needs_fp32_input() ||
           (!q_latent && lq.needs_fp32_input());
  }
};

// One multi-token prediction module's forward state (last stage).
struct Transformer::MtpSaved {
  BlockSaved block;
  Tensor rstd_e, rstd_h;  // (N) enorm's and hnorm's 1 / rms
  Tensor cat;             // (N, 2D) [enorm(embedding) | hnorm(h)], eh_proj's input
  Tensor x, out;          // (N, D) the block's input (eh_proj's output) and output
  Tensor hf, rstd_f;      // (N, D), (N) the module's final norm, the head's input
  Tensor dlogits;         // (N, V) the gradient of its logits
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
  const int64_t hd = cfg_.model.rope_dim(), half = hd / 2;  // the channels of a head that RoPE rotates
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
  const std::string p = block_prefix(cfg_.model, layer) + "moe.";
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

void Transformer::gqa_forward(int l, int64_t B, int64_t T, float* o, BlockSaved* s, bool record) {
  const ModelConfig& m = local();
  const int64_t N = B * T, D = m.d_model, H = m.n_heads, KVH = m.n_kv_heads, hd = m.head_dim;
  const std::string p = block_prefix(cfg_.model, l) + "attn.";
  const float* h1 = s->h1.f32();
  s->q = Tensor(be_, DType::f32, {N, H * hd});
  s->k = Tensor(be_, DType::f32, {N, KVH * hd});
  s->v = Tensor(be_, DType::f32, {N, KVH * hd});
  linear_forward(be_, h1, N, D, P(p + "wq"), H * hd, fp8_for(p + "wq", LinearClass::attention, record), s->q.f32(), &s->lq);
  linear_forward(be_, h1, N, D, P(p + "wk"), KVH * hd, fp8_for(p + "wk", LinearClass::attention, record), s->k.f32(), &s->lk);
  linear_forward(be_, h1, N, D, P(p + "wv"), KVH * hd, fp8_for(p + "wv", LinearClass::attention, record), s->v.f32(), &s->lv);
  be_.rope(s->q.f32(), B, T, H, hd, rope_cs_.f32(), rope_sn_.f32(), hd);
  be_.rope(s->k.f32(), B, T, KVH, hd, rope_cs_.f32(), rope_sn_.f32(), hd);
  s->attn = Tensor(be_, DType::f32, {N, H * hd});
  s->lse = Tensor(be_, DType::f32, {B * H * T});
  be_.attention_forward(s->q.f32(), s->k.f32(), s->v.f32(), B, T, H, KVH, hd, hd, s->attn.f32(), s->lse.f32());
  linear_forward(be_, s->attn.f32(), N, H * hd, P(p + "wo"), D, fp8_for(p + "wo", LinearClass::attention, record), o, &s->lo);
}

void Transformer::mla_forward(int l, int64_t B, int64_t T, float* o, BlockSaved* s, bool record) {
  const ModelConfig& m = local();  // n_heads: this rank's heads
  const int64_t N = B * T, D = m.d_model, H = m.n_heads, nope = m.qk_nope_head_dim, rope = m.qk_rope_head_dim;
  const int64_t qk = nope + rope, vd = m.v_head_dim, ql = m.q_lora_rank, kvl = m.kv_lora_rank;
  const float eps = float(m.norm_eps);
  const std::string p = block_prefix(cfg_.model, l) + "attn.";
  auto fp8 = [&](const char* w) { return fp8_for(p + w, LinearClass::attention, record); };
  const float* h1 = s->h1.f32();
  // Queries (N, H, qk): through the latent cq = RMSNorm(h1 Wq_a^T) when q_lora_rank > 0.
  s->q = Tensor(be_, DType::f32, {N, H * qk});
  if (ql > 0) {
    s->cq = Tensor(be_, DType::f32, {N, ql});
    linear_forward(be_, h1, N, D, P(p + "wq_a"), ql, fp8("wq_a"), s->cq.f32(), &s->lq_a);
    s->cqn = Tensor(be_, DType::f32, {N, ql});
    s->rstd_q = Tensor(be_, DType::f32, {N});
    be_.rmsnorm_forward(s->cq.f32(), P(p + "q_norm.weight"), N, ql, eps, s->cqn.f32(), s->rstd_q.f32());
    linear_forward(be_, s->cqn.f32(), N, ql, P(p + "wq_b"), H * qk, fp8("wq_b"), s->q.f32(), &s->lq);
    if (!s->lq.needs_fp32_input()) s->cqn.reset();
  } else {
    linear_forward(be_, h1, N, D, P(p + "wq"), H * qk, fp8("wq"), s->q.f32(), &s->lq);
  }
  // The key-value latent and the shared rotary key: h1 Wkv_a^T = [ckv (kv_lora) | kpe (rope)].
  Tensor ckv_pe(be_, DType::f32, {N, kvl + rope}), kpe(be_, DType::f32, {N, rope});
  linear_forward(be_, h1, N, D, P(p + "wkv_a"), kvl + rope, fp8("wkv_a"), ckv_pe.f32(), &s->lkv_a);
  s->ckv = Tensor(be_, DType::f32, {N, kvl});
  be_.copy_2d(s->ckv.f32(), kvl, ckv_pe.f32(), kvl + rope, N, kvl);
  be_.copy_2d(kpe.f32(), rope, ckv_pe.f32() + kvl, kvl + rope, N, rope);
  s->ckvn = Tensor(be_, DType::f32, {N, kvl});
  s->rstd_kv = Tensor(be_, DType::f32, {N});
  be_.rmsnorm_forward(s->ckv.f32(), P(p + "kv_norm.weight"), N, kvl, eps, s->ckvn.f32(), s->rstd_kv.f32());
  Tensor kv(be_, DType::f32, {N, H * (nope + vd)});  // per head [k_nope | v]
  linear_forward(be_, s->ckvn.f32(), N, kvl, P(p + "wkv_b"), H * (nope + vd), fp8("wkv_b"), kv.f32(), &s->lkv_b);
  if (!s->lkv_b.needs_fp32_input()) s->ckvn.reset();
  // RoPE on the last `rope` channels of each query head and on the shared key; then every head's
  // key is [k_nope | kpe].
  be_.rope(s->q.f32() + nope, B, T, H, rope, rope_cs_.f32(), rope_sn_.f32(), qk);
  be_.rope(kpe.f32(), B, T, 1, rope, rope_cs_.f32(), rope_sn_.f32(), rope);
  s->k = Tensor(be_, DType::f32, {N, H * qk});
  s->v = Tensor(be_, DType::f32, {N, H * vd});
  be_.mla_expand_kv(kv.f32(), kpe.f32(), N, H, nope, rope, vd, s->k.f32(), s->v.f32());
  s->attn = Tensor(be_, DType::f32, {N, H * vd});
  s->lse = Tensor(be_, DType::f32, {B * H * T});
  be_.attention_forward(s->q.f32(), s->k.f32(), s->v.f32(), B, T, H, H, qk, vd, s->attn.f32(), s->lse.f32());
  linear_forward(be_, s->attn.f32(), N, H * vd, P(p + "wo"), D, fp8("wo"), o, &s->lo);
}

void Transformer::block_forward(int l, const float* x, int64_t B, int64_t T, float* out, BlockSaved* s, bool record,
                                double* aux) {
  const ModelConfig& m = local();  // heads and widths of this tensor-parallel rank
  const int64_t N = B * T, D = m.d_model;
  const std::string p = block_prefix(cfg_.model, l);
  s->B = B, s->T = T;
  s->x = x;
  // A backward reads this pass's state after a recomputation, or after a training forward of a
  // block that is not recomputed (otherwise the state is dropped at the end of the forward).
  saving_ = recompute_ || (record && !recomputed(l));
  s->h1 = Tensor(be_, DType::f32, {N, D});
  s->rstd1 = Tensor(be_, DType::f32, {N});
  be_.rmsnorm_forward(x, P(p + "attn_norm.weight"), N, D, float(m.norm_eps), s->h1.f32(), s->rstd1.f32());
  Tensor o(be_, DType::f32, {N, D});
  if (m.mla())
    mla_forward(l, B, T, o.f32(), s, record);
  else
    gqa_forward(l, B, T, o.f32(), s, record);
  if (!s->h1_needed(m.mla() && m.q_lora_rank > 0)) s->h1.reset();  // its linear layers keep it in FP8
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

void Transformer::gqa_backward(int l, const BlockSaved& s, const float* dout, float* dh1) {
  // x_mid = x + Wo(Attention(RoPE(Wq h1), RoPE(Wk h1), Wv h1)): dh1 written, summed over tensor parallelism.
  const ModelConfig& m = local();
  const int64_t B = s.B, T = s.T, N = B * T, D = m.d_model, H = m.n_heads, KVH = m.n_kv_heads, hd = m.head_dim;
  const std::string p = block_prefix(cfg_.model, l) + "attn.";
  Tensor da(be_, DType::f32, {N, H * hd}), dq(be_, DType::f32, {N, H * hd}), dk(be_, DType::f32, {N, KVH * hd}),
      dv(be_, DType::f32, {N, KVH * hd});
  linear_backward(be_, s.lo, P(p + "wo"), dout, fp8_for(p + "wo", LinearClass::attention, true), da.f32(), G(p + "wo"));
  be_.attention_backward(s.q.f32(), s.k.f32(), s.v.f32(), s.attn.f32(), s.lse.f32(), da.f32(), B, T, H, KVH, hd, hd,
                         dq.f32(), dk.f32(), dv.f32());
  be_.rope(dq.f32(), B, T, H, hd, rope_cs_inv_.f32(), rope_sn_inv_.f32(), hd);
  be_.rope(dk.f32(), B, T, KVH, hd, rope_cs_inv_.f32(), rope_sn_inv_.f32(), hd);
  Tensor part(be_, DType::f32, {N, D});
  linear_backward(be_, s.lq, P(p + "wq"), dq.f32(), fp8_for(p + "wq", LinearClass::attention, true), dh1, G(p + "wq"));
  linear_backward(be_, s.lk, P(p + "wk"), dk.f32(), fp8_for(p + "wk", LinearClass::attention, true), part.f32(),
                  G(p + "wk"));
  be_.add(dh1, part.f32(), dh1, N * D);
  linear_backward(be_, s.lv, P(p + "wv"), dv.f32(), fp8_for(p + "wv", LinearClass::attention, true), part.f32(),
                  G(p + "wv"));
  be_.add(dh1, part.f32(), dh1, N * D);
  tp_sum(dh1, N * D);  // column-parallel q, k, v
}

void Transformer::mla_backward(int l, const BlockSaved& s, const float* dout, float* dh1) {
  // dh1 written, summed over tensor parallelism: the head-split up-projections' gradients are
  // summed at the latents (smaller than h1), before the replicated norms and down-projections.
  const ModelConfig& m = local();
  const int64_t B = s.B, T = s.T, N = B * T, D = m.d_model, H = m.n_heads, nope = m.qk_nope_head_dim;
  const int64_t rope = m.qk_rope_head_dim, qk = nope + rope, vd = m.v_head_dim, ql = m.q_lora_rank, kvl = m.kv_lora_rank;
  const std::string p = block_prefix(cfg_.model, l) + "attn.";
  auto fp8 = [&](const char* w) { return fp8_for(p + w, LinearClass::attention, true); };
  Tensor da(be_, DType::f32, {N, H * vd}), dq(be_, DType::f32, {N, H * qk}), dk(be_, DType::f32, {N, H * qk}),
      dv(be_, DType::f32, {N, H * vd});
  linear_backward(be_, s.lo, P(p + "wo"), dout, fp8("wo"), da.f32(), G(p + "wo"));
  be_.attention_backward(s.q.f32(), s.k.f32(), s.v.f32(), s.attn.f32(), s.lse.f32(), da.f32(), B, T, H, H, qk, vd,
                         dq.f32(), dk.f32(), dv.f32());
  be_.rope(dq.f32() + nope, B, T, H, rope, rope_cs_inv_.f32(), rope_sn_inv_.f32(), qk);
  // Keys and values back to the up-projection's output and the shared rotary key (summed over heads).
  Tensor dkv(be_, DType::f32, {N, H * (nope + vd)}), dkpe(be_, DType::f32, {N, rope});
  be_.mla_expand_kv_backward(dk.f32(), dv.f32(), N, H, nope, rope, vd, dkv.f32(), dkpe.f32());
  be_.rope(dkpe.f32(), B, T, 1, rope, rope_cs_inv_.f32(), rope_sn_inv_.f32(), rope);
  Tensor dckvn(be_, DType::f32, {N, kvl});
  linear_backward(be_, s.lkv_b, P(p + "wkv_b"), dkv.f32(), fp8("wkv_b"), dckvn.f32(), G(p + "wkv_b"));
  tp_sum(dckvn.f32(), N * kvl);  // partial sums over this rank's heads
  tp_sum(dkpe.f32(), N * rope);
  Tensor dckv(be_, DType::f32, {N, kvl}), dckv_pe(be_, DType::f32, {N, kvl + rope});
  be_.rmsnorm_backward(s.ckv.f32(), P(p + "kv_norm.weight"), s.rstd_kv.f32(), dckvn.f32(), N, kvl, dckv.f32(),
                       G(p + "kv_norm.weight"));
  be_.copy_2d(dckv_pe.f32(), kvl + rope, dckv.f32(), kvl, N, kvl);
  be_.copy_2d(dckv_pe.f32() + kvl, kvl + rope, dkpe.f32(), rope, N, rope);
  if (ql > 0) {
    Tensor dcqn(be_, DType::f32, {N, ql}), dcq(be_, DType::f32, {N, ql});
    linear_backward(be_, s.lq, P(p + "wq_b"), dq.f32(), fp8("wq_b"), dcqn.f32(), G(p + "wq_b"));
    tp_sum(dcqn.f32(), N * ql);
    be_.rmsnorm_backward(s.cq.f32(), P(p + "q_norm.weight"), s.rstd_q.f32(), dcqn.f32(), N, ql, dcq.f32(),
                         G(p + "q_norm.weight"));
    linear_backward(be_, s.lq_a, P(p + "wq_a"), dcq.f32(), fp8("wq_a"), dh1, G(p + "wq_a"));
  } else {
    linear_backward(be_, s.lq, P(p + "wq"), dq.f32(), fp8("wq"), dh1, G(p + "wq"));
    tp_sum(dh1, N * D);  // column-parallel wq
  }
  Tensor part(be_, DType::f32, {N, D});
  linear_backward(be_, s.lkv_a, P(p + "wkv_a"), dckv_pe.f32(), fp8("wkv_a"), part.f32(), G(p + "wkv_a"));
  be_.add(dh1, part.f32(), dh1, N * D);
}

void Transformer::block_backward(int l, const BlockSaved& s, const float* dout, float* dx, float aux_grad_scale) {
  const ModelConfig& m = local();
  const int64_t N = s.B * s.T, D = m.d_model;
  const std::string p = block_prefix(cfg_.model, l);
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

  // Attention branch: x_mid = x + Attention(h1), h1 = RMSNorm(x).
  Tensor dh1(be_, DType::f32, {N, D});
  if (m.mla())
    mla_backward(l, s, dx_mid.f32(), dh1.f32());
  else
    gqa_backward(l, s, dx_mid.f32(), dh1.f32());
  be_.rmsnorm_backward(s.x, P(p + "attn_norm.weight"), s.rstd1.f32(), dh1.f32(), N, D, dx, G(p + "attn_norm.weight"));
  be_.add(dx, dx_mid.f32(), dx, N * D);
}

std::vector<float> Transformer::next_token_logits(const int32_t* tokens, int64_t T) { return last_logits(tokens, T, 1, nullptr); }

std::vector<float> Transformer::sequence_logits(const int32_t* tokens, int64_t T, std::vector<std::vector<float>>* mtp) {
  return last_logits(tokens, T, T, mtp);
}

std::vector<float> Transformer::last_logits(const int32_t* tokens, int64_t T, int64_t rows,
                                            std::vector<std::vector<float>>* mtp) {
  FP8MOE_ASSERT(tp_size() == 1 && !dispatcher_, "generation runs on one rank holding the whole model");
  FP8MOE_ASSERT(rows >= 1 && rows <= T, rows, " rows of logits of ", T, " positions");
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
  Tensor h(be_, DType::f32, {rows, D}), rstd(be_, DType::f32, {rows}), logits(be_, DType::f32, {rows, V});
  be_.rmsnorm_forward(x.f32() + (T - rows) * D, P("final_norm.weight"), rows, D, float(m.norm_eps), h.f32(), rstd.f32());
  be_.sgemm(false, true, rows, V, D, 1.0f, h.f32(), D, P("head.weight"), D, 0.0f, logits.f32(), V);
  if (mtp) {
    // The multi-token prediction modules over every position, as in training (teacher-forced:
    // module k reads the tokens k + 1 ahead; the last k + 1 positions read token 0 and predict
    // nothing).
    FP8MOE_ASSERT(rows == T, "the modules' logits need every position");
    mtp->clear();
    std::vector<int32_t> ahead(size_t(m.mtp_depth * T));
    mtp_shift(tokens, 1, T, m.mtp_depth, 0, ahead.data());
    const float* hk = h.f32();
    std::vector<MtpSaved> saved(size_t(m.mtp_depth));
    for (int k = 0; k < m.mtp_depth; ++k) {
      const Tensor ids_k = tensor_from(be_, std::vector<int32_t>(ahead.begin() + k * T, ahead.begin() + (k + 1) * T), {T});
      Tensor emb(be_, DType::f32, {T, D}), lk(be_, DType::f32, {T, V});
      be_.embedding_forward(P("embed.weight"), ids_k.data<int32_t>(), T, D, 0, V, emb.f32());
      mtp_module_forward(k, emb.f32(), hk, 1, T, &saved[size_t(k)], /*record=*/false, nullptr);
      be_.sgemm(false, true, T, V, D, 1.0f, saved[size_t(k)].hf.f32(), D, P("head.weight"), D, 0.0f, lk.f32(), V);
      mtp->push_back(to_host<float>(lk));
      hk = saved[size_t(k)].hf.f32();
    }
  }
  return to_host<float>(logits);
}

void Transformer::update_router_biases(const std::vector<std::vector<int64_t>>& expert_load) {
  const ModelConfig& m = cfg_.model;
  FP8MOE_ASSERT(int64_t(expert_load.size()) == m.moe_layers(), "expert loads of ", expert_load.size(), " MoE layers");
  // This stage's MoE blocks, and on the last stage the multi-token prediction modules' blocks.
  const int end = placement_.last_stage() ? m.n_layers + m.mtp_depth : placement_.layer_end();
  for (int l = std::max(m.first_dense_layers, placement_.layer_begin()); l < end; ++l) {
    const std::vector<int64_t>& load = expert_load[size_t(l - m.first_dense_layers)];
    if (load.empty()) continue;
    const Tensor d = tensor_from(be_, load, {int64_t(load.size())});
    be_.bias_update(store_->param(slot(block_prefix(m, l) + "moe.router_bias")), d.data<int64_t>(),
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
  // Multi-token prediction: its input tokens (first stage, the caller's memory), their embeddings
  // (first stage; on the last stage of several a copy of the received ones), their gradient (last
  // stage), and the modules' state (last stage).
  const int32_t* mtp_tokens = nullptr;
  Tensor mtp_emb, mtp_demb;
  std::vector<Transformer::MtpSaved> mtp;
  int64_t mtp_n = 0;                 // depth x N x D while the modules run, else 0
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
const float* StageRun::mtp_output() const { return impl_->mtp_n > 0 ? impl_->mtp_emb.f32() : nullptr; }
const float* StageRun::mtp_input_grad() const { return impl_->mtp_n > 0 ? impl_->mtp_demb.f32() : nullptr; }
int64_t StageRun::mtp_size() const { return impl_->mtp_n; }

void mtp_shift(const int32_t* src, int64_t B, int64_t T, int depth, int32_t fill, int32_t* out) {
  for (int k = 0; k < depth; ++k)
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = 0; t < T; ++t)
        out[(k * B + b) * T + t] = t + k + 1 < T ? src[b * T + t + k + 1] : fill;
}

StepResult Transformer::forward_backward(const int32_t* tokens, const int32_t* targets, int64_t B, int64_t T,
                                         bool backward, float loss_scale, int64_t mean_over, double aux_weight) {
  FP8MOE_ASSERT(placement_.first_stage() && placement_.last_stage(), "forward_backward on one pipeline stage of several");
  const ModelConfig& m = cfg_.model;
  const int64_t N = B * T, moe_layers = m.moe_layers();
  for (int64_t i = 0; i < N; ++i)
    FP8MOE_ASSERT(tokens[i] >= 0 && tokens[i] < m.vocab_size, "token ", tokens[i], " outside the vocabulary of ",
                  m.vocab_size);
  Tensor ids = tensor_from(be_, std::vector<int32_t>(tokens, tokens + N), {N});
  Tensor tgt = tensor_from(be_, std::vector<int32_t>(targets, targets + N), {N});
  const int depth = backward ? m.mtp_depth : 0;  // the modules train; an evaluation leaves them out
  Tensor losses = Tensor::zeros(be_, DType::f64, {1 + moe_layers + depth});
  const int64_t counted = count_targets(targets, N, m.pad_id);
  // The modules' shifted tokens and targets, and their counted targets (mean_over: this batch's).
  MtpBatch mtp;
  Tensor mtp_ids, mtp_tgt;
  if (depth > 0) {
    std::vector<int32_t> in(size_t(depth * N)), out(in.size());
    mtp_shift(tokens, B, T, depth, 0, in.data());
    mtp_shift(targets, B, T, depth, m.pad_id, out.data());
    mtp_ids = tensor_from(be_, in, {depth * N}), mtp_tgt = tensor_from(be_, out, {depth * N});
    mtp.tokens = mtp_ids.data<int32_t>(), mtp.targets = mtp_tgt.data<int32_t>();
    for (int k = 0; k < depth; ++k) mtp.mean_over.push_back(count_targets(out.data() + k * N, N, m.pad_id));
  }
  if (backward) begin_step();
  StageRun run = stage_forward(ids.data<int32_t>(), tgt.data<int32_t>(), counted, B, T, nullptr, backward,
                               {losses.data<double>(), losses.data<double>() + 1, losses.data<double>() + 1 + moe_layers},
                               loss_scale, mean_over, aux_weight, depth > 0 ? &mtp : nullptr);
  if (backward) stage_backward(run, nullptr);
  // The losses as the training loop combines them (app/stage_runner.cpp).
  StepResult r = run.result();
  const std::vector<double> h = to_host<double>(losses);
  const int64_t denom = mean_over > 0 ? mean_over : counted;
  r.ce = denom > 0 ? h[0] / double(denom) : 0.0;
  for (int64_t l = 0; l < moe_layers; ++l) r.aux += h[size_t(1 + l)];
  r.aux *= aux_weight;
  r.loss = r.ce + r.aux;
  for (int k = 0; k < depth; ++k)
    r.mtp += mtp.mean_over[size_t(k)] > 0 ? h[size_t(1 + moe_layers + k)] / double(mtp.mean_over[size_t(k)]) / depth : 0.0;
  return r;
}

StageRun Transformer::stage_forward(const int32_t* tokens, const int32_t* targets, int64_t counted, int64_t B,
                                    int64_t T, const float* x_in, bool backward, const LossSlots& slots,
                                    float loss_scale, int64_t mean_over, double aux_weight, const MtpBatch* mtp) {
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
  const bool with_mtp = backward && m.mtp_depth > 0 && mtp;
  FP8MOE_ASSERT(!(backward && m.mtp_depth > 0) || mtp, "a training forward of a model with multi-token prediction "
                "needs its MtpBatch");
  if (with_mtp) st.mtp_n = int64_t(m.mtp_depth) * N * D;
  if (placement_.first_stage()) {
    embed_forward(tokens, N, st.xs[0].f32());
    st.tokens = tokens;
    if (with_mtp) {  // the modules' input embeddings, for the last stage
      st.mtp_tokens = mtp->tokens;
      st.mtp_emb = Tensor(be_, DType::f32, {st.mtp_n});
      for (int k = 0; k < m.mtp_depth; ++k) embed_forward(mtp->tokens + k * N, N, st.mtp_emb.f32() + k * N * D);
    }
  } else {
    be_.copy(st.xs[0].f32(), x_in, size_t(N * D) * sizeof(float));
  }
  st.saved.resize(size_t(L1 - L0));
  result.expert_load.resize(size_t(m.moe_layers()));
  result.routing.resize(size_t(m.moe_layers()));
  int64_t saved_bytes = 0;
  for (int l = L0; l < L1; ++l) {
    BlockSaved& sv = st.saved[size_t(l - L0)];
    const int moe = l - m.first_dense_layers;
    block_forward(l, st.xs[size_t(l - L0)].f32(), B, T, st.xs[size_t(l - L0 + 1)].f32(), &sv, /*record=*/backward,
                  moe >= 0 && slots.aux ? slots.aux + moe : nullptr);
    finish_block_forward(l, &sv, &result);
    // A recomputed block keeps only its input (the stage's) and its routing.
    saved_bytes += sv.kept ? sv.bytes(D) : N * D * int64_t(sizeof(float)) + sv.moe.routing.bytes();
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
    if (with_mtp) mtp_forward(run, *mtp, slots, loss_scale);
  }
  if (!backward) st.saved.clear(), st.xs.erase(st.xs.begin(), st.xs.end() - 1);
  return run;
}

void Transformer::finish_block_forward(int l, BlockSaved* s, StepResult* result) {
  const int moe = l - cfg_.model.first_dense_layers;  // the multi-token prediction modules' blocks count on
  s->kept = !recomputed(l);
  if (moe >= 0) {
    result->expert_load[size_t(moe)] = s->moe.routing.load_host;
    result->dropped += s->moe.routing.dropped();
    if (keep_routing_) result->routing[size_t(moe)] = to_host<int32_t>(s->moe.routing.expert);
  }
  if (!s->kept) s->keep_only_routing();
}

void Transformer::recompute_if_dropped(int l, const float* x, BlockSaved* s) {
  if (s->kept) return;
  // With the forward's scales, weights and routing, advancing no history.
  Tensor scratch(be_, DType::f32, {s->B * s->T, cfg_.model.d_model});
  recompute_ = true;
  block_forward(l, x, s->B, s->T, scratch.f32(), s, false, nullptr);
  recompute_ = false;
}

void Transformer::mtp_forward(StageRun& run, const MtpBatch& mtp, const LossSlots& slots, float loss_scale) {
  StageRun::Impl& st = *run.impl_;
  StepResult& result = st.result;
  const ModelConfig& m = cfg_.model;
  const int depth = m.mtp_depth;
  const int64_t N = st.N, D = m.d_model, V = local().vocab_size;
  FP8MOE_ASSERT(int64_t(mtp.mean_over.size()) == depth && mtp.targets, "MtpBatch of ", mtp.mean_over.size(),
                " modules for ", depth);
  if (!placement_.first_stage()) {  // the first stage's embeddings, kept until backward
    FP8MOE_ASSERT(mtp.embeddings, "the last stage needs the first stage's multi-token prediction embeddings");
    st.mtp_emb = Tensor(be_, DType::f32, {st.mtp_n});
    be_.copy(st.mtp_emb.f32(), mtp.embeddings, size_t(st.mtp_n) * sizeof(float));
  }
  st.mtp.resize(size_t(depth));
  // The hidden state module 0 reads is the one the head reads, after the final norm (module k > 0:
  // after module k - 1's norm), as the inference implementations that run DeepSeek-V3's MTP weights
  // read it (vLLM's DeepSeekMTP, transformers' MtpLayer), so that exported modules work there.
  const float* h = st.hf.f32();
  for (int k = 0; k < depth; ++k) {
    MtpSaved& ms = st.mtp[size_t(k)];
    const int l = m.n_layers + k, moe = m.n_layers - m.first_dense_layers + k;
    mtp_module_forward(k, st.mtp_emb.f32() + k * N * D, h, st.B, st.T, &ms, /*record=*/true,
                       slots.aux ? slots.aux + moe : nullptr);
    finish_block_forward(l, &ms.block, &result);
    // The shared head, and the module's cross-entropy on the targets k + 1 ahead, weighted by
    // mtp_loss_weight / depth over its counted targets.
    Tensor logits(be_, DType::f32, {N, V});
    be_.sgemm(false, true, N, V, D, 1.0f, ms.hf.f32(), D, P("head.weight"), D, 0.0f, logits.f32(), V);
    ms.dlogits = Tensor(be_, DType::f32, {N, V});
    const int64_t denom = mtp.mean_over[size_t(k)];
    const float scale = denom > 0 ? float(double(loss_scale) * m.mtp_loss_weight / depth / double(denom)) : 0.0f;
    Tensor scratch;
    double* sum = slots.mtp ? slots.mtp + k : (scratch = Tensor(be_, DType::f64, {1})).data<double>();
    cross_entropy(logits.f32(), mtp.targets + k * N, N, scale, ms.dlogits.f32(), sum);
    h = ms.hf.f32();
  }
}

void Transformer::mtp_module_forward(int k, const float* emb, const float* h, int64_t B, int64_t T, MtpSaved* ms,
                                     bool record, double* aux) {
  const ModelConfig& m = cfg_.model;
  const int64_t N = B * T, D = m.d_model;
  const float eps = float(m.norm_eps);
  const std::string p = "mtp." + std::to_string(k) + ".";
  // x = eh_proj [enorm(embedding of the token k + 1 ahead) | hnorm(h)] (DeepSeek-V3's order).
  Tensor en(be_, DType::f32, {N, D}), hn(be_, DType::f32, {N, D});
  ms->rstd_e = Tensor(be_, DType::f32, {N}), ms->rstd_h = Tensor(be_, DType::f32, {N});
  be_.rmsnorm_forward(emb, P(p + "enorm.weight"), N, D, eps, en.f32(), ms->rstd_e.f32());
  be_.rmsnorm_forward(h, P(p + "hnorm.weight"), N, D, eps, hn.f32(), ms->rstd_h.f32());
  ms->cat = Tensor(be_, DType::f32, {N, 2 * D});
  be_.copy_2d(ms->cat.f32(), 2 * D, en.f32(), D, N, D);
  be_.copy_2d(ms->cat.f32() + D, 2 * D, hn.f32(), D, N, D);
  ms->x = Tensor(be_, DType::f32, {N, D});
  be_.sgemm(false, true, N, D, 2 * D, 1.0f, ms->cat.f32(), 2 * D, P(p + "eh_proj"), 2 * D, 0.0f, ms->x.f32(), D);
  ms->out = Tensor(be_, DType::f32, {N, D});
  block_forward(m.n_layers + k, ms->x.f32(), B, T, ms->out.f32(), &ms->block, record, aux);
  // The module's own final norm: the head's input, and the next module's hidden state.
  ms->hf = Tensor(be_, DType::f32, {N, D}), ms->rstd_f = Tensor(be_, DType::f32, {N});
  be_.rmsnorm_forward(ms->out.f32(), P(p + "norm.weight"), N, D, eps, ms->hf.f32(), ms->rstd_f.f32());
}

void Transformer::mtp_backward(StageRun& run, float* dh_main) {
  StageRun::Impl& st = *run.impl_;
  const ModelConfig& m = cfg_.model;
  const int64_t N = st.N, D = m.d_model, V = local().vocab_size;
  st.mtp_demb = Tensor(be_, DType::f32, {st.mtp_n});
  Tensor dnext;  // the gradient of module k's normed output from module k + 1 (its hnorm's input)
  for (int k = m.mtp_depth - 1; k >= 0; --k) {
    MtpSaved& ms = st.mtp[size_t(k)];
    const int l = m.n_layers + k;
    const std::string p = "mtp." + std::to_string(k) + ".";
    Tensor dh(be_, DType::f32, {N, D}), dout(be_, DType::f32, {N, D});
    be_.sgemm(true, false, V, D, N, 1.0f, ms.dlogits.f32(), V, ms.hf.f32(), D, 1.0f, G("head.weight"), D);
    be_.sgemm(false, false, N, D, V, 1.0f, ms.dlogits.f32(), V, P("head.weight"), D, 0.0f, dh.f32(), D);
    tp_sum(dh.f32(), N * D);  // vocabulary-parallel head
    if (!dnext.empty()) be_.add(dh.f32(), dnext.f32(), dh.f32(), N * D);
    be_.rmsnorm_backward(ms.out.f32(), P(p + "norm.weight"), ms.rstd_f.f32(), dh.f32(), N, D, dout.f32(),
                         G(p + "norm.weight"));
    ms.dlogits.reset(), ms.hf.reset();  // module k + 1, which read it, is done
    recompute_if_dropped(l, ms.x.f32(), &ms.block);
    Tensor dxk(be_, DType::f32, {N, D}), dcat(be_, DType::f32, {N, 2 * D});
    block_backward(l, ms.block, dout.f32(), dxk.f32(), st.aux_grad_scale);
    ms.block = BlockSaved{};
    be_.sgemm(false, false, N, 2 * D, D, 1.0f, dxk.f32(), D, P(p + "eh_proj"), 2 * D, 0.0f, dcat.f32(), 2 * D);
    be_.sgemm(true, false, D, 2 * D, N, 1.0f, dxk.f32(), D, ms.cat.f32(), 2 * D, 1.0f, G(p + "eh_proj"), 2 * D);
    Tensor den(be_, DType::f32, {N, D}), dhn(be_, DType::f32, {N, D});
    be_.copy_2d(den.f32(), D, dcat.f32(), 2 * D, N, D);
    be_.copy_2d(dhn.f32(), D, dcat.f32() + D, 2 * D, N, D);
    be_.rmsnorm_backward(st.mtp_emb.f32() + k * N * D, P(p + "enorm.weight"), ms.rstd_e.f32(), den.f32(), N, D,
                         st.mtp_demb.f32() + k * N * D, G(p + "enorm.weight"));
    const float* h = k == 0 ? st.hf.f32() : st.mtp[size_t(k - 1)].hf.f32();
    dnext = Tensor(be_, DType::f32, {N, D});
    be_.rmsnorm_backward(h, P(p + "hnorm.weight"), ms.rstd_h.f32(), dhn.f32(), N, D, dnext.f32(), G(p + "hnorm.weight"));
  }
  be_.add(dh_main, dnext.f32(), dh_main, N * D);  // into the gradient of the main model's normed output
  st.mtp.clear();
  if (!placement_.first_stage()) st.mtp_emb.reset();
}

void Transformer::stage_backward(StageRun& run, const float* dy, const float* d_mtp) {
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
    if (st.mtp_n > 0) mtp_backward(run, dh.f32());  // the modules read the normed output too
    be_.rmsnorm_backward(st.xs.back().f32(), P("final_norm.weight"), st.rstd.f32(), dh.f32(), N, D, dx.f32(),
                         G("final_norm.weight"));
    st.dlogits.reset(), st.hf.reset();
  } else {
    be_.copy(dx.f32(), dy, size_t(N * D) * sizeof(float));
  }
  for (int l = L1 - 1; l >= L0; --l) {
    BlockSaved& sv = st.saved[size_t(l - L0)];
    recompute_if_dropped(l, st.xs[size_t(l - L0)].f32(), &sv);
    block_backward(l, sv, dx.f32(), dnext.f32(), st.aux_grad_scale);
    sv = BlockSaved{};
    std::swap(dx, dnext);
  }
  if (placement_.first_stage()) {
    embed_backward(dx.f32(), st.tokens, N);
    if (st.mtp_n > 0) {  // the modules' input embeddings
      const float* de = placement_.last_stage() ? st.mtp_demb.f32() : d_mtp;
      FP8MOE_ASSERT(de, "the first stage's backward needs the gradient of the multi-token prediction embeddings");
      for (int k = 0; k < m.mtp_depth; ++k) embed_backward(de + k * N * D, st.mtp_tokens + k * N, N);
    }
  }
  st.dx = std::move(dx);
  st.saved.clear();
  st.xs.erase(st.xs.begin(), st.xs.end() - 1);
}

}  // namespace fp8moe
