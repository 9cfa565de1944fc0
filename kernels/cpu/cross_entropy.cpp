#include "kernels/cross_entropy.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/check.h"

namespace fp8moe::cpu {

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

void ce_row_max(const float* logits, int64_t N, int64_t Vl, float* mx) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) mx[n] = *std::max_element(logits + n * Vl, logits + (n + 1) * Vl);
}

void ce_partials(const float* logits, const int32_t* targets, int64_t N, int64_t Vl, int64_t v0, int32_t ignore,
                 const float* mx, double* se, double* tl) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const float* row = logits + n * Vl;
    double s = 0.0;
    for (int64_t v = 0; v < Vl; ++v) s += std::exp(double(row[v]) - mx[n]);
    se[n] = s;
    const int64_t t = int64_t(targets[n]) - v0;
    tl[n] = targets[n] != ignore && t >= 0 && t < Vl ? double(row[t]) : 0.0;
  }
}

double ce_finish(const float* logits, const int32_t* targets, int64_t N, int64_t Vl, int64_t v0, int32_t ignore,
                 const float* mx, const double* se, const double* tl, float grad_scale, float* dlogits) {
  double total = 0;  // in row order
  for (int64_t n = 0; n < N; ++n) {
    const int32_t t = targets[n];
    if (t == ignore) {
      if (dlogits) std::fill_n(dlogits + n * Vl, Vl, 0.0f);
      continue;
    }
    const double lse = mx[n] + std::log(se[n]);
    total += lse - tl[n];
    if (dlogits)
      for (int64_t v = 0; v < Vl; ++v)
        dlogits[n * Vl + v] = float(grad_scale * (std::exp(double(logits[n * Vl + v]) - lse) - (v + v0 == t ? 1.0 : 0.0)));
  }
  return total;
}

}  // namespace fp8moe::cpu
