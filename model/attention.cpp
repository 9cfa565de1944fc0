#include "model/attention.h"

#include "kernels/check.h"
#include "model/param_table.h"

namespace fp8moe {
namespace {

// ---------------------------------------------------------------- the core both kinds share

// Queries, keys and values after RoPE: q (N, H*qk), k (N, KVH*qk), v (N, KVH*vd); the attention
// output attn (N, H*vd) with its log-sum-exp lse (B, H, T), and the output projection's input.
// train.activations bf16: q, k, v and attn rounded to BF16 where they are made, and kept in BF16
// (ModelContext::stash) for the backward.
struct AttentionCore {
  Tensor q, k, v, attn, lse;
  LinearSaved lo;
  bool lo_rebuilt = false;  // wo's FP8 input copy not kept: made again from attn in backward
  int64_t bytes() const {
    return int64_t(q.bytes() + k.bytes() + v.bytes() + attn.bytes() + lse.bytes()) + lo.fp8_activation_bytes();
  }
};
struct CoreShape {
  int64_t B, T, H, KVH, qk, vd;
};

// o = Wo softmax(q k^T / sqrt(qk)) v, from s's q, k and v (rounded by the caller). saving: a
// backward reads s (stashed).
void core_forward(const ModelContext& c, AttentionCore* s, const CoreShape& d, const LinearWeight& wo,
                  const LinearFp8& f, float* o, bool saving) {
  Backend& be = c.be;
  const int64_t N = d.B * d.T;
  s->attn = Tensor(be, DType::f32, {N, d.H * d.vd});
  s->lse = Tensor(be, DType::f32, {d.B * d.H * d.T});
  if (c.bf16_activations()) {
    // q, k and v as kept, in BF16, are the kernel's operands (a fused kernel's: the probabilities
    // rounded to BF16 too, kernels/attention.h).
    c.stash(&s->q), c.stash(&s->k), c.stash(&s->v);
    be.attention_forward_bf16(s->q.data<uint16_t>(), s->k.data<uint16_t>(), s->v.data<uint16_t>(), d.B, d.T, d.H,
                              d.KVH, d.qk, d.vd, s->attn.f32(), s->lse.f32());
  } else {
    be.attention_forward(s->q.f32(), s->k.f32(), s->v.f32(), d.B, d.T, d.H, d.KVH, d.qk, d.vd, s->attn.f32(),
                         s->lse.f32());
  }
  c.round_activation(s->attn);
  linear_forward(be, s->attn.f32(), N, d.H * d.vd, wo.w, c.local.d_model, f, o, &s->lo);
  s->lo_rebuilt = false;
  if (!saving) return;
  if (!s->lo.needs_fp32_input()) c.stash(&s->attn);  // (an FP32 wo holds a pointer to it)
  // train.recompute selective: an FP8 wo does not keep its FP8 copy of the attention output beside
  // the output itself, which the core's backward keeps anyway: the copy is made again from it
  // there (linear_reinput: the same values, the same bits).
  if (c.selective && f.enabled()) {
    s->lo_rebuilt = true;
    s->lo.x = nullptr, s->lo.xq = QTensor{}, s->lo.xt = QTensor{};
  }
}

// Queries, keys and values made again in backward (train.recompute selective); an empty one: s's.
struct QkvTensors {
  Tensor q, k, v;
};

// Its backward from dout (N, D): da (Wo's input gradient) and dq, dk, dv, allocated here and
// owned by the caller (so that they live as long as the caller's other gradients).
void core_backward(const ModelContext& c, const AttentionCore& s, const CoreShape& d, const LinearWeight& wo,
                   const LinearFp8& f, const float* dout, Tensor* da, Tensor* dq, Tensor* dk, Tensor* dv,
                   LaterWork* weights, const QkvTensors* again = nullptr) {
  Backend& be = c.be;
  const int64_t N = d.B * d.T;
  *da = Tensor(be, DType::f32, {N, d.H * d.vd});
  *dq = Tensor(be, DType::f32, {N, d.H * d.qk});
  *dk = Tensor(be, DType::f32, {N, d.KVH * d.qk});
  *dv = Tensor(be, DType::f32, {N, d.KVH * d.vd});
  Tensor q, k, v, attn;  // copies: FP32 of what was kept in BF16 (BF16 of what was made again in FP32)
  const float* attn32 = c.unstash(s.attn, &attn);
  LinearSaved lo_again;  // wo's input copy made again (train.recompute selective)
  if (s.lo_rebuilt) linear_reinput(be, s.lo, attn32, f, &lo_again);
  linear_backward(be, s.lo_rebuilt ? lo_again : s.lo, wo.w, dout, f, da->f32(), wo.g, weights);
  lo_again = LinearSaved{};
  const QkvTensors none;
  const QkvTensors& a = again ? *again : none;
  if (c.bf16_activations()) {
    // The BF16 kernel on q, k and v as kept, or as made again (rounded: their BF16 copies exact).
    auto pick16 = [&](const Tensor& made, const Tensor& kept, Tensor* tmp) -> const uint16_t* {
      const Tensor& t = made.empty() ? kept : made;
      if (t.dtype() == DType::bf16) return t.data<uint16_t>();
      *tmp = Tensor(be, DType::bf16, t.shape());
      be.to_bf16(t.f32(), tmp->data<uint16_t>(), t.numel());
      return tmp->data<uint16_t>();
    };
    be.attention_backward_bf16(pick16(a.q, s.q, &q), pick16(a.k, s.k, &k), pick16(a.v, s.v, &v), attn32, s.lse.f32(),
                               da->f32(), d.B, d.T, d.H, d.KVH, d.qk, d.vd, dq->f32(), dk->f32(), dv->f32());
    return;
  }
  auto pick = [&](const Tensor& made, const Tensor& kept, Tensor* tmp) {
    return made.empty() ? c.unstash(kept, tmp) : made.f32();
  };
  be.attention_backward(pick(a.q, s.q, &q), pick(a.k, s.k, &k), pick(a.v, s.v, &v), attn32,
                        s.lse.f32(), da->f32(), d.B, d.T, d.H, d.KVH, d.qk, d.vd, dq->f32(), dk->f32(), dv->f32());
}

// ---------------------------------------------------------------- GQA

struct GqaSaved final : AttentionSaved {
  AttentionCore core;  // qk = vd = head_dim
  LinearSaved lq, lk, lv;
  int64_t bytes() const override {
    return core.bytes() + lq.fp8_activation_bytes() + lk.fp8_activation_bytes() + lv.fp8_activation_bytes();
  }
  bool needs_h1() const override { return lk.needs_fp32_input() || lv.needs_fp32_input() || lq.needs_fp32_input(); }
};

class Gqa final : public Attention {
 public:
  Gqa(const ModelContext& ctx, const std::string& p)
      : c_(ctx), wq_(ctx.fp8.linear(p + "wq")), wk_(ctx.fp8.linear(p + "wk")), wv_(ctx.fp8.linear(p + "wv")),
        wo_(ctx.fp8.linear(p + "wo")) {}

