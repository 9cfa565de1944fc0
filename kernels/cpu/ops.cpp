#include "kernels/ops.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "kernels/check.h"
#include "kernels/elem.h"
#include "kernels/gemm_fp8.h"  // sgemm

namespace fp8moe::cpu {

void rmsnorm_forward(const float* x, const float* w, int64_t N, int64_t D, float eps, float* y, float* rstd) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const float* xr = x + n * D;
    double ss = 0;
    for (int64_t d = 0; d < D; ++d) ss += double(xr[d]) * xr[d];
    const float r = float(1.0 / std::sqrt(ss / double(D) + eps));
    rstd[n] = r;
    for (int64_t d = 0; d < D; ++d) y[n * D + d] = xr[d] * r * w[d];
  }
}

void rmsnorm_backward(const float* x, const float* w, const float* rstd, const float* dy, int64_t N, int64_t D,
                      float* dx, float* dw) {
  // y = x r w with r = (mean(x^2) + eps)^-1/2:  dx = r (w dy) - x r^3 / D * sum(w dy x).
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const float *xr = x + n * D, *g = dy + n * D;
    const double r = rstd[n];
    double dot = 0;
    for (int64_t d = 0; d < D; ++d) dot += double(w[d]) * g[d] * xr[d];
    const double c = dot * r * r * r / double(D);
    for (int64_t d = 0; d < D; ++d) dx[n * D + d] = float(r * w[d] * g[d] - c * xr[d]);
  }
  for (int64_t n = 0; n < N; ++n)
    for (int64_t d = 0; d < D; ++d) dw[d] += dy[n * D + d] * x[n * D + d] * rstd[n];
}

void rope_table(int64_t T, int64_t hd, double theta, bool inverse, float* cs, float* sn) {
  const int64_t half = hd / 2;
  // Angles in double: t * theta^(-2i / hd) for every position and pair.
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < half; ++i) {
      const double a = double(t) * std::pow(theta, -2.0 * double(i) / double(hd));
      cs[t * half + i] = float(std::cos(a));
      sn[t * half + i] = float(inverse ? -std::sin(a) : std::sin(a));
    }
}

void rope(float* x, int64_t B, int64_t T, int64_t heads, int64_t hd, double theta, bool inverse) {
  FP8MOE_ASSERT(hd % 2 == 0, "rope needs an even head_dim, got ", hd);
  const int64_t half = hd / 2;
  std::vector<float> cs(size_t(T * half)), sn(size_t(T * half));
  rope_table(T, hd, theta, inverse, cs.data(), sn.data());
#pragma omp parallel for schedule(static)
  for (int64_t row = 0; row < B * T; ++row) {
    const int64_t t = row % T;
    for (int64_t h = 0; h < heads; ++h) {
      float* v = x + (row * heads + h) * hd;
      for (int64_t i = 0; i < half; ++i) rope_rotate(&v[i], &v[i + half], cs[t * half + i], sn[t * half + i]);
    }
  }
}

namespace {
// Scores S = Q K^T / sqrt(hd) of one (sequence, head) with the causal mask, (T, T).
void causal_scores(const float* q, const float* k, int64_t T, int64_t q_stride, int64_t k_stride, int64_t hd, float* s) {
  sgemm(false, true, T, T, hd, float(1.0 / std::sqrt(double(hd))), q, q_stride, k, k_stride, 0.0f, s, T);
  for (int64_t i = 0; i < T; ++i)
    for (int64_t j = i + 1; j < T; ++j) s[i * T + j] = -std::numeric_limits<float>::infinity();
}
}  // namespace

void attention_forward(const float* q, const float* k, const float* v, int64_t B, int64_t T, int64_t H, int64_t KVH,
                       int64_t hd, float* out, float* lse) {
  FP8MOE_ASSERT(KVH > 0 && H % KVH == 0, "attention: ", H, " heads over ", KVH, " kv heads");
  const int64_t group = H / KVH, qs = H * hd, ks = KVH * hd;
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      std::vector<float> s(size_t(T * T));
      const float* qb = q + b * T * qs + h * hd;
      const float* kb = k + b * T * ks + (h / group) * hd;
      const float* vb = v + b * T * ks + (h / group) * hd;
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
      sgemm(false, false, T, hd, T, 1.0f, s.data(), T, vb, ks, 0.0f, out + b * T * qs + h * hd, qs);
    }
}

