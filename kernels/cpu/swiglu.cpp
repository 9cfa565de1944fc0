#include "kernels/swiglu.h"

namespace fp8moe::cpu {

void swiglu_forward(const float* a, const float* b, int64_t ld, float* y, int64_t rows, int64_t cols) {
  if (ld == cols) {  // contiguous: one flat loop (rows may be 1)
    const int64_t n = rows * cols;
#pragma omp parallel for simd schedule(static)
    for (int64_t i = 0; i < n; ++i) y[i] = swiglu_forward_elem(a[i], b[i]);
    return;
  }
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const float *ar = a + r * ld, *br = b + r * ld;
    float* yr = y + r * cols;
#pragma omp simd
    for (int64_t c = 0; c < cols; ++c) yr[c] = swiglu_forward_elem(ar[c], br[c]);
  }
}

void swiglu_backward(const float* a, const float* b, int64_t ld, const float* dy, float* da, float* db, int64_t rows,
                     int64_t cols) {
  if (ld == cols) {
    const int64_t n = rows * cols;
#pragma omp parallel for simd schedule(static)
    for (int64_t i = 0; i < n; ++i) swiglu_backward_elem(a[i], b[i], dy[i], &da[i], &db[i]);
    return;
  }
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const float *ar = a + r * ld, *br = b + r * ld, *dyr = dy + r * cols;
    float *dar = da + r * ld, *dbr = db + r * ld;
#pragma omp simd
    for (int64_t c = 0; c < cols; ++c) swiglu_backward_elem(ar[c], br[c], dyr[c], &dar[c], &dbr[c]);
  }
}

}  // namespace fp8moe::cpu