  std::unique_ptr<AttentionSaved> forward(const float* h1, int64_t B, int64_t T, float* o, const Pass& pass) override {
    const ModelConfig& m = c_.local;
    const int64_t N = B * T, D = m.d_model, H = m.n_heads, KVH = m.n_kv_heads, hd = m.head_dim;
    Backend& be = c_.be;
    auto s = std::make_unique<GqaSaved>();
    s->B = B, s->T = T;
    AttentionCore& a = s->core;
    a.q = Tensor(be, DType::f32, {N, H * hd});
    a.k = Tensor(be, DType::f32, {N, KVH * hd});
    a.v = Tensor(be, DType::f32, {N, KVH * hd});
    linear_forward(be, h1, N, D, wq_.w, H * hd, fp8(wq_, pass), a.q.f32(), &s->lq);
    linear_forward(be, h1, N, D, wk_.w, KVH * hd, fp8(wk_, pass), a.k.f32(), &s->lk);
    linear_forward(be, h1, N, D, wv_.w, KVH * hd, fp8(wv_, pass), a.v.f32(), &s->lv);
    be.rope(a.q.f32(), B, T, H, hd, c_.rope.cs.f32(), c_.rope.sn.f32(), hd);
    be.rope(a.k.f32(), B, T, KVH, hd, c_.rope.cs.f32(), c_.rope.sn.f32(), hd);
    c_.round_activation(a.q), c_.round_activation(a.k), c_.round_activation(a.v);
    core_forward(c_, &a, {B, T, H, KVH, hd, hd}, wo_, fp8(wo_, pass), o, pass.saving);
    return s;
  }

