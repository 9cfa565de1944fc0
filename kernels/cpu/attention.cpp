#include "kernels/attention.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/check.h"
#include "kernels/cpu/vmath.h"
#include "kernels/cpu/fp8_simd.h"  // the BF16 conversions of one row, on the calling thread
#include "kernels/gemm_fp8.h"  // sgemm, gemm_bf16

namespace fp8moe::cpu {

namespace {
// The causal tiles: attention works on row blocks of this many queries, each against the keys up
// to its last row, so that the score tiles above the diagonal are neither computed nor read.
constexpr int64_t kCausalBlock = 64;

// Scores S = Q K^T / sqrt(hd) of m queries against n keys of one (sequence, head), into rows of
// stride T. The causal mask is in the row functions below: row i reads S[i, 0..i] only and writes
// 0 after it, up to the end of its block's keys.
void scores(const float* q, const float* k, int64_t m, int64_t n, int64_t q_stride, int64_t k_stride, int64_t hd,
            float* s, int64_t T) {
  sgemm(false, true, m, n, hd, float(1.0 / std::sqrt(double(hd))), q, q_stride, k, k_stride, 0.0f, s, T);
}

// Row i of P = softmax(S) in place: row[0, len) the probabilities (len = i + 1), row[len, n) 0
// (n: the keys of its row block).
// Returns the row's log-sum-exp. The exponentials are FP32 (kernels/cpu/vmath.h), their sum is
// double; each probability is its exponential times the FP32 reciprocal of the sum.
// NOTE: FP32 exponentials where they were double (glibc's exp), the sums still double. Measured
// against FP64 (tests/kernels/test_attention.cpp, its first seven shapes, 2026-12-04): out within 2.2e-6,
// dq 1.3e-5, dk 1.0e-5, dv 2.0e-6 (with double exponentials 3.6e-6, 1.3e-5, 9.2e-6, 3.6e-6); the
// bounds stay 1e-5 and 5e-5.
FP8MOE_SIMD_CLONES double softmax_row(float* row, int64_t len, int64_t n) {
  float m = row[0];
#pragma omp simd reduction(max : m)
  for (int64_t j = 1; j < len; ++j) m = std::max(m, row[j]);
  const double sum = vm::exp_sub_sum(row, m, row, len);
  const float inv = float(1.0 / sum);
  for (int64_t j = 0; j < len; ++j) row[j] *= inv;
  for (int64_t j = len; j < n; ++j) row[j] = 0.0f;
  return double(m) + std::log(sum);
}

// Row i of P recomputed from the saved log-sum-exp l: row[0, len) = exp(S - l), row[len, n) 0.
FP8MOE_SIMD_CLONES void probabilities_row(float* row, float l, int64_t len, int64_t n) {
  vm::exp_sub(row, l, row, len);
  for (int64_t j = len; j < n; ++j) row[j] = 0.0f;
}

// Row i of dS = P (dP - di) in place of dP (di = sum_j P_ij dP_ij = dO_i . O_i), in double,
// rounded once; 0 after the diagonal up to n.
FP8MOE_SIMD_CLONES void score_grad_row(const float* p, float* dp, double di, int64_t len, int64_t n) {
  for (int64_t j = 0; j < len; ++j) dp[j] = float(p[j] * (dp[j] - di));
  for (int64_t j = len; j < n; ++j) dp[j] = 0.0f;
}
// Row strides: q (H hd), k (KVH hd), v (KVH hdv), out (H hdv); query heads per kv head.
struct Strides {
  int64_t group, qs, ks, vs, os;
};
Strides strides(int64_t H, int64_t KVH, int64_t hd, int64_t hdv) {
  FP8MOE_ASSERT(KVH > 0 && H % KVH == 0, "attention: ", H, " heads over ", KVH, " kv heads");
  FP8MOE_ASSERT(hd >= 1 && hdv >= 1, "attention: head sizes ", hd, " (query/key) and ", hdv, " (value)");
  return {H / KVH, H * hd, KVH * hd, KVH * hdv, H * hdv};
}

// The BF16 kernels' per-thread buffers stay allocated between calls for sequences up to this
// long (4 T^2 entries: 12 MB a thread at 1024), and go at the end of a longer one's call.
constexpr int64_t kKeptSequence = 1024;
template <class V>
void release(V& v) {
  V().swap(v);
}

// width elements of each of T rows, stride apart, set to 0.
void zero_rows(float* x, int64_t T, int64_t stride, int64_t width) {
  for (int64_t t = 0; t < T; ++t)
    for (int64_t d = 0; d < width; ++d) x[t * stride + d] = 0.0f;
}
}  // namespace

void attention_forward(const float* q, const float* k, const float* v, int64_t B, int64_t T, int64_t H, int64_t KVH,
                       int64_t hd, int64_t hdv, float* out, float* lse) {
  const auto [group, qs, ks, vs, os] = strides(H, KVH, hd, hdv);
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      // One row block of scores at a time: the forward keeps none of them (the backward recomputes).
      std::vector<float> s(size_t(std::min(T, kCausalBlock) * T));
      const float* qb = q + b * T * qs + h * hd;
      const float* kb = k + b * T * ks + (h / group) * hd;
      const float* vb = v + b * T * vs + (h / group) * hdv;
      float* ob = out + b * T * os + h * hdv;
      // Row block [r0, r1) reads keys and values [0, r1) only: the tiles above the diagonal are
      // never computed (about half of S for long sequences).
      for (int64_t r0 = 0; r0 < T; r0 += kCausalBlock) {
        const int64_t r1 = std::min(T, r0 + kCausalBlock), m = r1 - r0;
        float* sb = s.data();
        scores(qb + r0 * qs, kb, m, r1, qs, ks, hd, sb, T);
        for (int64_t i = r0; i < r1; ++i) lse[(b * H + h) * T + i] = float(softmax_row(&sb[(i - r0) * T], i + 1, r1));
        sgemm(false, false, m, hdv, r1, 1.0f, sb, T, vb, vs, 0.0f, ob + r0 * os, os);
      }
    }
}

