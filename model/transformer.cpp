#include "model/transformer.h"

#include <algorithm>
#include <cmath>

#include "kernels/check.h"
#include "kernels/dispatch.h"
#include "kernels/ops.h"

namespace fp8moe {

struct Transformer::BlockSaved {
  BlockSaved() = default;
  BlockSaved(const BlockSaved&) = delete;  // the linears point into h1, attn, h2
  BlockSaved& operator=(const BlockSaved&) = delete;
  BlockSaved(BlockSaved&&) = default;
  BlockSaved& operator=(BlockSaved&&) = default;
  const float* x = nullptr;        // (N, D) block input, held by forward_backward
  std::vector<float> h1, rstd1;    // attention norm output (N, D), (N)
  std::vector<float> q, k, v;      // after RoPE: (N, H*hd), (N, KVH*hd)
  std::vector<float> attn, lse;    // (N, H*hd), (B, H, T)
  LinearSaved lq, lk, lv, lo;
  std::vector<float> x_mid;        // (N, D) after the attention residual
  std::vector<float> h2, rstd2;    // FFN norm output, (N)
  FfnSaved dense;
  MoeSaved moe;
  int64_t B = 0, T = 0;
  bool kept = false;               // false: recomputed in backward

  // Activation bytes held for backward, the block input included.
  int64_t bytes(int64_t D) const {
    const size_t floats = h1.size() + rstd1.size() + q.size() + k.size() + v.size() + attn.size() + lse.size() +
                          x_mid.size() + h2.size() + rstd2.size();
    return int64_t(floats * sizeof(float)) + B * T * D * int64_t(sizeof(float)) + lq.fp8_activation_bytes() +
           lk.fp8_activation_bytes() + lv.fp8_activation_bytes() + lo.fp8_activation_bytes() + dense.bytes() + moe.bytes();
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
}  // namespace

Transformer::Transformer(const Config& cfg, ModelGroups groups)
    : cfg_(cfg), table_(build_param_table(cfg.model)), groups_(groups), placement_(cfg.model, position_in(groups)) {
  if (groups.expert && groups.expert->size() > 1)
    dispatcher_ = std::make_unique<ExpertDispatcher>(*groups.expert, cfg.model.moe.n_experts);
  for (const ParamSpec& p : table_.params) {
    shards_.push_back(placement_.shard(p));
    const Shard& sh = shards_.back();
    params_.emplace_back(size_t(sh.numel()));
    grads_.emplace_back(size_t(sh.numel()), 0.0f);
    if (sh.held()) init_shard(p, uint64_t(cfg.train.seed), sh, params_.back().data());
  }
}

size_t Transformer::slot(const std::string& name) const {
  const int64_t i = table_.index_of(name);
  FP8MOE_ASSERT(i >= 0, "no parameter named ", name);
  return size_t(i);
}

void Transformer::tp_sum(float* x, int64_t n) {
  if (tp_size() > 1) groups_.tensor->allreduce_sum(x, n);
}

void Transformer::embed_forward(const int32_t* tokens, int64_t N, float* out) {
  const int64_t D = local().d_model, Vl = local().vocab_size, v0 = placement_.vocab_first();
  if (tp_size() == 1) return dev::embedding_forward(P("embed.weight"), tokens, N, D, out);
  const float* table = P("embed.weight");
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const int64_t t = tokens[n] - v0;
    if (t >= 0 && t < Vl) std::copy_n(table + t * D, D, out + n * D);
    else std::fill_n(out + n * D, D, 0.0f);
  }
  tp_sum(out, N * D);  // each token's row comes from the one rank holding it
}

void Transformer::embed_backward(const float* dx, const int32_t* tokens, int64_t N) {
  const int64_t D = local().d_model, Vl = local().vocab_size, v0 = placement_.vocab_first();
  if (tp_size() == 1) return dev::embedding_backward(dx, tokens, N, D, G("embed.weight"));
  float* g = G("embed.weight");
  for (int64_t n = 0; n < N; ++n) {  // serial: repeated tokens add in token order
    const int64_t t = tokens[n] - v0;
    if (t >= 0 && t < Vl)
      for (int64_t d = 0; d < D; ++d) g[t * D + d] += dx[n * D + d];
  }
}

double Transformer::cross_entropy(const float* logits, const int32_t* targets, int64_t N, float grad_scale,
                                  float* dlogits, int64_t* count) {
  const int64_t Vl = local().vocab_size, v0 = placement_.vocab_first();
  const int32_t pad = cfg_.model.pad_id;
  if (tp_size() == 1) return dev::cross_entropy(logits, targets, N, Vl, pad, grad_scale, dlogits, count);
  // Row max, sum of exponentials and the target's logit over the whole vocabulary: three
  // all-reduces of N values over the tensor group.
  std::vector<float> mx(static_cast<size_t>(N));
  std::vector<double> se(static_cast<size_t>(N), 0.0), tl(static_cast<size_t>(N), 0.0);
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) mx[n] = *std::max_element(logits + n * Vl, logits + (n + 1) * Vl);
  groups_.tensor->allreduce_max(mx.data(), N);
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const float* row = logits + n * Vl;
    for (int64_t v = 0; v < Vl; ++v) se[n] += std::exp(double(row[v]) - mx[n]);
    const int64_t t = int64_t(targets[n]) - v0;
    if (targets[n] != pad && t >= 0 && t < Vl) tl[n] = row[t];
  }
  groups_.tensor->allreduce_sum(se.data(), N);
  groups_.tensor->allreduce_sum(tl.data(), N);
  double total = 0;
  int64_t counted = 0;
  for (int64_t n = 0; n < N; ++n) {
    const int32_t t = targets[n];
    if (t == pad) {
      if (dlogits) std::fill_n(dlogits + n * Vl, Vl, 0.0f);
      continue;
    }
    FP8MOE_ASSERT(t >= 0 && t < cfg_.model.vocab_size, "target ", t, " outside the vocabulary of ", cfg_.model.vocab_size);
    const double lse = mx[n] + std::log(se[n]);
    total += lse - tl[n];
    ++counted;
    if (dlogits)
      for (int64_t v = 0; v < Vl; ++v)
        dlogits[n * Vl + v] = float(grad_scale * (std::exp(double(logits[n * Vl + v]) - lse) - (v + v0 == t ? 1.0 : 0.0)));
  }
  *count = counted;
  return total;
}