  // x_mid = x + Wo(Attention(RoPE(Wq h1), RoPE(Wk h1), Wv h1)).
  void backward(const AttentionSaved& saved, const float* dout, float* dh1, LaterWork* weights) override {
    const auto& s = static_cast<const GqaSaved&>(saved);
    const ModelConfig& m = c_.local;
    const int64_t B = s.B, T = s.T, N = B * T, D = m.d_model, H = m.n_heads, KVH = m.n_kv_heads, hd = m.head_dim;
    Backend& be = c_.be;
    const Pass pass = Pass::backward();
    Tensor da, dq, dk, dv;
    core_backward(c_, s.core, {B, T, H, KVH, hd, hd}, wo_, fp8(wo_, pass), dout, &da, &dq, &dk, &dv, weights);
    be.rope(dq.f32(), B, T, H, hd, c_.rope.cs_inv.f32(), c_.rope.sn_inv.f32(), hd);
    be.rope(dk.f32(), B, T, KVH, hd, c_.rope.cs_inv.f32(), c_.rope.sn_inv.f32(), hd);
    Tensor part(be, DType::f32, {N, D});
    linear_backward(be, s.lq, wq_.w, dq.f32(), fp8(wq_, pass), dh1, wq_.g, weights);
    linear_backward(be, s.lk, wk_.w, dk.f32(), fp8(wk_, pass), part.f32(), wk_.g, weights);
    be.add(dh1, part.f32(), dh1, N * D);
    linear_backward(be, s.lv, wv_.w, dv.f32(), fp8(wv_, pass), part.f32(), wv_.g, weights);
    be.add(dh1, part.f32(), dh1, N * D);
    c_.tp_sum(dh1, N * D);  // column-parallel q, k, v
  }

 private:
  LinearFp8 fp8(const LinearWeight& w, const Pass& pass) const { return c_.fp8.context(w, pass); }
  const ModelContext& c_;
  LinearWeight wq_, wk_, wv_, wo_;
};

// ---------------------------------------------------------------- MLA

struct MlaSaved final : AttentionSaved {
  // KVH = H, qk = qk_nope + qk_rope, vd = v_head_dim; every head's key holds the one shared
  // rotated key.
  AttentionCore core;
  // The query latent (N, q_lora) before and after its RMSNorm (the normalised one only while wq_b
  // needs its FP32 input), the key-value latent (N, kv_lora) likewise, the norms' 1 / rms.
  Tensor cq, rstd_q, cqn, ckv, rstd_kv, ckvn;
  LinearSaved lq, lq_a, lkv_a, lkv_b;  // lq: wq_b with the query latent, else wq
  bool q_latent = false;
  // train.recompute selective: the up-projections' outputs are not kept (core.k, core.v, and core.q
  // with the query latent); the backward makes them again from the latents and the rotated shared
  // key kpe (N, rope), kept instead.
  Tensor kpe;
  int64_t bytes() const override {
    int64_t b = core.bytes() + int64_t(cq.bytes() + rstd_q.bytes() + cqn.bytes() + ckv.bytes() + rstd_kv.bytes() +
                                       ckvn.bytes() + kpe.bytes());
    for (const LinearSaved* l : {&lq, &lq_a, &lkv_a, &lkv_b}) b += l->fp8_activation_bytes();
    return b;
  }
  // wq_b reads the query latent, not h1.
  bool needs_h1() const override {
    return lq_a.needs_fp32_input() || lkv_a.needs_fp32_input() || (!q_latent && lq.needs_fp32_input());
  }
};

class Mla final : public Attention {
 public:
  Mla(const ModelContext& ctx, const std::string& p) : c_(ctx) {
    const bool q_latent = ctx.local.q_lora_rank > 0;
    wq_ = ctx.fp8.linear(p + (q_latent ? "wq_b" : "wq"));
    if (q_latent) wq_a_ = ctx.fp8.linear(p + "wq_a"), q_norm_ = ctx.fp8.weight(p + "q_norm.weight");
    wkv_a_ = ctx.fp8.linear(p + "wkv_a"), kv_norm_ = ctx.fp8.weight(p + "kv_norm.weight");
    wkv_b_ = ctx.fp8.linear(p + "wkv_b"), wo_ = ctx.fp8.linear(p + "wo");
  }

