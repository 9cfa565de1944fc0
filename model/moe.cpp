#include "model/moe.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "kernels/check.h"
#include "kernels/dispatch.h"
#include "kernels/elem.h"
#include "kernels/gemm_fp8.h"

namespace fp8moe {

Routing route(const float* z, const float* bias, int64_t N, int64_t E, const MoeConfig& cfg, std::vector<float>* prob) {
  const int64_t k = cfg.top_k;
  FP8MOE_ASSERT(k >= 1 && k <= E, "top_k ", k, " of ", E, " experts");
  Routing r;
  r.N = N, r.E = E, r.k = k;
  r.expert.assign(size_t(N * k), -1);
  r.gate.assign(size_t(N * k), 0.0f);
  r.kept.assign(size_t(N * k), 1);
  prob->resize(size_t(N * E));
  const int64_t G = cfg.n_group, per_group = E / G;
  FP8MOE_ASSERT(E % G == 0 && cfg.topk_group >= 1 && cfg.topk_group <= G && k <= cfg.topk_group * per_group,
                "node-limited routing: ", E, " experts in ", G, " groups, ", cfg.topk_group, " of them, top ", k);
  const bool normalise = cfg.normalises_gates();
  std::vector<float> key(static_cast<size_t>(E)), group_score(static_cast<size_t>(G));
  std::vector<int32_t> order(static_cast<size_t>(E)), group_order(static_cast<size_t>(G));
  for (int64_t n = 0; n < N; ++n) {
    const float* zr = z + n * E;
    float* p = prob->data() + n * E;
    if (cfg.gating == Gating::sigmoid) {
      for (int64_t e = 0; e < E; ++e) p[e] = 1.0f / (1.0f + std::exp(-zr[e]));
    } else {
      const float m = *std::max_element(zr, zr + E);
      double sum = 0;
      for (int64_t e = 0; e < E; ++e) sum += std::exp(double(zr[e]) - m);
      for (int64_t e = 0; e < E; ++e) p[e] = float(std::exp(double(zr[e]) - m) / sum);
    }
    // Selection keys: score + bias. Node-limited routing keeps the topk_group groups whose two
    // best keys sum highest and takes the others out of the choice.
    for (int64_t e = 0; e < E; ++e) key[e] = p[e] + bias[e];
    if (G > 1) {
      for (int64_t g = 0; g < G; ++g) {
        const float* kg = key.data() + g * per_group;
        float best = -INFINITY, second = -INFINITY;
        for (int64_t e = 0; e < per_group; ++e) {
          if (kg[e] > best) second = best, best = kg[e];
          else if (kg[e] > second) second = kg[e];
        }
        group_score[g] = best + second;
      }
      std::iota(group_order.begin(), group_order.end(), 0);
      std::stable_sort(group_order.begin(), group_order.end(),
                       [&](int32_t a, int32_t b) { return group_score[a] > group_score[b]; });
      for (int64_t j = cfg.topk_group; j < G; ++j)
        std::fill_n(key.data() + group_order[j] * per_group, per_group, -INFINITY);
    }
    // Top-k by key; ties go to the lower expert index (a stable, deterministic order).
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return key[a] > key[b]; });
    double chosen = 0;
    for (int64_t j = 0; j < k; ++j) chosen += p[order[j]];
    for (int64_t j = 0; j < k; ++j) {
      r.expert[n * k + j] = order[j];
      const double g = normalise ? p[order[j]] / chosen : double(p[order[j]]);
      r.gate[n * k + j] = float(g * cfg.routed_scaling_factor);
    }
  }
  // Capacity: assignments beyond it, in token order, are dropped.
  const int64_t cap = cfg.capacity_factor > 0 ? int64_t(std::ceil(cfg.capacity_factor * double(N * k) / double(E)))
                                              : N * k;
  r.load.assign(size_t(E), 0);
  for (int64_t i = 0; i < N * k; ++i) {
    const int32_t e = r.expert[i];
    if (r.load[e] >= cap) {
      r.kept[i] = 0, r.gate[i] = 0.0f, ++r.dropped;
      continue;
    }
    ++r.load[e];
  }
  // Permutation: rows grouped by expert, token order inside a group.
  r.offsets.assign(size_t(E + 1), 0);
  for (int64_t e = 0; e < E; ++e) r.offsets[e + 1] = r.offsets[e] + r.load[e];
  r.row_token.assign(size_t(r.offsets[E]), 0);
  r.row_slot.assign(size_t(r.offsets[E]), 0);
  std::vector<int64_t> fill(r.offsets.begin(), r.offsets.end() - 1);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t j = 0; j < k; ++j) {
      const int32_t e = r.expert[n * k + j];
      if (!r.kept[n * k + j]) continue;
      r.row_token[fill[e]] = n;
      r.row_slot[fill[e]] = int32_t(j);
      ++fill[e];
    }
  return r;
}

