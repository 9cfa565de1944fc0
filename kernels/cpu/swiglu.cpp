#include "kernels/swiglu.h"

#include <algorithm>
#include <cstdint>

#include "kernels/cpu/fp8_simd.h"
#include "kernels/cpu/vmath.h"

namespace fp8moe::cpu {

namespace {

// Spans of this many elements: exp(-a) into a buffer on the stack (8 KiB, in L1), then the
// element functions over it (so that outputs may be inputs too, as element by element).
constexpr int64_t kSpan = 2048;

FP8MOE_SIMD_CLONES void forward_span(const float* a, const float* b, float* y, int64_t n) {
  float e[kSpan];
  vm::exp_neg(a, e, n);
  for (int64_t i = 0; i < n; ++i) y[i] = swiglu_forward_elem(a[i], b[i], sigmoid_from_exp_neg(e[i]));
}

FP8MOE_SIMD_CLONES void backward_span(const float* a, const float* b, const float* dy, float* da, float* db,
                                      int64_t n) {
  float e[kSpan];
  vm::exp_neg(a, e, n);
  for (int64_t i = 0; i < n; ++i) swiglu_backward_elem(a[i], b[i], dy[i], sigmoid_from_exp_neg(e[i]), &da[i], &db[i]);
}

// The gated forms over one row's span: y = g swiglu; the sum of dy swiglu added to *dg in order.
FP8MOE_SIMD_CLONES void gated_forward_span(const float* a, const float* b, float g, float* y, int64_t n) {
  float e[kSpan];
  vm::exp_neg(a, e, n);
  for (int64_t i = 0; i < n; ++i) y[i] = swiglu_gated_forward_elem(a[i], b[i], sigmoid_from_exp_neg(e[i]), g);
}

double gated_backward_span(const float* a, const float* b, float g, const float* dy, float* da, float* db, int64_t n,
                           double dg) {
  float e[kSpan];
  vm::exp_neg(a, e, n);
  for (int64_t i = 0; i < n; ++i) {
    const float s = sigmoid_from_exp_neg(e[i]);
    dg += double(dy[i]) * double(swiglu_forward_elem(a[i], b[i], s));
    swiglu_backward_elem(a[i], b[i], g * dy[i], s, &da[i], &db[i]);
  }
  return dg;
}

// a's and b's n BF16 values from element `at` widened into a32, b32 (exact).
void widen_pair(SimdLevel level, const uint16_t* a, const uint16_t* b, int64_t at, float* a32, float* b32, int64_t n) {
  bf16_to_f32_span(level, a + at, a32, n), bf16_to_f32_span(level, b + at, b32, n);
}

}  // namespace

void swiglu_gated_forward(const float* a, const float* b, int64_t ld, const float* gate, float* y, int64_t rows,
                          int64_t cols) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; c += kSpan)
      gated_forward_span(a + r * ld + c, b + r * ld + c, gate[r], y + r * cols + c, std::min(kSpan, cols - c));
}

void swiglu_gated_backward(const float* a, const float* b, int64_t ld, const float* gate, const float* dy, float* da,
                           float* db, double* dgate, int64_t rows, int64_t cols) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    double dg = 0;
    for (int64_t c = 0; c < cols; c += kSpan)
      dg = gated_backward_span(a + r * ld + c, b + r * ld + c, gate[r], dy + r * cols + c, da + r * ld + c,
                               db + r * ld + c, std::min(kSpan, cols - c), dg);
    dgate[r] = dg;
  }
}

void swiglu_forward_bf16(const uint16_t* a, const uint16_t* b, int64_t ld, const float* gate, float* y, int64_t rows,
                         int64_t cols) {
  // As swiglu_backward_bf16: row by row in spans, a and b widened into buffers on the stack.
  const SimdLevel level = cpu_simd_level();
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    float a32[kSpan], b32[kSpan];
    for (int64_t c = 0; c < cols; c += kSpan) {
      const int64_t n = std::min(kSpan, cols - c);
      widen_pair(level, a, b, r * ld + c, a32, b32, n);
      if (gate)
        gated_forward_span(a32, b32, gate[r], y + r * cols + c, n);
      else
        forward_span(a32, b32, y + r * cols + c, n);
    }
  }
}

void swiglu_backward_bf16(const uint16_t* a, const uint16_t* b, int64_t ld, const float* gate, const float* dy,
                          float* da, float* db, double* dgate, int64_t rows, int64_t cols) {
  // Row by row in spans (the FP32 forms' element functions, whose results do not depend on where a
  // span starts), a and b widened into buffers on the stack.
  const SimdLevel level = cpu_simd_level();
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    float a32[kSpan], b32[kSpan];
    double dg = 0;
    for (int64_t c = 0; c < cols; c += kSpan) {
      const int64_t n = std::min(kSpan, cols - c);
      widen_pair(level, a, b, r * ld + c, a32, b32, n);
      if (gate)
        dg = gated_backward_span(a32, b32, gate[r], dy + r * cols + c, da + r * ld + c, db + r * ld + c, n, dg);
      else
        backward_span(a32, b32, dy + r * cols + c, da + r * ld + c, db + r * ld + c, n);
    }
    if (gate) dgate[r] = dg;
  }
}

void swiglu_forward(const float* a, const float* b, int64_t ld, float* y, int64_t rows, int64_t cols) {
  if (ld == cols) {  // contiguous: spans of the flat array (rows may be 1)
    const int64_t n = rows * cols;
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; i += kSpan) forward_span(a + i, b + i, y + i, std::min(kSpan, n - i));
    return;
  }
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; c += kSpan)
      forward_span(a + r * ld + c, b + r * ld + c, y + r * cols + c, std::min(kSpan, cols - c));
}

void swiglu_backward(const float* a, const float* b, int64_t ld, const float* dy, float* da, float* db, int64_t rows,
                     int64_t cols) {
  if (ld == cols) {
    const int64_t n = rows * cols;
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; i += kSpan) backward_span(a + i, b + i, dy + i, da + i, db + i, std::min(kSpan, n - i));
    return;
  }
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; c += kSpan)
      backward_span(a + r * ld + c, b + r * ld + c, dy + r * cols + c, da + r * ld + c, db + r * ld + c,
                    std::min(kSpan, cols - c));
}

}  // namespace fp8moe::cpu