void Transformer::zero_grads() {
  for (auto& g : grads_) std::fill(g.begin(), g.end(), 0.0f);
}

LinearFp8 Transformer::fp8_for(const std::string& weight, LinearClass cls, bool record) {
  const Fp8Layers& on = cfg_.fp8.layers;
  const bool enabled = (cls == LinearClass::attention && on.attention) || (cls == LinearClass::mlp && on.mlp) ||
                       (cls == LinearClass::experts && on.experts) || (cls == LinearClass::shared_experts && on.shared_experts);
  LinearFp8 f;
  if (enabled && cfg_.fp8.recipe != Fp8Recipe::off) {
    f.cfg = &cfg_.fp8;
    f.state = &scaling_[weight];
    f.saturated = &saturated_;
    f.underflowed = &underflowed_;
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

void Transformer::block_forward(int l, const float* x, int64_t B, int64_t T, float* out, BlockSaved* s, bool record) {
  const ModelConfig& m = local();  // heads and widths of this tensor-parallel rank
  const int64_t N = B * T, D = m.d_model, H = m.n_heads, KVH = m.n_kv_heads, hd = m.head_dim;
  const std::string p = "layers." + std::to_string(l) + ".";
  s->B = B, s->T = T;
  s->x = x;
  s->h1.resize(size_t(N * D));
  s->rstd1.resize(static_cast<size_t>(N));
  dev::rmsnorm_forward(x, P(p + "attn_norm.weight"), N, D, float(m.norm_eps), s->h1.data(), s->rstd1.data());
  s->q.resize(size_t(N * H * hd));
  s->k.resize(size_t(N * KVH * hd));
  s->v.resize(size_t(N * KVH * hd));
  linear_forward(s->h1.data(), N, D, P(p + "attn.wq"), H * hd, fp8_for(p + "attn.wq", LinearClass::attention, record), s->q.data(), &s->lq);
  linear_forward(s->h1.data(), N, D, P(p + "attn.wk"), KVH * hd, fp8_for(p + "attn.wk", LinearClass::attention, record), s->k.data(), &s->lk);
  linear_forward(s->h1.data(), N, D, P(p + "attn.wv"), KVH * hd, fp8_for(p + "attn.wv", LinearClass::attention, record), s->v.data(), &s->lv);
  if (!s->lq.needs_fp32_input() && !s->lk.needs_fp32_input() && !s->lv.needs_fp32_input())
    s->h1 = std::vector<float>();  // q, k, v keep their input in FP8
  dev::rope(s->q.data(), B, T, H, hd, m.rope_theta, false);
  dev::rope(s->k.data(), B, T, KVH, hd, m.rope_theta, false);
  s->attn.resize(size_t(N * H * hd));
  s->lse.resize(size_t(B * H * T));
  dev::attention_forward(s->q.data(), s->k.data(), s->v.data(), B, T, H, KVH, hd, s->attn.data(), s->lse.data());
  std::vector<float> o(size_t(N * D));
  linear_forward(s->attn.data(), N, H * hd, P(p + "attn.wo"), D, fp8_for(p + "attn.wo", LinearClass::attention, record), o.data(), &s->lo);
  tp_sum(o.data(), N * D);  // row-parallel: partial sums over the heads of each rank
  s->x_mid.resize(size_t(N * D));
  for (int64_t i = 0; i < N * D; ++i) s->x_mid[i] = x[i] + o[i];

  s->h2.resize(size_t(N * D));
  s->rstd2.resize(static_cast<size_t>(N));
  dev::rmsnorm_forward(s->x_mid.data(), P(p + "ffn_norm.weight"), N, D, float(m.norm_eps), s->h2.data(), s->rstd2.data());
  std::vector<float> f(size_t(N * D));
  if (l < m.first_dense_layers) {
    ffn_forward(s->h2.data(), N, D, m.d_ff_dense, ffn_weights(p + "mlp."), ffn_fp8(p + "mlp.", LinearClass::mlp, record),
                f.data(), &s->dense);
    if (!s->dense.l1.needs_fp32_input() && !s->dense.l3.needs_fp32_input()) s->h2 = std::vector<float>();
  } else {
    MoeFp8 fp8{ffn_fp8(p + "moe.shared.", LinearClass::shared_experts, record), {}};
    for (int e = placement_.first_expert(); e < placement_.first_expert() + placement_.local_experts(); ++e)
      fp8.experts.push_back(ffn_fp8(p + "moe.experts." + std::to_string(e) + ".", LinearClass::experts, record));
    moe_forward(s->h2.data(), N, D, m.moe, moe_weights(l), fp8, f.data(), &s->moe, dispatcher_.get());
  }
  tp_sum(f.data(), N * D);  // row-parallel W2 (dense, shared and routed experts alike)
  for (int64_t i = 0; i < N * D; ++i) out[i] = s->x_mid[i] + f[i];
}

void Transformer::block_backward(int l, const BlockSaved& s, const float* dout, float* dx, float aux_grad_scale) {
  const ModelConfig& m = local();
  const int64_t B = s.B, T = s.T, N = B * T, D = m.d_model, H = m.n_heads, KVH = m.n_kv_heads, hd = m.head_dim;
  const std::string p = "layers." + std::to_string(l) + ".";
  // FFN branch: x_out = x_mid + FFN(RMSNorm(x_mid)).
  std::vector<float> dh2(size_t(N * D)), dx_mid(size_t(N * D));
  if (l < m.first_dense_layers) {
    ffn_backward(s.dense, ffn_weights(p + "mlp."), dout, ffn_fp8(p + "mlp.", LinearClass::mlp, true), dh2.data(),
                 ffn_grads(p + "mlp."));
    tp_sum(dh2.data(), N * D);  // column-parallel W1, W3: partial input gradients
  } else {
    MoeFp8 fp8{ffn_fp8(p + "moe.shared.", LinearClass::shared_experts, true), {}};
    MoeGrads g{G(p + "moe.router"), m.moe.n_shared_experts > 0 ? ffn_grads(p + "moe.shared.") : FfnGrads{}, {}};
    for (int e = placement_.first_expert(); e < placement_.first_expert() + placement_.local_experts(); ++e) {
      const std::string q = p + "moe.experts." + std::to_string(e) + ".";
      fp8.experts.push_back(ffn_fp8(q, LinearClass::experts, true));
      g.experts.push_back(ffn_grads(q));
    }
    moe_backward(s.moe, D, m.moe, moe_weights(l), dout, aux_grad_scale, fp8, dh2.data(), g, dispatcher_.get(),
                 tp_size() > 1 ? groups_.tensor : nullptr);
  }
  dev::rmsnorm_backward(s.x_mid.data(), P(p + "ffn_norm.weight"), s.rstd2.data(), dh2.data(), N, D, dx_mid.data(),
                        G(p + "ffn_norm.weight"));
  for (int64_t i = 0; i < N * D; ++i) dx_mid[i] += dout[i];

  // Attention branch: x_mid = x + Wo(Attention(RoPE(Wq h1), RoPE(Wk h1), Wv h1)), h1 = RMSNorm(x).
  std::vector<float> da(size_t(N * H * hd)), dq(size_t(N * H * hd)), dk(size_t(N * KVH * hd)), dv(size_t(N * KVH * hd));
  linear_backward(s.lo, P(p + "attn.wo"), dx_mid.data(), fp8_for(p + "attn.wo", LinearClass::attention, true), da.data(),
                  G(p + "attn.wo"));
  dev::attention_backward(s.q.data(), s.k.data(), s.v.data(), s.attn.data(), s.lse.data(), da.data(), B, T, H, KVH, hd,
                          dq.data(), dk.data(), dv.data());
  dev::rope(dq.data(), B, T, H, hd, m.rope_theta, true);
  dev::rope(dk.data(), B, T, KVH, hd, m.rope_theta, true);
  std::vector<float> dh1(size_t(N * D)), part(size_t(N * D));
  linear_backward(s.lq, P(p + "attn.wq"), dq.data(), fp8_for(p + "attn.wq", LinearClass::attention, true), dh1.data(), G(p + "attn.wq"));
  linear_backward(s.lk, P(p + "attn.wk"), dk.data(), fp8_for(p + "attn.wk", LinearClass::attention, true), part.data(), G(p + "attn.wk"));
  for (int64_t i = 0; i < N * D; ++i) dh1[i] += part[i];
  linear_backward(s.lv, P(p + "attn.wv"), dv.data(), fp8_for(p + "attn.wv", LinearClass::attention, true), part.data(), G(p + "attn.wv"));
  for (int64_t i = 0; i < N * D; ++i) dh1[i] += part[i];
  tp_sum(dh1.data(), N * D);  // column-parallel q, k, v
  dev::rmsnorm_backward(s.x, P(p + "attn_norm.weight"), s.rstd1.data(), dh1.data(), N, D, dx, G(p + "attn_norm.weight"));
  for (int64_t i = 0; i < N * D; ++i) dx[i] += dx_mid[i];
}

std::vector<float> Transformer::next_token_logits(const int32_t* tokens, int64_t T) {
  FP8MOE_ASSERT(tp_size() == 1 && !dispatcher_, "generation runs on one rank holding the whole model");
  const ModelConfig& m = cfg_.model;
  const int64_t D = m.d_model, V = m.vocab_size;
  for (int64_t i = 0; i < T; ++i)
    FP8MOE_ASSERT(tokens[i] >= 0 && tokens[i] < V, "token ", tokens[i], " outside the vocabulary of ", V);
  std::vector<float> x(size_t(T * D)), y(size_t(T * D));
  dev::embedding_forward(P("embed.weight"), tokens, T, D, x.data());
  for (int l = 0; l < m.n_layers; ++l) {
    BlockSaved s;
    block_forward(l, x.data(), 1, T, y.data(), &s, /*record=*/false);
    std::swap(x, y);
  }
  std::vector<float> h(static_cast<size_t>(D)), rstd(1), logits(static_cast<size_t>(V));
  dev::rmsnorm_forward(x.data() + (T - 1) * D, P("final_norm.weight"), 1, D, float(m.norm_eps), h.data(), rstd.data());
  dev::sgemm(false, true, 1, V, D, 1.0f, h.data(), D, P("head.weight"), D, 0.0f, logits.data(), V);
  return logits;
}

void Transformer::update_router_biases(const std::vector<std::vector<int64_t>>& expert_load) {
  const ModelConfig& m = cfg_.model;
  FP8MOE_ASSERT(int64_t(expert_load.size()) == m.n_layers - m.first_dense_layers, "expert loads of ",
                expert_load.size(), " MoE layers");
  for (int l = std::max(m.first_dense_layers, placement_.layer_begin()); l < placement_.layer_end(); ++l)
    update_router_bias(param("layers." + std::to_string(l) + ".moe.router_bias").data(), expert_load[size_t(l - m.first_dense_layers)], m.moe.bias_update_rate);
}

struct StageRun::Impl {
  int64_t B = 0, T = 0, N = 0;
  std::vector<int32_t> tokens;              // first stage: for the embedding's backward
  std::vector<std::vector<float>> xs;       // block inputs of this stage, then its output
  std::vector<Transformer::BlockSaved> saved;
  std::vector<float> hf, rstd, dlogits;     // last stage
  std::vector<float> dx;                    // after backward: the gradient of this stage's input
  StepResult result;
  bool backward = false;
  float aux_grad_scale = 1.0f;
};

StageRun::StageRun() = default;
StageRun::~StageRun() = default;
StageRun::StageRun(StageRun&&) noexcept = default;
StageRun& StageRun::operator=(StageRun&&) noexcept = default;
const StepResult& StageRun::result() const { return impl_->result; }
const float* StageRun::output() const { return impl_->xs.back().data(); }
const float* StageRun::input_grad() const { return impl_->dx.data(); }
int64_t StageRun::activation_size() const { return impl_->xs.back().size(); }

StepResult Transformer::forward_backward(const int32_t* tokens, const int32_t* targets, int64_t B, int64_t T, bool backward,
                                         float loss_scale, int64_t mean_over, double aux_weight) {
  FP8MOE_ASSERT(placement_.first_stage() && placement_.last_stage(), "forward_backward on one pipeline stage of several");
  StageRun run = stage_forward(tokens, targets, B, T, nullptr, backward, loss_scale, mean_over, aux_weight);
  if (backward) stage_backward(run, nullptr);
  return run.result();
}

StageRun Transformer::stage_forward(const int32_t* tokens, const int32_t* targets, int64_t B, int64_t T,
                                    const float* x_in, bool backward, float loss_scale, int64_t mean_over,
                                    double aux_weight) {
  const ModelConfig& m = cfg_.model;
  const int64_t N = B * T, D = m.d_model, V = local().vocab_size;  // V: this rank's vocabulary
  const int L0 = placement_.layer_begin(), L1 = placement_.layer_end();
  StageRun run;
  run.impl_ = std::make_unique<StageRun::Impl>();
  StageRun::Impl& st = *run.impl_;
  st.B = B, st.T = T, st.N = N, st.backward = backward;
  st.aux_grad_scale = float(loss_scale * aux_weight);
  StepResult& result = st.result;
  saturated_ = 0, underflowed_ = 0;

  st.xs.assign(size_t(L1 - L0 + 1), std::vector<float>(size_t(N * D)));
  if (placement_.first_stage()) {
    for (int64_t i = 0; i < N; ++i)
      FP8MOE_ASSERT(tokens[i] >= 0 && tokens[i] < m.vocab_size, "token ", tokens[i], " outside the vocabulary of ",
                    m.vocab_size);
    embed_forward(tokens, N, st.xs[0].data());
    st.tokens.assign(tokens, tokens + N);
  } else {
    std::copy_n(x_in, N * D, st.xs[0].data());
  }
  st.saved.resize(size_t(L1 - L0));
  result.expert_load.resize(size_t(m.n_layers - m.first_dense_layers));
  result.routing.resize(size_t(m.n_layers - m.first_dense_layers));
  int64_t saved_bytes = 0;
  for (int l = L0; l < L1; ++l) {
    BlockSaved& sv = st.saved[size_t(l - L0)];
    block_forward(l, st.xs[size_t(l - L0)].data(), B, T, st.xs[size_t(l - L0 + 1)].data(), &sv, /*record=*/backward);
    sv.kept = !recomputed(l);
    if (l >= m.first_dense_layers) {
      result.aux += sv.moe.aux_loss;
      result.expert_load[size_t(l - m.first_dense_layers)] = sv.moe.routing.load;
      result.routing[size_t(l - m.first_dense_layers)] = sv.moe.routing.expert;
      result.dropped += sv.moe.routing.dropped;
    }
    if (!sv.kept) {  // keep only the block input; the rest is recomputed in backward
      const int64_t keepB = sv.B, keepT = sv.T;
      sv = BlockSaved{};
      sv.B = keepB, sv.T = keepT;
      saved_bytes += N * D * int64_t(sizeof(float));
    } else {
      saved_bytes += sv.bytes(D);
    }
  }
  saved_bytes_per_token_ = N > 0 && L1 > L0 ? double(saved_bytes) / double(N) / double(L1 - L0) : 0.0;
  result.aux *= aux_weight;
  if (placement_.last_stage()) {
    st.hf.resize(size_t(N * D));
    st.rstd.resize(static_cast<size_t>(N));
    std::vector<float> logits(size_t(N * V));
    dev::rmsnorm_forward(st.xs.back().data(), P("final_norm.weight"), N, D, float(m.norm_eps), st.hf.data(), st.rstd.data());
    dev::sgemm(false, true, N, V, D, 1.0f, st.hf.data(), D, P("head.weight"), D, 0.0f, logits.data(), V);  // FP32 head
    int64_t count = std::count_if(targets, targets + N, [&](int32_t t) { return t != m.pad_id; });
    st.dlogits.resize(backward ? size_t(N * V) : 0);
    const int64_t denom = mean_over > 0 ? mean_over : count;
    const float scale = denom > 0 ? loss_scale / float(denom) : 0.0f;  // d (scaled mean) / d logits
    const double ce_sum = cross_entropy(logits.data(), targets, N, scale, backward ? st.dlogits.data() : nullptr, &count);
    result.tokens = count;
    result.ce = denom > 0 ? ce_sum / double(denom) : 0.0;
  }
  result.loss = result.ce + result.aux;
  result.fp8_saturated = saturated_, result.fp8_underflowed = underflowed_;
  if (!backward) st.saved.clear(), st.xs.erase(st.xs.begin(), st.xs.end() - 1);
  return run;
}

void Transformer::stage_backward(StageRun& run, const float* dy) {
  StageRun::Impl& st = *run.impl_;
  FP8MOE_ASSERT(st.backward, "stage_backward of a forward without backward");
  const ModelConfig& m = cfg_.model;
  const int64_t N = st.N, B = st.B, T = st.T, D = m.d_model, V = local().vocab_size;
  const int L0 = placement_.layer_begin(), L1 = placement_.layer_end();
  saturated_ = 0, underflowed_ = 0;
  std::vector<float> dx(size_t(N * D)), dnext(size_t(N * D));
  if (placement_.last_stage()) {
    std::vector<float> dh(size_t(N * D));
    dev::sgemm(true, false, V, D, N, 1.0f, st.dlogits.data(), V, st.hf.data(), D, 1.0f, G("head.weight"), D);
    dev::sgemm(false, false, N, D, V, 1.0f, st.dlogits.data(), V, P("head.weight"), D, 0.0f, dh.data(), D);
    tp_sum(dh.data(), N * D);  // vocabulary-parallel head
    dev::rmsnorm_backward(st.xs.back().data(), P("final_norm.weight"), st.rstd.data(), dh.data(), N, D, dx.data(),
                          G("final_norm.weight"));
    st.dlogits = std::vector<float>(), st.hf = std::vector<float>();
  } else {
    std::copy_n(dy, N * D, dx.data());
  }
  for (int l = L1 - 1; l >= L0; --l) {
    BlockSaved& sv = st.saved[size_t(l - L0)];
    if (!sv.kept) {  // recompute with the forward's scales, without advancing any history
      std::vector<float> scratch(size_t(N * D));
      recompute_ = true;
      block_forward(l, st.xs[size_t(l - L0)].data(), B, T, scratch.data(), &sv, false);
      recompute_ = false;
    }
    block_backward(l, sv, dx.data(), dnext.data(), st.aux_grad_scale);
    sv = BlockSaved{};
    std::swap(dx, dnext);
  }
  if (placement_.first_stage()) embed_backward(dx.data(), st.tokens.data(), N);
  st.dx = std::move(dx);
  st.saved.clear();
  st.xs.erase(st.xs.begin(), st.xs.end() - 1);
  st.result.fp8_saturated += saturated_, st.result.fp8_underflowed += underflowed_;
}

}  // namespace fp8moe