void attention_backward(const float* q, const float* k, const float* v, const float* out, const float* lse,
                        const float* dout, int64_t B, int64_t T, int64_t H, int64_t KVH, int64_t hd, int64_t hdv,
                        float* dq, float* dk, float* dv) {
  const auto [group, qs, ks, vs, os] = strides(H, KVH, hd, hdv);
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
      zero_rows(dkb, T, ks, hd), zero_rows(dvb, T, vs, hdv);
      for (int64_t h = g * group; h < (g + 1) * group; ++h) {
        const float* qb = q + b * T * qs + h * hd;
        const float* ob = out + b * T * os + h * hdv;
        const float* dob = dout + b * T * os + h * hdv;
        float* dqb = dq + b * T * qs + h * hd;
        // By row block [r0, r1), over the keys [0, r1) only (the causal tiles): P recomputed from
        // the saved log-sum-exp, dP = dO V^T, dS = P (dP - sum_j P dP) with sum_j P_ij dP_ij =
        // dO_i . O_i, and dQ = scale dS K. Each written row is 0 from its diagonal to r1.
        for (int64_t r0 = 0; r0 < T; r0 += kCausalBlock) {
          const int64_t r1 = std::min(T, r0 + kCausalBlock), m = r1 - r0;
          float* pb = p.data() + r0 * T;
          float* dpb = dp.data() + r0 * T;
          scores(qb + r0 * qs, kb, m, r1, qs, ks, hd, pb, T);
          for (int64_t i = r0; i < r1; ++i) probabilities_row(&p[i * T], lse[(b * H + h) * T + i], i + 1, r1);
          sgemm(false, true, m, r1, hdv, 1.0f, dob + r0 * os, os, vb, vs, 0.0f, dpb, T);
          for (int64_t i = r0; i < r1; ++i) {
            double di = 0;
            for (int64_t d = 0; d < hdv; ++d) di += double(dob[i * os + d]) * ob[i * os + d];
            score_grad_row(&p[i * T], &dp[i * T], di, i + 1, r1);
          }
          sgemm(false, false, m, hd, r1, scale, dpb, T, kb, ks, 0.0f, dqb + r0 * qs, qs);
        }
        // By column block [c0, c1), over the queries [c0, T) (the rows that can attend to it; the
        // row blocks above wrote every one of those entries): dV += P^T dO, dK += scale dS^T Q.
        for (int64_t c0 = 0; c0 < T; c0 += kCausalBlock) {
          const int64_t c1 = std::min(T, c0 + kCausalBlock), n = c1 - c0, rows = T - c0;
          sgemm(true, false, n, hdv, rows, 1.0f, p.data() + c0 * T + c0, T, dob + c0 * os, os, 1.0f, dvb + c0 * vs, vs);
          sgemm(true, false, n, hd, rows, scale, dp.data() + c0 * T + c0, T, qb + c0 * qs, qs, 1.0f, dkb + c0 * ks,
                ks);
        }
      }
    }
}

