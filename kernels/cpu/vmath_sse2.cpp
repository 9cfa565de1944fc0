// The SSE2 level of kernels/cpu/vmath.h (every x86-64 CPU; the build's own flags). A chunk of 16
// floats is four registers.
#include <sleef.h>

#include <cstdint>

namespace fp8moe::cpu::vm {
namespace {

struct F16 {
  __m128 v[4];
};
struct D16 {
  __m128d v[8];
};

F16 load(const float* x) {
  F16 a;
  for (int k = 0; k < 4; ++k) a.v[k] = _mm_loadu_ps(x + 4 * k);
  return a;
}
void store(float* y, F16 a) {
  for (int k = 0; k < 4; ++k) _mm_storeu_ps(y + 4 * k, a.v[k]);
}
F16 sub(F16 a, float s) {
  const __m128 b = _mm_set1_ps(s);
  for (__m128& x : a.v) x = _mm_sub_ps(x, b);
  return a;
}
F16 neg(F16 a) {
  for (__m128& x : a.v) x = _mm_sub_ps(_mm_setzero_ps(), x);
  return a;
}
F16 exp(F16 a) {
  for (__m128& x : a.v) x = Sleef_cinz_expf4_u10sse2(x);
  return a;
}
D16 widen(F16 a) {
  D16 d;
  for (int k = 0; k < 4; ++k)
    d.v[2 * k] = _mm_cvtps_pd(a.v[k]), d.v[2 * k + 1] = _mm_cvtps_pd(_mm_movehl_ps(a.v[k], a.v[k]));
  return d;
}
D16 sub(D16 a, double s) {
  const __m128d b = _mm_set1_pd(s);
  for (__m128d& x : a.v) x = _mm_sub_pd(x, b);
  return a;
}
D16 exp(D16 a) {
  for (__m128d& x : a.v) x = Sleef_cinz_expd2_u10sse2(x);
  return a;
}
D16 add(D16 a, D16 b) {
  for (int k = 0; k < 8; ++k) a.v[k] = _mm_add_pd(a.v[k], b.v[k]);
  return a;
}
F16 narrow(D16 a, double scale) {
  const __m128d s = _mm_set1_pd(scale);
  F16 f;
  for (int k = 0; k < 4; ++k)
    f.v[k] = _mm_movelh_ps(_mm_cvtpd_ps(_mm_mul_pd(a.v[2 * k], s)), _mm_cvtpd_ps(_mm_mul_pd(a.v[2 * k + 1], s)));
  return f;
}
void spill(D16 a, double* out) {
  for (int k = 0; k < 8; ++k) _mm_storeu_pd(out + 2 * k, a.v[k]);
}

}  // namespace
}  // namespace fp8moe::cpu::vm

#define FP8MOE_VM_TABLE kSse2Table
#include "kernels/cpu/vmath_impl.h"
