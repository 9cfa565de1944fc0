// Vectorized exponentials for the CPU ops (the softmaxes of attention, cross-entropy and the
// router, sigmoid and SiLU), from SLEEF 3.5 (libsleef), and the fixed-order sums around them.
//
// Levels: the same code is compiled once per instruction set (kernels/cpu/vmath_impl.h, included
// by vmath_<level>.cpp with that level's compiler flags) and the widest one this CPU runs is
// picked at the first call: AVX-512 (16 floats a vector), AVX (8), SSE2 (4: every x86-64) or
// scalar (SLEEF's portable C, on any architecture).
//
// NOTE: every level gives the same bits. Each uses SLEEF's deterministic functions ("cinz": the
// same algorithm and the same rounding at every vector width, without fused multiply-adds; 1.0
// ulp), and the inputs are taken 16 at a time on every level (a partial last chunk padded, the pad
// dropped), so an element's result never depends on the vector width or on where it sits in the
// span. The sums add element i into lane i % 16, in order, then the lanes pairwise (lane l + 8
// into l, then + 4, + 2, + 1): the same additions in the same order at every width. So these
// functions, and the ops' parts built on them, do not depend on the CPU's vector width (measured:
// all 2.2e9 floats in [-104, 89] give the same exp on the AVX-512, AVX and SSE2 levels, within
// 0.95 ulp of the exact value), and the tests see every level on one machine
// (tests/kernels/test_vmath.cpp, Ops.*IsTheSameOnEveryVectorMathLevel). (Not a whole step: the
// SGEMMs beside them are oneDNN's, whose kernels are chosen per CPU.)
//
// Each function is serial (the ops call it from their OpenMP loops, on one row or one span) and
// takes n >= 0 elements; y may be x itself (in place) but no other overlap.
#pragma once

#include <cstdint>

// NOTE: the build targets baseline x86-64 (SSE2). The ops' loops around these calls (the
// multiplications, divisions, maxima, square roots) are compiled also for AVX2 and AVX-512 and
// picked at load time (GCC's target_clones; the FP8 encoders, whose per-lane shifts GCC does not
// vectorize, are intrinsics instead: kernels/cpu/fp8_simd.h). They are elementwise IEEE operations without contraction (-ffp-contract=off), so the clones
// agree bit for bit.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define FP8MOE_SIMD_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define FP8MOE_SIMD_CLONES
#endif

namespace fp8moe::cpu::vm {

enum class Level { scalar, sse2, avx, avx512 };
inline constexpr Level kLevels[] = {Level::scalar, Level::sse2, Level::avx, Level::avx512};
const char* to_string(Level level);
// Whether this CPU (and this build: the x86 levels on x86-64 only) runs the level.
bool supported(Level level);
// The level the functions below use: the widest supported one, unless set_level chose another.
Level level();
// Makes the functions use `level` (which must be supported) and returns the previous one. For the
// tests and the benchmarks, which run the ops on every level; not while an op runs.
Level set_level(Level level);

// The number of lanes of the sums (whatever the vector width).
inline constexpr int kSumLanes = 16;

// FP32: y[i] = exp(x[i] - shift), the difference rounded to FP32 first.
void exp_sub(const float* x, float shift, float* y, int64_t n);
// The same, and returns the sum of the y[i] in double (each y[i] converted exactly), in the lane
// order above.
double exp_sub_sum(const float* x, float shift, float* y, int64_t n);
// FP32: y[i] = exp(-x[i]) (sigmoid(x) = 1 / (1 + y)).
void exp_neg(const float* x, float* y, int64_t n);
// Double: y[i] = exp(double(x[i]) - shift).
void exp_sub_f64(const float* x, double shift, double* y, int64_t n);
// Double: the sum of exp(double(x[i]) - shift), in the lane order above.
double exp_sub_sum_f64(const float* x, double shift, int64_t n);
// Double, rounded once to FP32: y[i] = float(scale * exp(double(x[i]) - shift)).
void exp_sub_scale_f64(const float* x, double shift, double scale, float* y, int64_t n);

// The sum of f(i) over i in [0, n) in double, in the lane order above (the same sums as
// exp_sub_sum's and exp_sub_sum_f64's), for the ops' own sums (RMSNorm's, the gradient norm's).
template <class F>
[[gnu::always_inline]] inline double lane_sum(int64_t n, F f) {
  double acc[kSumLanes] = {};
  int64_t i = 0;
  for (; i + kSumLanes <= n; i += kSumLanes)
    for (int l = 0; l < kSumLanes; ++l) acc[l] += f(i + l);
  for (int l = 0; i + l < n; ++l) acc[l] += f(i + l);
  for (int w = kSumLanes / 2; w >= 1; w /= 2)
    for (int l = 0; l < w; ++l) acc[l] += acc[l + w];
  return acc[0];
}

}  // namespace fp8moe::cpu::vm
