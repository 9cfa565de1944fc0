// Element and per-row math shared by the CPU ops and the CUDA kernels (FP8MOE_HD): one source, so
// the code the CPU tests run is the code the GPU runs. The arithmetic goes through mul_rn / add_rn
// / sub_rn / div_rn, which on the device are the IEEE round-to-nearest intrinsics (nvcc would
// otherwise fuse a * b + c into one FMA and the GPU would round differently from the CPU); on the
// host they are the plain operators, and the build passes -ffp-contract=off (CMakeLists.txt), since
// GCC fuses them in C++ wherever the target has FMA.
#pragma once

#include <cmath>
#include <cstdint>

#include "kernels/fp8.h"
#include "kernels/hd.h"
#include "kernels/quantize.h"  // div_rn

namespace fp8moe {

FP8MOE_HD inline float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
FP8MOE_HD inline float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
FP8MOE_HD inline float sub_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
FP8MOE_HD inline float sqrt_rn(float a) {
#if defined(__CUDA_ARCH__)
  return __fsqrt_rn(a);
#else
  return std::sqrt(a);
#endif
}

// One rotary pair (x_i, x_{i+hd/2}) by the angle whose cosine and sine are c, s (kernels/ops.h).
FP8MOE_HD inline void rope_rotate(float* lo, float* hi, float c, float s) {
  const float a = *lo, b = *hi;
  *lo = sub_rn(mul_rn(a, c), mul_rn(b, s));
  *hi = add_rn(mul_rn(a, s), mul_rn(b, c));
}

// One AdamW element (decoupled weight decay, bias-corrected moments; g is clipped in place):
//   g *= clip; m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g^2; w = w decay - lr (m / bc1) / (sqrt(v / bc2) + eps)
struct AdamWStep {
  float b1, b2, bc1, bc2, lr, eps, decay, clip;
};
FP8MOE_HD inline void adamw_elem(const AdamWStep& h, float* w, float* m, float* v, float* g) {
  const float gr = mul_rn(*g, h.clip);
  *g = gr;
  *m = add_rn(mul_rn(h.b1, *m), mul_rn(sub_rn(1.0f, h.b1), gr));
  *v = add_rn(mul_rn(h.b2, *v), mul_rn(mul_rn(sub_rn(1.0f, h.b2), gr), gr));
  const float denom = add_rn(sqrt_rn(div_rn(*v, h.bc2)), h.eps);
  *w = sub_rn(mul_rn(*w, h.decay), div_rn(mul_rn(h.lr, div_rn(*m, h.bc1)), denom));
}

// The aux-loss-free bias update of one expert: bias += rate * sign(mean load - load).
FP8MOE_HD inline float bias_update_elem(float bias, double mean, int64_t load, double rate) {
  const double diff = mean - double(load);
  return bias + float(rate * double((diff > 0) - (diff < 0)));
}

}  // namespace fp8moe
