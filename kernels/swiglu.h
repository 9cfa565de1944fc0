// SwiGLU, the gated activation of every dense and expert MLP:  y = silu(a) * b,  silu(a) = a * sigmoid(a).
// a is the gate projection (x W1^T), b the up projection (x W3^T); y goes into W2.
//
// The per-element math is written once here (FP8MOE_HD) and shared by kernels/cpu and kernels/cuda.
// Only the exponential is each backend's own: the device's expf in the forms without s (the CUDA
// kernels call them), and on the CPU SLEEF's, 16 at a time (kernels/cpu/vmath.h), handed in as
// e = exp(-a) or s = sigmoid(a).
#pragma once

#include <cmath>
#include <cstdint>

#include "kernels/hd.h"

namespace fp8moe {

// sigmoid(a) from e = exp(-a).
FP8MOE_HD inline float sigmoid_from_exp_neg(float e) { return 1.0f / (1.0f + e); }
FP8MOE_HD inline float sigmoidf_(float a) { return sigmoid_from_exp_neg(expf(-a)); }

// y = a * sigmoid(a) * b, s = sigmoid(a)
FP8MOE_HD inline float swiglu_forward_elem(float a, float b, float s) { return a * s * b; }
FP8MOE_HD inline float swiglu_forward_elem(float a, float b) { return swiglu_forward_elem(a, b, sigmoidf_(a)); }

// Given dy = dL/dy:  dL/da = dy * b * sigmoid(a) * (1 + a * (1 - sigmoid(a))),  dL/db = dy * silu(a).
FP8MOE_HD inline void swiglu_backward_elem(float a, float b, float dy, float s, float* da, float* db) {
  *da = dy * b * s * (1.0f + a * (1.0f - s));
  *db = dy * a * s;
}
FP8MOE_HD inline void swiglu_backward_elem(float a, float b, float dy, float* da, float* db) {
  swiglu_backward_elem(a, b, dy, sigmoidf_(a), da, db);
}

// The gated forms (train.moe_gates expert, model/moe.h): row r scaled by its routing gate g_r after
// the SwiGLU, y = g_r (silu(a) b), the product silu(a) b rounded first (so y is the FP32 product of
// g_r and swiglu_forward's value). Given dy = dL/dy: dL/dg_r = sum over the row of dy silu(a) b,
// and da, db are swiglu_backward's of g_r dy.
FP8MOE_HD inline float swiglu_gated_forward_elem(float a, float b, float s, float g) {
  return g * swiglu_forward_elem(a, b, s);
}

// Both ops take (rows, cols) matrices. a, b (and da, db) are read (written) with row stride ld >= cols,
// so that they may be the two halves of one fused GEMM output [x W1^T | x W3^T] (ld = 2 cols, b = a +
// cols) as well as two separate tensors (ld = cols). y and dy are contiguous (rows, cols).
namespace cpu {
void swiglu_forward(const float* a, const float* b, int64_t ld, float* y, int64_t rows, int64_t cols);
void swiglu_backward(const float* a, const float* b, int64_t ld, const float* dy, float* da, float* db, int64_t rows,
                     int64_t cols);
// gate (rows); dgate (rows) written, each row's sum in double in column order.
void swiglu_gated_forward(const float* a, const float* b, int64_t ld, const float* gate, float* y, int64_t rows,
                          int64_t cols);
void swiglu_gated_backward(const float* a, const float* b, int64_t ld, const float* gate, const float* dy, float* da,
                           float* db, double* dgate, int64_t rows, int64_t cols);
// a, b in BF16 (gate nullptr: swiglu_forward, swiglu_backward, dgate not written): the FP32 forms'
// bits on the widened values, a span at a time.
void swiglu_forward_bf16(const uint16_t* a, const uint16_t* b, int64_t ld, const float* gate, float* y, int64_t rows,
                         int64_t cols);
void swiglu_backward_bf16(const uint16_t* a, const uint16_t* b, int64_t ld, const float* gate, const float* dy,
                          float* da, float* db, double* dgate, int64_t rows, int64_t cols);
}  // namespace cpu

}  // namespace fp8moe
