#include "kernels/moe_ops.h"

#include "kernels/cpu/fp8_simd.h"
#include "kernels/fp8.h"

#include <algorithm>
#include <numeric>
#include <vector>

namespace fp8moe::cpu {

void permute(const float* x, const int64_t* row_token, int64_t R, int64_t D, float* rows) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < R; ++i) std::copy_n(x + row_token[i] * D, D, rows + i * D);
}

namespace {

template <class Row>
void unpermute_add_rows(const RoutingBuffers& r, int64_t R, const Row* rows, int64_t D, bool gated, float* out) {
  // Serial over rows: a token's k rows add into the same output row (deterministic order).
  for (int64_t i = 0; i < R; ++i) {
    const int64_t n = r.row_token[i];
    const Row* row = rows + i * D;
    float* o = out + n * D;
    if (gated) {
      const float g = r.gate[n * r.k + r.row_slot[i]];
      for (int64_t d = 0; d < D; ++d) o[d] += g * kept_value(row[d]);
    } else {
      for (int64_t d = 0; d < D; ++d) o[d] += kept_value(row[d]);
    }
  }
}

template <class Row>
void gate_grad_rows(const RoutingBuffers& r, int64_t R, const float* dout, const Row* expert_out, int64_t D, float* dye,
                    double* dgate) {
  const int64_t k = r.k;
  std::fill_n(dgate, r.N * k, 0.0);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < R; ++i) {
    const int64_t n = r.row_token[i];
    const int64_t slot = n * k + r.row_slot[i];
    const Row* eo = expert_out + i * D;
    double dg = 0;
    for (int64_t d = 0; d < D; ++d) {
      dye[i * D + d] = r.gate[slot] * dout[n * D + d];
      dg += double(dout[n * D + d]) * double(kept_value(eo[d]));
    }
    dgate[slot] = dg;
  }
}

}  // namespace

void unpermute_add(const RoutingBuffers& r, int64_t R, const float* rows, int64_t D, bool gated, float* out) {
  unpermute_add_rows(r, R, rows, D, gated, out);
}

void unpermute_add_bf16(const RoutingBuffers& r, int64_t R, const uint16_t* rows, int64_t D, bool gated, float* out) {
  unpermute_add_rows(r, R, rows, D, gated, out);
}

void gate_grad(const RoutingBuffers& r, int64_t R, const float* dout, const float* expert_out, int64_t D, float* dye,
               double* dgate) {
  gate_grad_rows(r, R, dout, expert_out, D, dye, dgate);
}

void gate_grad_bf16(const RoutingBuffers& r, int64_t R, const float* dout, const uint16_t* expert_out, int64_t D,
                    float* dye, double* dgate) {
  gate_grad_rows(r, R, dout, expert_out, D, dye, dgate);
}

void permute_bf16(const float* x, const int64_t* row_token, int64_t R, int64_t D, uint16_t* rows) {
  const SimdLevel level = cpu_simd_level();
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < R; ++i) f32_to_bf16_span(level, x + row_token[i] * D, rows + i * D, D);
}

void row_gates(const RoutingBuffers& r, int64_t R, float* gate_rows) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < R; ++i) gate_rows[i] = r.gate[r.row_token[i] * r.k + r.row_slot[i]];
}

void slot_grads(const RoutingBuffers& r, int64_t R, const double* row_grads, double* dgate) {
  std::fill_n(dgate, r.N * r.k, 0.0);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < R; ++i) dgate[r.row_token[i] * r.k + r.row_slot[i]] = row_grads[i];
}

void sum_rows(const float* rows, const int64_t* offsets, const int64_t* index, int64_t n, int64_t D, float* out) {
#pragma omp parallel for schedule(static)
  for (int64_t u = 0; u < n; ++u) {
    float* o = out + u * D;
    std::fill_n(o, D, 0.0f);
    for (int64_t t = offsets[u]; t < offsets[u + 1]; ++t)
      for (int64_t d = 0; d < D; ++d) o[d] += rows[index[t] * D + d];
  }
}

