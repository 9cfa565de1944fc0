// The serial sum the ops that promise the CPU's order of addition end with: one thread adds
// x[0] + x[1] + ... in order (IEEE double additions), so the result has the bits of the CPU's loop
// over the same values. For short vectors (a row's losses, a tensor's chunk partials).
#pragma once

#include <cstdint>

namespace fp8moe::cuda {
namespace {

// Launched <<<1, 1>>>. n == 0 writes +0.
__global__ void serial_sum_kernel(const double* __restrict__ x, int64_t n, double* __restrict__ out) {
  double s = 0;
  for (int64_t i = 0; i < n; ++i) s = __dadd_rn(s, x[i]);
  *out = s;
}

}  // namespace
}  // namespace fp8moe::cuda
