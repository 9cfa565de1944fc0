// Rotary position embedding (GPT-NeoX / Llama layout), in place, on x: (B*T, heads, hd), position
// t = row % T. The two halves of each head are rotated against each other: for i < hd/2,
//   (x_i, x_{i+hd/2}) <- (x_i cos a - x_{i+hd/2} sin a, x_i sin a + x_{i+hd/2} cos a),
//   a = t * theta^(-2i/hd).
// The inverse rotation (by -a) is the backward of the forward one. The cosines and sines are a
// table (T, hd/2) computed once in double and rounded to FP32 (rope_table): the model builds it
// once and keeps it in device memory, and every backend rotates with the same table, so the CPU
// and the GPU rotate bit-identically.
#pragma once

#include <cstdint>

#include "kernels/elem.h"

namespace fp8moe {

// One rotary pair (x_i, x_{i+hd/2}) by the angle whose cosine and sine are c, s.
FP8MOE_HD inline void rope_rotate(float* lo, float* hi, float c, float s) {
  const float a = *lo, b = *hi;
  *lo = sub_rn(mul_rn(a, c), mul_rn(b, s));
  *hi = add_rn(mul_rn(a, s), mul_rn(b, c));
}

namespace cpu {
// cs, sn: (T, hd/2); the table of the inverse rotation has the sines negated.
void rope_table(int64_t T, int64_t hd, double theta, bool inverse, float* cs, float* sn);
// x rotated in place by the table (cs, sn) of at least T positions.
void rope(float* x, int64_t B, int64_t T, int64_t heads, int64_t hd, const float* cs, const float* sn);
// The same with the table computed here (tests, tools).
void rope(float* x, int64_t B, int64_t T, int64_t heads, int64_t hd, double theta, bool inverse);
}  // namespace cpu

}  // namespace fp8moe
