#include "kernels/attention.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/check.h"
#include "kernels/cpu/vmath.h"
#include "kernels/gemm_fp8.h"  // sgemm

namespace fp8moe::cpu {

namespace {
// Scores S = Q K^T / sqrt(hd) of one (sequence, head), (T, T). The causal mask is in the row
// functions below: row i reads S[i, 0..i] only and writes 0 after it.
void scores(const float* q, const float* k, int64_t T, int64_t q_stride, int64_t k_stride, int64_t hd, float* s) {
  sgemm(false, true, T, T, hd, float(1.0 / std::sqrt(double(hd))), q, q_stride, k, k_stride, 0.0f, s, T);
}

// Row i of P = softmax(S) in place: row[0, len) the probabilities (len = i + 1), row[len, T) 0.
// Returns the row's log-sum-exp. The exponentials are FP32 (kernels/cpu/vmath.h), their sum is
// double; each probability is its exponential times the FP32 reciprocal of the sum.
// NOTE: FP32 exponentials where they were double (glibc's exp), the sums still double. Measured
// against FP64 (tests/kernels/test_attention.cpp, its seven shapes, 2026-12-04): out within 2.2e-6,
// dq 1.3e-5, dk 1.0e-5, dv 2.0e-6 (with double exponentials 3.6e-6, 1.3e-5, 9.2e-6, 3.6e-6); the
// bounds stay 1e-5 and 5e-5.
FP8MOE_SIMD_CLONES double softmax_row(float* row, int64_t len, int64_t T) {
  float m = row[0];
#pragma omp simd reduction(max : m)
  for (int64_t j = 1; j < len; ++j) m = std::max(m, row[j]);
  const double sum = vm::exp_sub_sum(row, m, row, len);
  const float inv = float(1.0 / sum);
  for (int64_t j = 0; j < len; ++j) row[j] *= inv;
  for (int64_t j = len; j < T; ++j) row[j] = 0.0f;
  return double(m) + std::log(sum);
}

// Row i of P recomputed from the saved log-sum-exp l: row[0, len) = exp(S - l), row[len, T) 0.
FP8MOE_SIMD_CLONES void probabilities_row(float* row, float l, int64_t len, int64_t T) {
  vm::exp_sub(row, l, row, len);
  for (int64_t j = len; j < T; ++j) row[j] = 0.0f;
}

// Row i of dS = P (dP - di) in place of dP (di = sum_j P_ij dP_ij = dO_i . O_i), in double,
// rounded once; 0 after the diagonal.
FP8MOE_SIMD_CLONES void score_grad_row(const float* p, float* dp, double di, int64_t len, int64_t T) {
  for (int64_t j = 0; j < len; ++j) dp[j] = float(p[j] * (dp[j] - di));
  for (int64_t j = len; j < T; ++j) dp[j] = 0.0f;
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
      scores(qb, kb, T, qs, ks, hd, s.data());
      for (int64_t i = 0; i < T; ++i) lse[(b * H + h) * T + i] = float(softmax_row(&s[i * T], i + 1, T));
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
        scores(qb, kb, T, qs, ks, hd, p.data());
        for (int64_t i = 0; i < T; ++i) probabilities_row(&p[i * T], lse[(b * H + h) * T + i], i + 1, T);
        sgemm(true, false, T, hdv, T, 1.0f, p.data(), T, dob, os, 1.0f, dvb, vs);  // dV += P^T dO
        sgemm(false, true, T, T, hdv, 1.0f, dob, os, vb, vs, 0.0f, dp.data(), T);   // dP = dO V^T
        for (int64_t i = 0; i < T; ++i) {
          // dS = P (dP - sum_j P dP), and sum_j P_ij dP_ij = dO_i . O_i
          double di = 0;
          for (int64_t d = 0; d < hdv; ++d) di += double(dob[i * os + d]) * ob[i * os + d];
          score_grad_row(&p[i * T], &dp[i * T], di, i + 1, T);
        }
        sgemm(false, false, T, hd, T, scale, dp.data(), T, kb, ks, 0.0f, dq + b * T * qs + h * hd, qs);  // dQ
        sgemm(true, false, T, hd, T, scale, dp.data(), T, qb, qs, 1.0f, dkb, ks);                        // dK +=
      }
    }
}

}  // namespace fp8moe::cpu
