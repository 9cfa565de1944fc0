// IEEE round-to-nearest arithmetic shared by the CPU ops and the CUDA kernels (FP8MOE_HD): one
// source, so the code the CPU tests run is the code the GPU runs. On the device these are the IEEE
// round-to-nearest intrinsics (nvcc would otherwise fuse a * b + c into one FMA and the GPU would
// round differently from the CPU); on the host they are the plain operators, and the build passes
// -ffp-contract=off (CMakeLists.txt), since GCC fuses them in C++ wherever the target has FMA.
// The element math of each op is in that op's header (kernels/rope.h, kernels/adamw.h, ...).
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
FP8MOE_HD inline double dmul_rn(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dmul_rn(a, b);
#else
  return a * b;
#endif
}
FP8MOE_HD inline double dadd_rn(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dadd_rn(a, b);
#else
  return a + b;
#endif
}

}  // namespace fp8moe
