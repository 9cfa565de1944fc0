#include "kernels/swiglu.h"

#include <algorithm>

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

}  // namespace

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
