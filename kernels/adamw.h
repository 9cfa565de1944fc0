// AdamW on FP32 master weights (FP32 or BF16 moments), and the gradient's sum of squares that the
// global norm, the finite check and clipping come from (model/optimizer.h). The gradient's unscale
// (1 / (micro-batches x loss scale)) and the clip factor are applied inside both, so the gradient
// is read once per pass and never rewritten.
#pragma once

#include <cstdint>

#include "kernels/elem.h"

namespace fp8moe {

// One AdamW element (decoupled weight decay, bias-corrected moments):
//   g' = (g * unscale) * clip; m = b1 m + (1 - b1) g'; v = b2 v + (1 - b2) g'^2;
//   w = w decay - lr (m / bc1) / (sqrt(v / bc2) + eps)
struct AdamWStep {
  float b1, b2, bc1, bc2, lr, eps, decay, clip;
  float unscale = 1.0f;
};
FP8MOE_HD inline void adamw_elem(const AdamWStep& h, float* w, float* m, float* v, float g) {
  const float gr = mul_rn(mul_rn(g, h.unscale), h.clip);
  *m = add_rn(mul_rn(h.b1, *m), mul_rn(sub_rn(1.0f, h.b1), gr));
  *v = add_rn(mul_rn(h.b2, *v), mul_rn(mul_rn(sub_rn(1.0f, h.b2), gr), gr));
  const float denom = add_rn(sqrt_rn(div_rn(*v, h.bc2)), h.eps);
  *w = sub_rn(mul_rn(*w, h.decay), div_rn(mul_rn(h.lr, div_rn(*m, h.bc1)), denom));
}

namespace cpu {
// Moments FP32 (m, v) or BF16 bits (m16, v16; the others null), n elements.
void adamw(const AdamWStep& h, float* w, const float* g, float* m, float* v, uint16_t* m16, uint16_t* v16, int64_t n);
// sum of (g * unscale)^2 in double: partial sums of fixed chunks of 2^14 (each in kernels/cpu/vmath.h's
// 16-lane order), added in order (the same bits for any thread count and vector width).
double sum_squares(const float* g, int64_t n, float unscale);
// x[0] + x[1] + ... in order.
double sum(const double* x, int64_t n);
}  // namespace cpu

}  // namespace fp8moe
