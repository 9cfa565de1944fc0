// The CPU's FP8 inner loops, vectorized by hand: AVX-512 where the CPU has it, AVX2 otherwise,
// the scalar element code of kernels/fp8.h on anything older. The level is picked once at run time
// (cpu_simd_level); every level gives the same bytes, counts and amax as the scalar code, which is
// itself bit-exact with CUDA's conversion (bench/fp8_exhaustive checks all 2^32 inputs on each
// level this CPU has).
//
// NOTE: the project builds for baseline x86-64, and GCC does not vectorize the encoder's per-lane
// shifts and selects on its own (the encoder ran scalar even in an AVX-512 clone); hence intrinsics,
// in functions compiled for their ISA with target attributes (kernels/cpu/fp8_simd.cpp).
#pragma once

#include <cstdint>

#include "kernels/fp8.h"

namespace fp8moe::cpu {

enum class SimdLevel : uint8_t { scalar, avx2, avx512 };
const char* to_string(SimdLevel l);

// The best level this CPU and OS support (AVX-512 F/BW/VL/DQ; AVX2), found once.
SimdLevel cpu_simd_level();

// What one span of encoding found: the counts of kernels/quantize.h's QuantTensor and, when asked,
// max |x| of the input before scaling, as FP32 bits (NaN patterns above infinity: a NaN gives NaN).
struct EncodeStats {
  int64_t saturated = 0;    // |x * scale| beyond what rounds to max finite
  int64_t underflowed = 0;  // x * scale non-zero, encoded +-0
  uint32_t amax_bits = 0;   // only when encode_span's want_amax
};

// q[i] = fp8_encode<f, saturate>(x[i] * scale[per_element ? i : 0]) for i in [0, n); counts and
// (want_amax) the input's amax added into *stats.
void encode_span(SimdLevel level, Fp8Dtype f, bool saturate, const float* x, uint8_t* q, int64_t n,
                 const float* scale, bool per_element, bool want_amax, EncodeStats* stats);
inline void encode_span(Fp8Dtype f, const float* x, uint8_t* q, int64_t n, const float* scale, bool per_element,
                        bool want_amax, EncodeStats* stats) {
  encode_span(cpu_simd_level(), f, true, x, q, n, scale, per_element, want_amax, stats);
}

// max over i of bits(|x[i]|) (kernels/quantize.h's amax order: a NaN anywhere wins).
uint32_t abs_bits_max(SimdLevel level, const float* x, int64_t n);
inline uint32_t abs_bits_max(const float* x, int64_t n) { return abs_bits_max(cpu_simd_level(), x, n); }

// m[i] = max(m[i], bits(|x[i]|)) for i in [0, n): the per-column amax of column tiles, a row at a time.
void abs_bits_max_into(SimdLevel level, uint32_t* m, const float* x, int64_t n);
inline void abs_bits_max_into(uint32_t* m, const float* x, int64_t n) { abs_bits_max_into(cpu_simd_level(), m, x, n); }

// FP8 bytes -> BF16 bits times 2^k: out[i] = bf16(decode(src[i])) with k added to the exponent of
// every value that is neither zero nor NaN (the caller has checked that the results stay normal,
// kernels/cpu/gemm_fp8.cpp). Exact: an FP8 value has at most 3 mantissa bits.
void fp8_to_bf16_span(SimdLevel level, Fp8Dtype f, const uint8_t* src, uint16_t* out, int64_t n, int k);
inline void fp8_to_bf16_span(Fp8Dtype f, const uint8_t* src, uint16_t* out, int64_t n, int k) {
  fp8_to_bf16_span(cpu_simd_level(), f, src, out, n, k);
}
// The same with an exponent step per element: out[i] moves by exp_add[i] = k_i * 128 (the BF16
// exponent field's unit), for the column scales of a cols_Tx1 tensor.
void fp8_to_bf16_span(SimdLevel level, Fp8Dtype f, const uint8_t* src, uint16_t* out, int64_t n,
                      const int16_t* exp_add);
inline void fp8_to_bf16_span(Fp8Dtype f, const uint8_t* src, uint16_t* out, int64_t n, const int16_t* exp_add) {
  fp8_to_bf16_span(cpu_simd_level(), f, src, out, n, exp_add);
}

// FP32 -> BF16 bits rounded to nearest even (kernels/fp8.h's bf16_encode, lane-wise: the same
// bits, NaN quiet, subnormals kept), BF16 -> FP32 (exact), and the rounding in FP32 (y may be x):
// train.activations bf16's conversions (kernels/elementwise.h).
void f32_to_bf16_span(SimdLevel level, const float* x, uint16_t* y, int64_t n);
void bf16_to_f32_span(SimdLevel level, const uint16_t* x, float* y, int64_t n);
void round_bf16_span(SimdLevel level, const float* x, float* y, int64_t n);

}  // namespace fp8moe::cpu
