// The scalar level of kernels/cpu/vmath.h: SLEEF's portable C functions, one element at a time,
// on any architecture (the only level off x86-64). The same algorithm as the vector levels
// ("cinz"), so the same bits.
#include <sleef.h>

#include <cstdint>

namespace fp8moe::cpu::vm {
namespace {

struct F16 {
  float v[16];
};
struct D16 {
  double v[16];
};

F16 load(const float* x) {
  F16 a;
  for (int l = 0; l < 16; ++l) a.v[l] = x[l];
  return a;
}
void store(float* y, F16 a) {
  for (int l = 0; l < 16; ++l) y[l] = a.v[l];
}
F16 sub(F16 a, float s) {
  for (float& x : a.v) x = x - s;
  return a;
}
F16 neg(F16 a) {
  for (float& x : a.v) x = 0.0f - x;
  return a;
}
F16 exp(F16 a) {
  for (float& x : a.v) x = Sleef_cinz_expf1_u10purec(x);
  return a;
}
D16 widen(F16 a) {
  D16 d;
  for (int l = 0; l < 16; ++l) d.v[l] = double(a.v[l]);
  return d;
}
D16 sub(D16 a, double s) {
  for (double& x : a.v) x = x - s;
  return a;
}
D16 exp(D16 a) {
  for (double& x : a.v) x = Sleef_cinz_expd1_u10purec(x);
  return a;
}
D16 add(D16 a, D16 b) {
  for (int l = 0; l < 16; ++l) a.v[l] += b.v[l];
  return a;
}
F16 narrow(D16 a, double scale) {
  F16 f;
  for (int l = 0; l < 16; ++l) f.v[l] = float(scale * a.v[l]);
  return f;
}
void spill(D16 a, double* out) {
  for (int l = 0; l < 16; ++l) out[l] = a.v[l];
}

}  // namespace
}  // namespace fp8moe::cpu::vm

#define FP8MOE_VM_TABLE kScalarTable
#include "kernels/cpu/vmath_impl.h"
