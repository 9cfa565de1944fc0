#include "kernels/swiglu.h"

namespace fp8moe::cpu {

void swiglu_forward(const float* a, const float* b, float* y, int64_t n) {
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) y[i] = swiglu_forward_elem(a[i], b[i]);
}

void swiglu_backward(const float* a, const float* b, const float* dy, float* da, float* db, int64_t n) {
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) swiglu_backward_elem(a[i], b[i], dy[i], &da[i], &db[i]);
}

}  // namespace fp8moe::cpu
