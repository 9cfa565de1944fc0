// The AVX-512 level of kernels/cpu/vmath.h: compiled with -mavx512f (kernels/CMakeLists.txt) and
// called only where the CPU has AVX-512F (vmath.cpp). A chunk of 16 floats is one register.
#include <sleef.h>

#include <cstdint>

// NOTE: GCC 12 warns inside its own AVX-512 intrinsics (_mm512_cvtps_pd, _mm512_extractf64x4_pd,
// ...: the _mm512_undefined_* they start from), a false positive fixed in GCC 13 (PR 105593).
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ < 13
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace fp8moe::cpu::vm {
namespace {

struct F16 {
  __m512 v;
};
struct D16 {
  __m512d lo, hi;
};

F16 load(const float* x) { return {_mm512_loadu_ps(x)}; }
void store(float* y, F16 a) { _mm512_storeu_ps(y, a.v); }
F16 sub(F16 a, float s) { return {_mm512_sub_ps(a.v, _mm512_set1_ps(s))}; }
F16 neg(F16 a) { return {_mm512_sub_ps(_mm512_setzero_ps(), a.v)}; }
F16 exp(F16 a) { return {Sleef_cinz_expf16_u10avx512fnofma(a.v)}; }
D16 widen(F16 a) {
  return {_mm512_cvtps_pd(_mm512_castps512_ps256(a.v)),
          _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a.v), 1)))};
}
D16 sub(D16 a, double s) { return {_mm512_sub_pd(a.lo, _mm512_set1_pd(s)), _mm512_sub_pd(a.hi, _mm512_set1_pd(s))}; }
D16 exp(D16 a) { return {Sleef_cinz_expd8_u10avx512fnofma(a.lo), Sleef_cinz_expd8_u10avx512fnofma(a.hi)}; }
D16 add(D16 a, D16 b) { return {_mm512_add_pd(a.lo, b.lo), _mm512_add_pd(a.hi, b.hi)}; }
F16 narrow(D16 a, double scale) {
  const __m512d s = _mm512_set1_pd(scale);
  const __m256 lo = _mm512_cvtpd_ps(_mm512_mul_pd(a.lo, s)), hi = _mm512_cvtpd_ps(_mm512_mul_pd(a.hi, s));
  return {_mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(lo)), _mm256_castps_pd(hi), 1))};
}
void spill(D16 a, double* out) { _mm512_storeu_pd(out, a.lo), _mm512_storeu_pd(out + 8, a.hi); }

}  // namespace
}  // namespace fp8moe::cpu::vm

#define FP8MOE_VM_TABLE kAvx512Table
#include "kernels/cpu/vmath_impl.h"
