// The AVX level of kernels/cpu/vmath.h: compiled with -mavx (kernels/CMakeLists.txt) and called
// only where the CPU has AVX (vmath.cpp). A chunk of 16 floats is two registers.
#include <sleef.h>

#include <cstdint>

namespace fp8moe::cpu::vm {
namespace {

struct F16 {
  __m256 v[2];
};
struct D16 {
  __m256d v[4];
};

F16 load(const float* x) { return {{_mm256_loadu_ps(x), _mm256_loadu_ps(x + 8)}}; }
void store(float* y, F16 a) { _mm256_storeu_ps(y, a.v[0]), _mm256_storeu_ps(y + 8, a.v[1]); }
F16 sub(F16 a, float s) {
  const __m256 b = _mm256_set1_ps(s);
  return {{_mm256_sub_ps(a.v[0], b), _mm256_sub_ps(a.v[1], b)}};
}
F16 neg(F16 a) { return {{_mm256_sub_ps(_mm256_setzero_ps(), a.v[0]), _mm256_sub_ps(_mm256_setzero_ps(), a.v[1])}}; }
F16 exp(F16 a) { return {{Sleef_cinz_expf8_u10avx(a.v[0]), Sleef_cinz_expf8_u10avx(a.v[1])}}; }
D16 widen(F16 a) {
  return {{_mm256_cvtps_pd(_mm256_castps256_ps128(a.v[0])), _mm256_cvtps_pd(_mm256_extractf128_ps(a.v[0], 1)),
           _mm256_cvtps_pd(_mm256_castps256_ps128(a.v[1])), _mm256_cvtps_pd(_mm256_extractf128_ps(a.v[1], 1))}};
}
D16 sub(D16 a, double s) {
  const __m256d b = _mm256_set1_pd(s);
  for (__m256d& x : a.v) x = _mm256_sub_pd(x, b);
  return a;
}
D16 exp(D16 a) {
  for (__m256d& x : a.v) x = Sleef_cinz_expd4_u10avx(x);
  return a;
}
D16 add(D16 a, D16 b) {
  for (int k = 0; k < 4; ++k) a.v[k] = _mm256_add_pd(a.v[k], b.v[k]);
  return a;
}
F16 narrow(D16 a, double scale) {
  const __m256d s = _mm256_set1_pd(scale);
  __m128 q[4];
  for (int k = 0; k < 4; ++k) q[k] = _mm256_cvtpd_ps(_mm256_mul_pd(a.v[k], s));
  return {{_mm256_insertf128_ps(_mm256_castps128_ps256(q[0]), q[1], 1),
           _mm256_insertf128_ps(_mm256_castps128_ps256(q[2]), q[3], 1)}};
}
void spill(D16 a, double* out) {
  for (int k = 0; k < 4; ++k) _mm256_storeu_pd(out + 4 * k, a.v[k]);
}

}  // namespace
}  // namespace fp8moe::cpu::vm

#define FP8MOE_VM_TABLE kAvxTable
#include "kernels/cpu/vmath_impl.h"