  std::unique_ptr<AttentionSaved> forward(const float* h1, int64_t B, int64_t T, float* o, const Pass& pass) override {
    const ModelConfig& m = c_.local;  // n_heads: this rank's heads
    const int64_t N = B * T, D = m.d_model, H = m.n_heads, nope = m.qk_nope_head_dim, rope = m.qk_rope_head_dim;
    const int64_t qk = nope + rope, vd = m.v_head_dim, ql = m.q_lora_rank, kvl = m.kv_lora_rank;
    Backend& be = c_.be;
    auto s = std::make_unique<MlaSaved>();
    s->B = B, s->T = T, s->q_latent = ql > 0;
    AttentionCore& a = s->core;
    // Queries (N, H, qk): through the latent cq = RMSNorm(h1 Wq_a^T) when q_lora_rank > 0.
    if (ql > 0) {
      s->cq = Tensor(be, DType::f32, {N, ql});
      linear_forward(be, h1, N, D, wq_a_.w, ql, fp8(wq_a_, pass), s->cq.f32(), &s->lq_a);
      c_.round_activation(s->cq);
      s->rstd_q = Tensor(be, DType::f32, {N});
      norm_latent(s->cq, q_norm_, N, ql, &s->cqn, &s->rstd_q);
      queries(s->cqn.f32(), B, T, ql, pass, &s->lq, &a.q);
      if (!s->lq.needs_fp32_input()) s->cqn.reset();
      if (pass.saving) c_.stash(&s->cq);
    } else {
      queries(h1, B, T, D, pass, &s->lq, &a.q);
    }
    // The key-value latent and the shared rotary key: h1 Wkv_a^T = [ckv (kv_lora) | kpe (rope)];
    // kpe rotated (every head's key is [k_nope | kpe]).
    Tensor ckv_pe(be, DType::f32, {N, kvl + rope}), kpe(be, DType::f32, {N, rope});
    linear_forward(be, h1, N, D, wkv_a_.w, kvl + rope, fp8(wkv_a_, pass), ckv_pe.f32(), &s->lkv_a);
    c_.round_activation(ckv_pe);
    s->ckv = Tensor(be, DType::f32, {N, kvl});
    be.copy_2d(s->ckv.f32(), kvl, ckv_pe.f32(), kvl + rope, N, kvl);
    be.copy_2d(kpe.f32(), rope, ckv_pe.f32() + kvl, kvl + rope, N, rope);
    be.rope(kpe.f32(), B, T, 1, rope, c_.rope.cs.f32(), c_.rope.sn.f32(), rope);
    c_.round_activation(kpe);  // (k's copies of it are rounded anyway: the same k)
    // Keys and values from the normed key-value latent.
    s->rstd_kv = Tensor(be, DType::f32, {N});
    norm_latent(s->ckv, kv_norm_, N, kvl, &s->ckvn, &s->rstd_kv);
    keys_values(s->ckvn.f32(), kpe.f32(), N, pass, &s->lkv_b, &a.k, &a.v);
    if (!s->lkv_b.needs_fp32_input()) s->ckvn.reset();
    if (pass.saving) c_.stash(&s->ckv);
    core_forward(c_, &a, {B, T, H, H, qk, vd}, wo_, fp8(wo_, pass), o, pass.saving);
    if (pass.saving && c_.selective) {  // made again in backward (rebuild_qkv)
      a.k.reset(), a.v.reset();
      if (ql > 0) a.q.reset();
      s->kpe = std::move(kpe);
      c_.stash(&s->kpe);
    }
    return s;
  }