void permute(const Routing& r, const float* x, int64_t D, float* rows) {
  const int64_t R = r.offsets.back();
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < R; ++i) std::copy_n(x + r.row_token[i] * D, D, rows + i * D);
}

void unpermute_add(const Routing& r, const float* rows, int64_t D, float* out) {
  // Serial over rows: a token's k rows add into the same output row (deterministic order).
  const int64_t R = r.offsets.back();
  for (int64_t i = 0; i < R; ++i) {
    const int64_t n = r.row_token[i];
    const float g = r.gate[n * r.k + r.row_slot[i]];
    for (int64_t d = 0; d < D; ++d) out[n * D + d] += g * rows[i * D + d];
  }
}

namespace {
bool has_shared(const MoeWeights& w) { return w.shared.w1 != nullptr; }

// P_e normalisation for the aux loss: softmax probabilities as they are; sigmoid scores over their sum.
void normalised_scores(const std::vector<float>& prob, int64_t N, int64_t E, Gating g, std::vector<double>* out) {
  out->assign(size_t(N * E), 0.0);
  for (int64_t n = 0; n < N; ++n) {
    double sum = 0;
    for (int64_t e = 0; e < E; ++e) sum += prob[n * E + e];
    for (int64_t e = 0; e < E; ++e) (*out)[n * E + e] = g == Gating::softmax ? prob[n * E + e] : prob[n * E + e] / sum;
  }
}
}  // namespace