void attention_forward_bf16(const uint16_t* q, const uint16_t* k, const uint16_t* v, int64_t B, int64_t T, int64_t H,
                            int64_t KVH, int64_t hd, int64_t hdv, float* out, float* lse) {
  const auto [group, qs, ks, vs, os] = strides(H, KVH, hd, hdv);
  const float scale = float(1.0 / std::sqrt(double(hd)));
  const SimdLevel level = cpu_simd_level();
#pragma omp parallel
  {
    // Each thread's buffers (every entry read is written first), kept for its next call up to
    // kKeptSequence: made per (sequence, head), their zeroing and allocation were a tenth of the
    // kernels' time at tiny's shape.
    const int64_t rows = std::min(T, kCausalBlock);
    thread_local std::vector<float> s;
    thread_local std::vector<uint16_t> p16;
    s.resize(std::max(s.size(), size_t(rows * T))), p16.resize(std::max(p16.size(), size_t(rows * T)));
#pragma omp for collapse(2) schedule(static)
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      const uint16_t* qb = q + b * T * qs + h * hd;
      const uint16_t* kb = k + b * T * ks + (h / group) * hd;
      const uint16_t* vb = v + b * T * vs + (h / group) * hdv;
      float* ob = out + b * T * os + h * hdv;
      for (int64_t r0 = 0; r0 < T; r0 += kCausalBlock) {
        const int64_t r1 = std::min(T, r0 + kCausalBlock), m = r1 - r0;
        gemm_bf16(false, true, m, r1, hd, scale, qb + r0 * qs, qs, kb, ks, 0.0f, s.data(), T);
        for (int64_t i = r0; i < r1; ++i) {
          float* row = &s[size_t((i - r0) * T)];
          lse[(b * H + h) * T + i] = float(softmax_row(row, i + 1, r1));
          f32_to_bf16_span(level, row, &p16[size_t((i - r0) * T)], r1);
        }
        gemm_bf16(false, false, m, hdv, r1, 1.0f, p16.data(), T, vb, vs, 0.0f, ob + r0 * os, os);
      }
    }
    if (T > kKeptSequence) release(s), release(p16);
  }
}