  // dh1 written, summed over tensor parallelism: the head-split up-projections' gradients are
  // summed at the latents (smaller than h1), before the replicated norms and down-projections.
  void backward(const AttentionSaved& saved, const float* dout, float* dh1, LaterWork* weights) override {
    const auto& s = static_cast<const MlaSaved&>(saved);
    const ModelConfig& m = c_.local;
    const int64_t B = s.B, T = s.T, N = B * T, D = m.d_model, H = m.n_heads, nope = m.qk_nope_head_dim;
    const int64_t rope = m.qk_rope_head_dim, qk = nope + rope, vd = m.v_head_dim, ql = m.q_lora_rank,
                  kvl = m.kv_lora_rank;
    Backend& be = c_.be;
    const Pass pass = Pass::backward();
    Tensor da, dq, dk, dv;
    {
      QkvTensors again;  // train.recompute selective
      if (!s.kpe.empty()) rebuild_qkv(s, &again);
      core_backward(c_, s.core, {B, T, H, H, qk, vd}, wo_, fp8(wo_, pass), dout, &da, &dq, &dk, &dv, weights, &again);
    }
    be.rope(dq.f32() + nope, B, T, H, rope, c_.rope.cs_inv.f32(), c_.rope.sn_inv.f32(), qk);
    // Keys and values back to the up-projection's output and the shared rotary key (summed over heads).
    Tensor dkv(be, DType::f32, {N, H * (nope + vd)}), dkpe(be, DType::f32, {N, rope});
    be.mla_expand_kv_backward(dk.f32(), dv.f32(), N, H, nope, rope, vd, dkv.f32(), dkpe.f32());
    be.rope(dkpe.f32(), B, T, 1, rope, c_.rope.cs_inv.f32(), c_.rope.sn_inv.f32(), rope);
    Tensor dckvn(be, DType::f32, {N, kvl});
    linear_backward(be, s.lkv_b, wkv_b_.w, dkv.f32(), fp8(wkv_b_, pass), dckvn.f32(), wkv_b_.g, weights);
    c_.tp_sum(dckvn.f32(), N * kvl);  // partial sums over this rank's heads
    c_.tp_sum(dkpe.f32(), N * rope);
    Tensor dckv(be, DType::f32, {N, kvl}), dckv_pe(be, DType::f32, {N, kvl + rope});
    c_.norm_backward(s.ckv, kv_norm_.w, s.rstd_kv.f32(), dckvn.f32(), N, kvl, dckv.f32(), kv_norm_.g);
    be.copy_2d(dckv_pe.f32(), kvl + rope, dckv.f32(), kvl, N, kvl);
    be.copy_2d(dckv_pe.f32() + kvl, kvl + rope, dkpe.f32(), rope, N, rope);
    if (ql > 0) {
      Tensor dcqn(be, DType::f32, {N, ql}), dcq(be, DType::f32, {N, ql});
      linear_backward(be, s.lq, wq_.w, dq.f32(), fp8(wq_, pass), dcqn.f32(), wq_.g, weights);
      c_.tp_sum(dcqn.f32(), N * ql);
      c_.norm_backward(s.cq, q_norm_.w, s.rstd_q.f32(), dcqn.f32(), N, ql, dcq.f32(), q_norm_.g);
      linear_backward(be, s.lq_a, wq_a_.w, dcq.f32(), fp8(wq_a_, pass), dh1, wq_a_.g, weights);
    } else {
      linear_backward(be, s.lq, wq_.w, dq.f32(), fp8(wq_, pass), dh1, wq_.g, weights);
      c_.tp_sum(dh1, N * D);  // column-parallel wq
    }
    Tensor part(be, DType::f32, {N, D});
    linear_backward(be, s.lkv_a, wkv_a_.w, dckv_pe.f32(), fp8(wkv_a_, pass), part.f32(), wkv_a_.g, weights);
    be.add(dh1, part.f32(), dh1, N * D);
  }

