#include "kernels/elementwise.h"

#include <algorithm>

#include "kernels/cpu/fp8_simd.h"
#include "kernels/fp8.h"

namespace fp8moe::cpu {

void add(const float* a, const float* b, float* out, int64_t n) {
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) out[i] = a[i] + b[i];
}

// Chunks of the vector spans (kernels/cpu/fp8_simd.h: bf16_encode's steps lane-wise) over the
// threads.
namespace {
constexpr int64_t kChunk = 1 << 14;
template <class Fn>
void chunked(int64_t n, Fn&& fn) {
  const int64_t chunks = (n + kChunk - 1) / kChunk;
#pragma omp parallel for schedule(static) if (chunks > 1)
  for (int64_t c = 0; c < chunks; ++c) fn(c * kChunk, std::min(n, (c + 1) * kChunk) - c * kChunk);
}
}  // namespace

void to_bf16(const float* x, uint16_t* y, int64_t n) {
  const SimdLevel level = cpu_simd_level();
  chunked(n, [&](int64_t i, int64_t m) { f32_to_bf16_span(level, x + i, y + i, m); });
}

void from_bf16(const uint16_t* x, float* y, int64_t n) {
  const SimdLevel level = cpu_simd_level();
  chunked(n, [&](int64_t i, int64_t m) { bf16_to_f32_span(level, x + i, y + i, m); });
}

void round_bf16(const float* x, float* y, int64_t n) {
  const SimdLevel level = cpu_simd_level();
  chunked(n, [&](int64_t i, int64_t m) { round_bf16_span(level, x + i, y + i, m); });
}

}  // namespace fp8moe::cpu