void attention_backward(const float* q, const float* k, const float* v, const float* out, const float* lse,
                        const float* dout, int64_t B, int64_t T, int64_t H, int64_t KVH, int64_t hd, float* dq,
                        float* dk, float* dv) {
  const int64_t group = H / KVH, qs = H * hd, ks = KVH * hd;
  const float scale = float(1.0 / std::sqrt(double(hd)));
  // Parallel over (sequence, kv head): the query heads of one group add into the same dk, dv.
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t b = 0; b < B; ++b)
    for (int64_t g = 0; g < KVH; ++g) {
      std::vector<float> p(size_t(T * T)), dp(size_t(T * T));
      const float* kb = k + b * T * ks + g * hd;
      const float* vb = v + b * T * ks + g * hd;
      float* dkb = dk + b * T * ks + g * hd;
      float* dvb = dv + b * T * ks + g * hd;
      for (int64_t t = 0; t < T; ++t)
        for (int64_t d = 0; d < hd; ++d) dkb[t * ks + d] = 0.0f, dvb[t * ks + d] = 0.0f;
      for (int64_t h = g * group; h < (g + 1) * group; ++h) {
        const float* qb = q + b * T * qs + h * hd;
        const float* ob = out + b * T * qs + h * hd;
        const float* dob = dout + b * T * qs + h * hd;
        // P recomputed from the saved log-sum-exp.
        causal_scores(qb, kb, T, qs, ks, hd, p.data());
        for (int64_t i = 0; i < T; ++i) {
          const double l = lse[(b * H + h) * T + i];
          for (int64_t j = 0; j < T; ++j) p[i * T + j] = j <= i ? float(std::exp(double(p[i * T + j]) - l)) : 0.0f;
        }
        sgemm(true, false, T, hd, T, 1.0f, p.data(), T, dob, qs, 1.0f, dvb, ks);  // dV += P^T dO
        sgemm(false, true, T, T, hd, 1.0f, dob, qs, vb, ks, 0.0f, dp.data(), T);   // dP = dO V^T
        for (int64_t i = 0; i < T; ++i) {
          // dS = P (dP - sum_j P dP), and sum_j P_ij dP_ij = dO_i . O_i
          double di = 0;
          for (int64_t d = 0; d < hd; ++d) di += double(dob[i * qs + d]) * ob[i * qs + d];
          for (int64_t j = 0; j < T; ++j) dp[i * T + j] = j <= i ? float(p[i * T + j] * (dp[i * T + j] - di)) : 0.0f;
        }
        sgemm(false, false, T, hd, T, scale, dp.data(), T, kb, ks, 0.0f, dq + b * T * qs + h * hd, qs);  // dQ
        sgemm(true, false, T, hd, T, scale, dp.data(), T, qb, qs, 1.0f, dkb, ks);                        // dK +=
      }
    }
}

double cross_entropy(const float* logits, const int32_t* targets, int64_t N, int64_t V, int32_t ignore,
                     float grad_scale, float* dlogits, int64_t* count) {
  // Per-row losses summed serially afterwards: the same bits for any thread count.
  std::vector<double> loss(static_cast<size_t>(N), 0.0);
  int64_t counted = 0;
#pragma omp parallel for reduction(+ : counted) schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const float* row = logits + n * V;
    const int32_t t = targets[n];
    if (t == ignore) {
      if (dlogits)
        for (int64_t v = 0; v < V; ++v) dlogits[n * V + v] = 0.0f;
      continue;
    }
    FP8MOE_ASSERT(t >= 0 && t < V, "target ", t, " outside the vocabulary of ", V);
    float m = row[0];
    for (int64_t v = 1; v < V; ++v) m = std::max(m, row[v]);
    double sum = 0;
    for (int64_t v = 0; v < V; ++v) sum += std::exp(double(row[v]) - m);
    const double lse = m + std::log(sum);
    loss[size_t(n)] = lse - row[t];
    ++counted;
    if (dlogits)
      for (int64_t v = 0; v < V; ++v)
        dlogits[n * V + v] = float(grad_scale * (std::exp(double(row[v]) - lse) - (v == t ? 1.0 : 0.0)));
  }
  *count = counted;
  double total = 0;
  for (double x : loss) total += x;
  return total;
}

void embedding_forward(const float* table, const int32_t* ids, int64_t N, int64_t D, float* out) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n)
    for (int64_t d = 0; d < D; ++d) out[n * D + d] = table[int64_t(ids[n]) * D + d];
}

void embedding_backward(const float* dout, const int32_t* ids, int64_t N, int64_t D, float* dtable) {
  // Serial over tokens: repeated ids add into the same row (deterministic order).
  for (int64_t n = 0; n < N; ++n)
    for (int64_t d = 0; d < D; ++d) dtable[int64_t(ids[n]) * D + d] += dout[n * D + d];
}

}  // namespace fp8moe::cpu
