// Element-wise ops of the step: the residual adds and the sums of partial input gradients, and the
// BF16 conversions of train.activations: bf16 (the activations' rounding points, the pipeline's and
// the expert all-to-all's BF16 messages).
#pragma once

#include <cstdint>

namespace fp8moe::cpu {

// out = a + b over n elements (out may be a or b).
void add(const float* a, const float* b, float* out, int64_t n);

// BF16 bit patterns from FP32, rounded to nearest even (kernels/fp8.h's bf16_encode: a NaN stays a
// quiet NaN, overflow past BF16's largest finite value gives infinity); and back, exactly.
void to_bf16(const float* x, uint16_t* y, int64_t n);
void from_bf16(const uint16_t* x, float* y, int64_t n);
// y = the FP32 value of x rounded to BF16 (y may be x): to_bf16 then from_bf16 without the copy.
void round_bf16(const float* x, float* y, int64_t n);

}  // namespace fp8moe::cpu
