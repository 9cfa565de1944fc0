// Rotary position embedding (GPT-NeoX / Llama layout), in place, on hd elements of each of the
// `heads` heads of every token row, position t = row % T. Head h of row r starts at
// x + (r heads + h) head_stride, head_stride >= hd: head_stride = hd is x (B*T, heads, hd), the
// whole of each head; a larger stride rotates a part of each head and leaves the rest as it is
// (DeepSeek-V3's multi-head latent attention rotates the last qk_rope elements of each query head
// of (B*T, heads, qk_nope + qk_rope): x = q + qk_nope, hd = qk_rope, head_stride = qk_nope +
// qk_rope). The two halves of the rotated part are rotated against each other: for i < hd/2,
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
// x rotated in place by the table (cs, sn) of at least T positions; heads head_stride apart.
void rope(float* x, int64_t B, int64_t T, int64_t heads, int64_t hd, const float* cs, const float* sn,
          int64_t head_stride);
// The same with the table computed here, on contiguous heads (head_stride = hd; tests, tools).
void rope(float* x, int64_t B, int64_t T, int64_t heads, int64_t hd, double theta, bool inverse);
}  // namespace cpu

}  // namespace fp8moe
