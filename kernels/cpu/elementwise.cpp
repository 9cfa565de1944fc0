#include "kernels/elementwise.h"

#include "kernels/fp8.h"

namespace fp8moe::cpu {

void add(const float* a, const float* b, float* out, int64_t n) {
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) out[i] = a[i] + b[i];
}

// Plain loops over bf16_encode's integer rounding, which GCC vectorises (AVX-512 where built for it).
void to_bf16(const float* x, uint16_t* y, int64_t n) {
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) y[i] = bf16_encode(x[i]);
}

void from_bf16(const uint16_t* x, float* y, int64_t n) {
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) y[i] = bf16_decode(x[i]);
}

void round_bf16(const float* x, float* y, int64_t n) {
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) y[i] = bf16_decode(bf16_encode(x[i]));
}

}  // namespace fp8moe::cpu