double moe_forward(const float* x, int64_t N, int64_t D, const MoeConfig& cfg, const MoeWeights& w, const MoeFp8& fp8,
                   float* out, MoeSaved* saved, ExpertDispatcher* ep) {
  MoeSaved local;
  MoeSaved& s = saved ? *saved : local;
  const int64_t E = cfg.n_experts, F = cfg.d_expert;
  s.x = x;
  s.z.resize(size_t(N * E));
  dev::sgemm(false, true, N, E, D, 1.0f, x, D, w.router, D, 0.0f, s.z.data(), E);  // FP32 router
  s.routing = route(s.z.data(), w.router_bias, N, E, cfg, &s.prob);
  const Routing& r = s.routing;

  // Shared experts see every token.
  if (has_shared(w))
    ffn_forward(x, N, D, int64_t(cfg.n_shared_experts) * F, w.shared, fp8.shared, out, &s.shared);
  else
    std::fill(out, out + N * D, 0.0f);

  // Routed experts: permute, (expert parallelism: send each row to its expert's rank,) one FFN per
  // expert on its rows (possibly none), (bring the outputs back,) unpermute with gates.
  const int64_t R = r.offsets[E];
  std::vector<float>& xr = s.xr;
  xr.resize(static_cast<size_t>(R * D));
  permute(r, x, D, xr.data());
  const float* xin = xr.data();
  if (ep) {
    s.plan = ep->plan(r.load.data());
    ep->dispatch(s.plan, xr.data(), D, &s.xl);
    xr = std::vector<float>();  // the experts read xl
    xin = s.xl.data();
    s.local_rows = s.plan.local_rows;
  } else {
    s.local_rows = r.load;
  }
  const int64_t L = int64_t(s.local_rows.size());
  FP8MOE_ASSERT(int64_t(w.experts.size()) == L && int64_t(fp8.experts.size()) == L, "MoE: ", w.experts.size(),
                " expert weights for ", L, " experts");
  const int64_t rows_in = std::accumulate(s.local_rows.begin(), s.local_rows.end(), int64_t(0));
  std::vector<float> y(static_cast<size_t>(rows_in * D), 0.0f);
  s.experts.resize(static_cast<size_t>(L));
  for (int64_t e = 0, r0 = 0; e < L; r0 += s.local_rows[e], ++e)
    ffn_forward(xin + r0 * D, s.local_rows[e], D, F, w.experts[e], fp8.experts[e], y.data() + r0 * D, &s.experts[e]);
  if (ep) {
    s.expert_out.resize(static_cast<size_t>(R * D));
    ep->combine(s.plan, y.data(), D, s.expert_out.data());
  } else {
    s.expert_out = std::move(y);
  }
  unpermute_add(r, s.expert_out.data(), D, out);
  const bool inputs_cached = std::none_of(s.experts.begin(), s.experts.end(), [](const FfnSaved& e) {
    return e.l1.needs_fp32_input() || e.l3.needs_fp32_input();
  });
  if (inputs_cached) s.xr = std::vector<float>(), s.xl = std::vector<float>();  // the experts keep their inputs in FP8

  s.aux_loss = 0;
  if (cfg.aux_loss_coef > 0 && N > 0) {
    std::vector<double> pn;
    normalised_scores(s.prob, N, E, cfg.gating, &pn);
    for (int64_t e = 0; e < E; ++e) {
      double pe = 0;
      for (int64_t n = 0; n < N; ++n) pe += pn[n * E + e];
      const double fe = double(r.load[e]) / double(N * r.k);
      s.aux_loss += cfg.aux_loss_coef * double(E) * fe * pe / double(N);
    }
  }
  return s.aux_loss;
}