void attention_backward_bf16(const uint16_t* q, const uint16_t* k, const uint16_t* v, const float* out,
                             const float* lse, const float* dout, int64_t B, int64_t T, int64_t H, int64_t KVH,
                             int64_t hd, int64_t hdv, float* dq, float* dk, float* dv) {
  const auto [group, qs, ks, vs, os] = strides(H, KVH, hd, hdv);
  const float scale = float(1.0 / std::sqrt(double(hd)));
  const SimdLevel level = cpu_simd_level();
#pragma omp parallel
  {
    // Each thread's buffers, as the forward's.
    thread_local std::vector<float> p, dp, do32;
    thread_local std::vector<uint16_t> p16, ds16, do16;
    for (auto* x : {&p, &dp}) x->resize(std::max(x->size(), size_t(T * T)));
    for (auto* x : {&p16, &ds16}) x->resize(std::max(x->size(), size_t(T * T)));
    do32.resize(std::max(do32.size(), size_t(hdv))), do16.resize(std::max(do16.size(), size_t(T * hdv)));
#pragma omp for collapse(2) schedule(static)
  for (int64_t b = 0; b < B; ++b)
    for (int64_t g = 0; g < KVH; ++g) {
      const uint16_t* kb = k + b * T * ks + g * hd;
      const uint16_t* vb = v + b * T * vs + g * hdv;
      float* dkb = dk + b * T * ks + g * hd;
      float* dvb = dv + b * T * vs + g * hdv;
      zero_rows(dkb, T, ks, hd), zero_rows(dvb, T, vs, hdv);
      for (int64_t h = g * group; h < (g + 1) * group; ++h) {
        const uint16_t* qb = q + b * T * qs + h * hd;
        const float* ob = out + b * T * os + h * hdv;
        const float* dob = dout + b * T * os + h * hdv;
        float* dqb = dq + b * T * qs + h * hd;
        for (int64_t t = 0; t < T; ++t)  // dO of this head in BF16, (T, hdv)
          f32_to_bf16_span(level, dob + t * os, &do16[size_t(t * hdv)], hdv);
        // By row block, as attention_backward: P from the log-sum-exp, dP = dO V^T, dS, and
        // dQ = scale dS K; P and dS rounded to BF16 by row for the GEMMs.
        for (int64_t r0 = 0; r0 < T; r0 += kCausalBlock) {
          const int64_t r1 = std::min(T, r0 + kCausalBlock), m = r1 - r0;
          float* pb = p.data() + r0 * T;
          float* dpb = dp.data() + r0 * T;
          gemm_bf16(false, true, m, r1, hd, scale, qb + r0 * qs, qs, kb, ks, 0.0f, pb, T);
          for (int64_t i = r0; i < r1; ++i) probabilities_row(&p[size_t(i * T)], lse[(b * H + h) * T + i], i + 1, r1);
          gemm_bf16(false, true, m, r1, hdv, 1.0f, &do16[size_t(r0 * hdv)], hdv, vb, vs, 0.0f, dpb, T);
          for (int64_t i = r0; i < r1; ++i) {
            bf16_to_f32_span(level, &do16[size_t(i * hdv)], do32.data(), hdv);
            double di = 0;
            for (int64_t d = 0; d < hdv; ++d) di += double(do32[size_t(d)]) * ob[i * os + d];
            score_grad_row(&p[size_t(i * T)], &dp[size_t(i * T)], di, i + 1, r1);
            f32_to_bf16_span(level, &p[size_t(i * T)], &p16[size_t(i * T)], r1);
            f32_to_bf16_span(level, &dp[size_t(i * T)], &ds16[size_t(i * T)], r1);
          }
          gemm_bf16(false, false, m, hd, r1, scale, &ds16[size_t(r0 * T)], T, kb, ks, 0.0f, dqb + r0 * qs, qs);
        }
        // By column block: dV += P^T dO, dK += scale dS^T Q.
        for (int64_t c0 = 0; c0 < T; c0 += kCausalBlock) {
          const int64_t c1 = std::min(T, c0 + kCausalBlock), n = c1 - c0, rows = T - c0;
          gemm_bf16(true, false, n, hdv, rows, 1.0f, &p16[size_t(c0 * T + c0)], T, &do16[size_t(c0 * hdv)], hdv, 1.0f,
                    dvb + c0 * vs, vs);
          gemm_bf16(true, false, n, hd, rows, scale, &ds16[size_t(c0 * T + c0)], T, qb + c0 * qs, qs, 1.0f,
                    dkb + c0 * ks, ks);
        }
      }
    }
    if (T > kKeptSequence) release(p), release(dp), release(p16), release(ds16), release(do16);
  }
}

}  // namespace fp8moe::cpu
