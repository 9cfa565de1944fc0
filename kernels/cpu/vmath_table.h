// The functions of one level of kernels/cpu/vmath.h, as vmath_<level>.cpp define them and
// kernels/cpu/vmath.cpp picks them. Internal to kernels/cpu/.
#pragma once

#include <cstdint>

namespace fp8moe::cpu::vm {

struct Table {
  void (*exp_sub)(const float* x, float shift, float* y, int64_t n);
  double (*exp_sub_sum)(const float* x, float shift, float* y, int64_t n);
  void (*exp_neg)(const float* x, float* y, int64_t n);
  void (*exp_sub_f64)(const float* x, double shift, double* y, int64_t n);
  double (*exp_sub_sum_f64)(const float* x, double shift, int64_t n);
  void (*exp_sub_scale_f64)(const float* x, double shift, double scale, float* y, int64_t n);
};

extern const Table kScalarTable;  // vmath_scalar.cpp
#if defined(__x86_64__)
extern const Table kSse2Table;    // vmath_sse2.cpp
extern const Table kAvxTable;     // vmath_avx.cpp (compiled with -mavx)
extern const Table kAvx512Table;  // vmath_avx512.cpp (compiled with -mavx512f)
#endif

}  // namespace fp8moe::cpu::vm