void sum_rows_bf16(const uint16_t* rows, const int64_t* offsets, const int64_t* index, int64_t n, int64_t D,
                   uint16_t* out) {
#pragma omp parallel
  {
    std::vector<float> acc(static_cast<size_t>(D));
#pragma omp for schedule(static)
    for (int64_t u = 0; u < n; ++u) {
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t t = offsets[u]; t < offsets[u + 1]; ++t)
        for (int64_t d = 0; d < D; ++d) acc[size_t(d)] += bf16_decode(rows[index[t] * D + d]);
      for (int64_t d = 0; d < D; ++d) out[u * D + d] = bf16_encode(acc[size_t(d)]);
    }
  }
}

void router_grad(const RoutingBuffers& r, const double* dgate, const RouterGradRule& rule, float* dz) {
  const int64_t N = r.N, E = r.E, k = r.k;
  std::vector<double> dp(static_cast<size_t>(E)), dpn(static_cast<size_t>(E));
  for (int64_t n = 0; n < N; ++n) {
    const float* p = &r.prob[n * E];
    std::fill(dp.begin(), dp.end(), 0.0);
    const int32_t* chosen = &r.expert[n * k];  // dropped slots have dgate 0 but stay in the normalisation
    const double rsf = rule.scaling;
    if (rule.normalise) {
      // g_i = c s_i / S, S = sum of the chosen s:  ds_c = c (dg_c - sum_j dg_j s_j / S) / S.
      double S = 0, gsum = 0;
      for (int64_t j = 0; j < k; ++j) S += p[chosen[j]];
      for (int64_t j = 0; j < k; ++j) gsum += dgate[n * k + j] * (p[chosen[j]] / S);
      for (int64_t j = 0; j < k; ++j) dp[chosen[j]] += rsf * ((dgate[n * k + j] - gsum) / S);
    } else {
      for (int64_t j = 0; j < k; ++j) dp[chosen[j]] += rsf * dgate[n * k + j];
    }
    if (rule.aux_coef > 0) {
      // d aux / d Pnorm_{n,e} = coef * E * f_e / N, through the normalisation to p.
      for (int64_t e = 0; e < E; ++e)
        dpn[e] = rule.aux_grad_scale * rule.aux_coef * double(E) * (double(r.load[e]) / double(N * k)) / double(N);
      if (!rule.sigmoid) {
        for (int64_t e = 0; e < E; ++e) dp[e] += dpn[e];
      } else {
        double S = 0, dot = 0;
        for (int64_t e = 0; e < E; ++e) S += p[e];
        for (int64_t e = 0; e < E; ++e) dot += dpn[e] * p[e];
        for (int64_t e = 0; e < E; ++e) dp[e] += (dpn[e] - dot / S) / S;
      }
    }
    if (rule.sigmoid) {
      for (int64_t e = 0; e < E; ++e) dz[n * E + e] = float(dp[e] * p[e] * (1.0 - p[e]));
    } else {
      double dot = 0;
      for (int64_t e = 0; e < E; ++e) dot += dp[e] * p[e];
      for (int64_t e = 0; e < E; ++e) dz[n * E + e] = float(p[e] * (dp[e] - dot));
    }
  }
}

double aux_loss(const RoutingBuffers& r, double coef, bool sigmoid) {
  const int64_t N = r.N, E = r.E;
  if (!(coef > 0) || N == 0) return 0.0;
  // P_e normalisation: softmax probabilities as they are; sigmoid scores over their row's sum.
  std::vector<double> pn(static_cast<size_t>(N * E));
  for (int64_t n = 0; n < N; ++n) {
    double sum = 0;
    for (int64_t e = 0; e < E; ++e) sum += r.prob[n * E + e];
    for (int64_t e = 0; e < E; ++e) pn[n * E + e] = sigmoid ? r.prob[n * E + e] / sum : r.prob[n * E + e];
  }
  double aux = 0;
  for (int64_t e = 0; e < E; ++e) {
    double pe = 0;
    for (int64_t n = 0; n < N; ++n) pe += pn[n * E + e];
    const double fe = double(r.load[e]) / double(N * r.k);
    aux += coef * double(E) * fe * pe / double(N);
  }
  return aux;
}

void bias_update(float* bias, const int64_t* load, int64_t E, double rate) {
  if (E == 0) return;
  const double mean = double(std::accumulate(load, load + E, int64_t(0))) / double(E);
  for (int64_t e = 0; e < E; ++e) bias[e] = bias_update_elem(bias[e], mean, load[e], rate);
}

}  // namespace fp8moe::cpu