void moe_backward(const MoeSaved& s, int64_t D, const MoeConfig& cfg, const MoeWeights& w, const float* dout,
                  float aux_grad_scale, const MoeFp8& fp8, float* dx, const MoeGrads& g, ExpertDispatcher* ep,
                  Communicator* tp) {
  const Routing& r = s.routing;
  const int64_t N = r.N, E = r.E, k = r.k;
  if (has_shared(w))
    ffn_backward(s.shared, w.shared, dout, fp8.shared, dx, g.shared);
  else
    std::fill(dx, dx + N * D, 0.0f);

  // Per permuted row: the gradient of the expert's output (gate x dout) and of the gate.
  const int64_t R = r.offsets[E];
  std::vector<double> dgate(size_t(N * k), 0.0);
  std::vector<float> dye(static_cast<size_t>(R * D));
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < R; ++i) {
    const int64_t n = r.row_token[i];
    const int64_t slot = n * k + r.row_slot[i];
    double dg = 0;
    for (int64_t d = 0; d < D; ++d) {
      dye[i * D + d] = r.gate[slot] * dout[n * D + d];
      dg += double(dout[n * D + d]) * s.expert_out[i * D + d];
    }
    dgate[slot] = dg;
  }
  // (Expert parallelism: to the experts' ranks and back.)
  std::vector<float> dyl, dxe;
  const float* dyin = dye.data();
  if (ep) {
    ep->dispatch(s.plan, dye.data(), D, &dyl);
    dyin = dyl.data();
  }
  const int64_t L = int64_t(s.local_rows.size());
  const int64_t rows_in = std::accumulate(s.local_rows.begin(), s.local_rows.end(), int64_t(0));
  std::vector<float> dxl(static_cast<size_t>(rows_in * D));
  for (int64_t e = 0, r0 = 0; e < L; r0 += s.local_rows[e], ++e)
    ffn_backward(s.experts[e], w.experts[e], dyin + r0 * D, fp8.experts[e], dxl.data() + r0 * D, g.experts[e]);
  if (ep) {
    dxe.resize(static_cast<size_t>(R * D));
    ep->combine(s.plan, dxl.data(), D, dxe.data());
  } else {
    dxe = std::move(dxl);
  }
  for (int64_t i = 0; i < R; ++i) {  // serial: a token's k rows add into one row, in a fixed order
    const int64_t n = r.row_token[i];
    for (int64_t d = 0; d < D; ++d) dx[n * D + d] += dxe[i * D + d];
  }
  if (tp) {  // each rank holds a slice of every expert's width: partial sums so far
    tp->allreduce_sum(dx, N * D);
    tp->allreduce_sum(dgate.data(), int64_t(dgate.size()));
  }

  // Gates -> router logits.
  std::vector<float> dz(size_t(N * E), 0.0f);
  for (int64_t n = 0; n < N; ++n) {
    const float* p = &s.prob[n * E];
    std::vector<double> dp(size_t(E), 0.0);
    const int32_t* chosen = &r.expert[n * k];  // dropped slots have dgate 0 but stay in the normalisation
    const double rsf = cfg.routed_scaling_factor;
    if (cfg.normalises_gates()) {
      // g_i = c s_i / S, S = sum of the chosen s:  ds_c = c (dg_c - sum_j dg_j s_j / S) / S.
      double S = 0, gsum = 0;
      for (int64_t j = 0; j < k; ++j) S += p[chosen[j]];
      for (int64_t j = 0; j < k; ++j) gsum += dgate[n * k + j] * (p[chosen[j]] / S);
      for (int64_t j = 0; j < k; ++j) dp[chosen[j]] += rsf * ((dgate[n * k + j] - gsum) / S);
    } else {
      for (int64_t j = 0; j < k; ++j) dp[chosen[j]] += rsf * dgate[n * k + j];
    }
    if (cfg.aux_loss_coef > 0) {
      // d aux / d Pnorm_{n,e} = coef * E * f_e / N, through the normalisation to p.
      std::vector<double> dpn(static_cast<size_t>(E));
      for (int64_t e = 0; e < E; ++e)
        dpn[e] = aux_grad_scale * cfg.aux_loss_coef * double(E) * (double(r.load[e]) / double(N * k)) / double(N);
      if (cfg.gating == Gating::softmax) {
        for (int64_t e = 0; e < E; ++e) dp[e] += dpn[e];
      } else {
        double S = 0, dot = 0;
        for (int64_t e = 0; e < E; ++e) S += p[e];
        for (int64_t e = 0; e < E; ++e) dot += dpn[e] * p[e];
        for (int64_t e = 0; e < E; ++e) dp[e] += (dpn[e] - dot / S) / S;
      }
    }
    if (cfg.gating == Gating::sigmoid) {
      for (int64_t e = 0; e < E; ++e) dz[n * E + e] = float(dp[e] * p[e] * (1.0 - p[e]));
    } else {
      double dot = 0;
      for (int64_t e = 0; e < E; ++e) dot += dp[e] * p[e];
      for (int64_t e = 0; e < E; ++e) dz[n * E + e] = float(p[e] * (dp[e] - dot));
    }
  }
  // Router: dWr += dz^T x, dx += dz Wr.
  dev::sgemm(true, false, E, D, N, 1.0f, dz.data(), E, s.x, D, 1.0f, g.router, D);
  dev::sgemm(false, false, N, D, E, 1.0f, dz.data(), E, w.router, D, 1.0f, dx, D);
}

void update_router_bias(float* bias, const std::vector<int64_t>& load, double rate) {
  if (load.empty()) return;
  const double mean = double(std::accumulate(load.begin(), load.end(), int64_t(0))) / double(load.size());
  for (size_t e = 0; e < load.size(); ++e) {
    bias[e] = bias_update_elem(bias[e], mean, load[e], rate);  // kernels/elem.h, shared with CUDA
  }
}

}  // namespace fp8moe