 private:
  // A latent's RMSNorm (N, width) into *out, rounded where activations are BF16; *rstd (N) given.
  void norm_latent(const Tensor& latent, const Weight& norm, int64_t N, int64_t width, Tensor* out, Tensor* rstd) const {
    *out = Tensor(c_.be, DType::f32, {N, width});
    c_.norm_forward(latent, norm.w, N, width, float(c_.local.norm_eps), out->f32(), rstd->f32());  // (BF16 as kept)
    c_.round_activation(*out);
  }
  // The per-head queries (N, H, qk) from x (N, K): the query latent's normed copy, or h1 without
  // one; RoPE on each head's last qk_rope_head_dim channels, then rounded.
  void queries(const float* x, int64_t B, int64_t T, int64_t K, const Pass& pass, LinearSaved* saved, Tensor* q) const {
    const ModelConfig& m = c_.local;
    const int64_t N = B * T, H = m.n_heads, nope = m.qk_nope_head_dim, rope = m.qk_rope_head_dim, qk = nope + rope;
    *q = Tensor(c_.be, DType::f32, {N, H * qk});
    linear_forward(c_.be, x, N, K, wq_.w, H * qk, fp8(wq_, pass), q->f32(), saved);
    c_.be.rope(q->f32() + nope, B, T, H, rope, c_.rope.cs.f32(), c_.rope.sn.f32(), qk);
    c_.round_activation(*q);
  }
  // Every head's key [k_nope | kpe] (N, H, qk) and value (N, H, vd) from the normed key-value
  // latent (through wkv_b) and the rotated shared key kpe (N, rope), rounded.
  void keys_values(const float* ckvn, const float* kpe, int64_t N, const Pass& pass, LinearSaved* saved, Tensor* k,
                   Tensor* v) const {
    const ModelConfig& m = c_.local;
    const int64_t H = m.n_heads, nope = m.qk_nope_head_dim, rope = m.qk_rope_head_dim, vd = m.v_head_dim;
    Tensor kv(c_.be, DType::f32, {N, H * (nope + vd)});  // per head [k_nope | v]
    linear_forward(c_.be, ckvn, N, m.kv_lora_rank, wkv_b_.w, H * (nope + vd), fp8(wkv_b_, pass), kv.f32(), saved);
    *k = Tensor(c_.be, DType::f32, {N, H * (nope + rope)});
    *v = Tensor(c_.be, DType::f32, {N, H * vd});
    c_.be.mla_expand_kv(kv.f32(), kpe, N, H, nope, rope, vd, k->f32(), v->f32());
    c_.round_activation(*k), c_.round_activation(*v);
  }

  // train.recompute selective: the queries (with the query latent), keys and values the forward
  // made and dropped, made again from the kept latents by the forward's own steps (norm_latent,
  // queries, keys_values) with its FP8 scales and weights: the same bits.
  void rebuild_qkv(const MlaSaved& s, QkvTensors* core) const {
    const ModelConfig& m = c_.local;
    const int64_t N = s.B * s.T;
    const Pass pass = Pass::rebuild();
    // A latent's normed copy: the one an FP32 up-projection keeps, else the forward's norm again.
    auto normed = [&](const Tensor& kept_normed, const Tensor& latent, const Weight& norm, int64_t width, Tensor* out) {
      if (!kept_normed.empty()) return kept_normed.f32();
      Tensor rstd(c_.be, DType::f32, {N});
      norm_latent(latent, norm, N, width, out, &rstd);
      return static_cast<const float*>(out->f32());
    };
    if (m.q_lora_rank > 0) {
      Tensor cqn;
      queries(normed(s.cqn, s.cq, q_norm_, m.q_lora_rank, &cqn), s.B, s.T, m.q_lora_rank, pass, nullptr, &core->q);
    }
    Tensor ckvn, kpe32;
    keys_values(normed(s.ckvn, s.ckv, kv_norm_, m.kv_lora_rank, &ckvn), c_.unstash(s.kpe, &kpe32), N, pass, nullptr,
                &core->k, &core->v);
  }

  LinearFp8 fp8(const LinearWeight& w, const Pass& pass) const { return c_.fp8.context(w, pass); }
  const ModelContext& c_;
  LinearWeight wq_, wq_a_, wkv_a_, wkv_b_, wo_;  // wq_: wq_b with the query latent, else wq
  Weight q_norm_, kv_norm_;
};

}  // namespace

std::unique_ptr<Attention> make_attention(const ModelContext& ctx, int layer) {
  const std::string p = block_prefix(ctx.model, layer) + "attn.";
  if (ctx.model.mla()) return std::make_unique<Mla>(ctx, p);
  return std::make_unique<Gqa>(ctx, p);
}

}  // namespace fp8moe
