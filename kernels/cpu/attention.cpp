#include "kernels/attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "kernels/check.h"
#include "kernels/gemm_fp8.h"  // sgemm

namespace fp8moe::cpu {

namespace {
// Scores S = Q K^T / sqrt(hd) of one (sequence, head) with the causal mask, (T, T).
void causal_scores(const float* q, const float* k, int64_t T, int64_t q_stride, int64_t k_stride, int64_t hd, float* s) {
  sgemm(false, true, T, T, hd, float(1.0 / std::sqrt(double(hd))), q, q_stride, k, k_stride, 0.0f, s, T);
  for (int64_t i = 0; i < T; ++i)
    for (int64_t j = i + 1; j < T; ++j) s[i * T + j] = -std::numeric_limits<float>::infinity();
}
}  // namespace

void attention_forward(const float* q, const float* k, const float* v, int64_t B, int64_t T, int64_t H, int64_t KVH,
                       int64_t hd, int64_t hdv, float* out, float* lse) {
  FP8MOE_ASSERT(KVH > 0 && H % KVH == 0, "attention: ", H, " heads over ", KVH, " kv heads");
  FP8MOE_ASSERT(hd >= 1 && hdv >= 1, "attention: head sizes ", hd, " (query/key) and ", hdv, " (value)");
  // Row strides: q (H hd), k (KVH hd), v (KVH hdv), out (H hdv).
  const int64_t group = H / KVH, qs = H * hd, ks = KVH * hd, vs = KVH * hdv, os = H * hdv;
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      std::vector<float> s(size_t(T * T));
      const float* qb = q + b * T * qs + h * hd;
      const float* kb = k + b * T * ks + (h / group) * hd;
      const float* vb = v + b * T * vs + (h / group) * hdv;
      causal_scores(qb, kb, T, qs, ks, hd, s.data());
      for (int64_t i = 0; i < T; ++i) {  // softmax rows in FP32 (sums in double), keep log-sum-exp
        float* row = &s[i * T];
        float m = row[0];
        for (int64_t j = 1; j <= i; ++j) m = std::max(m, row[j]);
        double sum = 0;
        for (int64_t j = 0; j <= i; ++j) sum += std::exp(double(row[j]) - m);
        const double l = m + std::log(sum);
        lse[(b * H + h) * T + i] = float(l);
        for (int64_t j = 0; j < T; ++j) row[j] = j <= i ? float(std::exp(double(row[j]) - l)) : 0.0f;
      }
      sgemm(false, false, T, hdv, T, 1.0f, s.data(), T, vb, vs, 0.0f, out + b * T * os + h * hdv, os);
    }
}

void attention_backward(const float* q, const float* k, const float* v, const float* out, const float* lse,
                        const float* dout, int64_t B, int64_t T, int64_t H, int64_t KVH, int64_t hd, int64_t hdv,
                        float* dq, float* dk, float* dv) {
  FP8MOE_ASSERT(KVH > 0 && H % KVH == 0, "attention: ", H, " heads over ", KVH, " kv heads");
  FP8MOE_ASSERT(hd >= 1 && hdv >= 1, "attention: head sizes ", hd, " (query/key) and ", hdv, " (value)");
  const int64_t group = H / KVH, qs = H * hd, ks = KVH * hd, vs = KVH * hdv, os = H * hdv;
  const float scale = float(1.0 / std::sqrt(double(hd)));
  // Parallel over (sequence, kv head): the query heads of one group add into the same dk, dv.
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t b = 0; b < B; ++b)
    for (int64_t g = 0; g < KVH; ++g) {
      std::vector<float> p(size_t(T * T)), dp(size_t(T * T));
      const float* kb = k + b * T * ks + g * hd;
      const float* vb = v + b * T * vs + g * hdv;
      float* dkb = dk + b * T * ks + g * hd;
      float* dvb = dv + b * T * vs + g * hdv;
      for (int64_t t = 0; t < T; ++t) {
        for (int64_t d = 0; d < hd; ++d) dkb[t * ks + d] = 0.0f;
        for (int64_t d = 0; d < hdv; ++d) dvb[t * vs + d] = 0.0f;
      }
      for (int64_t h = g * group; h < (g + 1) * group; ++h) {
        const float* qb = q + b * T * qs + h * hd;
        const float* ob = out + b * T * os + h * hdv;
        const float* dob = dout + b * T * os + h * hdv;
        // P recomputed from the saved log-sum-exp.
        causal_scores(qb, kb, T, qs, ks, hd, p.data());
        for (int64_t i = 0; i < T; ++i) {
          const double l = lse[(b * H + h) * T + i];
          for (int64_t j = 0; j < T; ++j) p[i * T + j] = j <= i ? float(std::exp(double(p[i * T + j]) - l)) : 0.0f;
        }
        sgemm(true, false, T, hdv, T, 1.0f, p.data(), T, dob, os, 1.0f, dvb, vs);  // dV += P^T dO
        sgemm(false, true, T, T, hdv, 1.0f, dob, os, vb, vs, 0.0f, dp.data(), T);   // dP = dO V^T
        for (int64_t i = 0; i < T; ++i) {
          // dS = P (dP - sum_j P dP), and sum_j P_ij dP_ij = dO_i . O_i
          double di = 0;
          for (int64_t d = 0; d < hdv; ++d) di += double(dob[i * os + d]) * ob[i * os + d];
          for (int64_t j = 0; j < T; ++j) dp[i * T + j] = j <= i ? float(p[i * T + j] * (dp[i * T + j] - di)) : 0.0f;
        }
        sgemm(false, false, T, hd, T, scale, dp.data(), T, kb, ks, 0.0f, dq + b * T * qs + h * hd, qs);  // dQ
        sgemm(true, false, T, hd, T, scale, dp.data(), T, qb, qs, 1.0f, dkb, ks);                        // dK +=
      }
    }
}

}  // namespace fp8moe::cpu
