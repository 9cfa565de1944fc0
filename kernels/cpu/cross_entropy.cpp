#include "kernels/cross_entropy.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/check.h"
#include "kernels/cpu/vmath.h"

namespace fp8moe::cpu {

namespace {

FP8MOE_SIMD_CLONES float row_max(const float* row, int64_t V) {
  float m = row[0];
#pragma omp simd reduction(max : m)
  for (int64_t v = 1; v < V; ++v) m = std::max(m, row[v]);
  return m;
}

// dl = grad_scale (exp(logit - lse) - onehot(t)) in double, rounded once to FP32; t outside
// [0, V) (the target on another rank's shard) has no one here. The exponentials are double
// (kernels/cpu/vmath.h): the row's loss and its sum of exponentials stay within 1e-9 / 1e-11 of
// the GPU's double ones (tests/kernels/test_cross_entropy.cpp).
void softmax_grad_row(const float* row, double lse, float grad_scale, int64_t t, float* dl, int64_t V) {
  vm::exp_sub_scale_f64(row, lse, grad_scale, dl, V);
  if (t >= 0 && t < V) dl[t] = float(double(grad_scale) * (vm::exp_sub_sum_f64(row + t, lse, 1) - 1.0));
}

}  // namespace

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
    const float m = row_max(row, V);
    const double lse = m + std::log(vm::exp_sub_sum_f64(row, m, V));
    loss[size_t(n)] = lse - row[t];
    ++counted;
    if (dlogits) softmax_grad_row(row, lse, grad_scale, t, dlogits + n * V, V);
  }
  *count = counted;
  double total = 0;
  for (double x : loss) total += x;
  return total;
}

void ce_row_max(const float* logits, int64_t N, int64_t Vl, float* mx) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) mx[n] = row_max(logits + n * Vl, Vl);
}

void ce_partials(const float* logits, const int32_t* targets, int64_t N, int64_t Vl, int64_t v0, int32_t ignore,
                 const float* mx, double* se, double* tl) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const float* row = logits + n * Vl;
    se[n] = vm::exp_sub_sum_f64(row, mx[n], Vl);
    const int64_t t = int64_t(targets[n]) - v0;
    tl[n] = targets[n] != ignore && t >= 0 && t < Vl ? double(row[t]) : 0.0;
  }
}

double ce_finish(const float* logits, const int32_t* targets, int64_t N, int64_t Vl, int64_t v0, int32_t ignore,
                 const float* mx, const double* se, const double* tl, float grad_scale, float* dlogits) {
  // Per-row losses summed serially afterwards, as cross_entropy's.
  std::vector<double> loss(static_cast<size_t>(N), 0.0);
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const int32_t t = targets[n];
    if (t == ignore) {
      if (dlogits) std::fill_n(dlogits + n * Vl, Vl, 0.0f);
      continue;
    }
    const double lse = mx[n] + std::log(se[n]);
    loss[size_t(n)] = lse - tl[n];
    if (dlogits) softmax_grad_row(logits + n * Vl, lse, grad_scale, int64_t(t) - v0, dlogits + n * Vl, Vl);
  }
  double total = 0;
  for (double x : loss) total += x;
  return total;
}

}  // namespace fp8moe::cpu
