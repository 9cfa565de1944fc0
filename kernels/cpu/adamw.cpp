#include "kernels/adamw.h"

#include <algorithm>
#include <vector>

#include "kernels/cpu/vmath.h"  // FP8MOE_SIMD_CLONES, lane_sum

namespace fp8moe::cpu {

namespace {

constexpr int64_t kChunk = 1 << 14;

// NOTE: one loop per moment precision, so that each is a straight vector loop (adamw_elem's
// divisions and square root are IEEE operations on every vector width: the same bits as the
// GPU's, tests/kernels/test_adamw.cpp).
FP8MOE_SIMD_CLONES void adamw_span_f32(const AdamWStep& h, float* __restrict w, const float* __restrict g,
                                       float* __restrict m, float* __restrict v, int64_t n) {
  for (int64_t j = 0; j < n; ++j) adamw_elem(h, &w[j], &m[j], &v[j], g[j]);
}

FP8MOE_SIMD_CLONES void adamw_span_bf16(const AdamWStep& h, float* __restrict w, const float* __restrict g,
                                        uint16_t* __restrict m16, uint16_t* __restrict v16, int64_t n) {
  for (int64_t j = 0; j < n; ++j) {
    float mj = bf16_decode(m16[j]), vj = bf16_decode(v16[j]);
    adamw_elem(h, &w[j], &mj, &vj, g[j]);
    m16[j] = bf16_encode(mj), v16[j] = bf16_encode(vj);
  }
}

FP8MOE_SIMD_CLONES double sum_squares_span(const float* g, int64_t n, float unscale) {
  return vm::lane_sum(n, [&](int64_t j) {
    const float x = g[j] * unscale;
    return double(x) * x;
  });
}

}  // namespace

void adamw(const AdamWStep& h, float* w, const float* g, float* m, float* v, uint16_t* m16, uint16_t* v16, int64_t n) {
#pragma omp parallel for schedule(static)
  for (int64_t j = 0; j < n; j += kChunk) {
    const int64_t len = std::min(kChunk, n - j);
    if (m16) adamw_span_bf16(h, w + j, g + j, m16 + j, v16 + j, len);
    else adamw_span_f32(h, w + j, g + j, m + j, v + j, len);
  }
}

double sum_squares(const float* g, int64_t n, float unscale) {
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  std::vector<double> part(static_cast<size_t>(chunks), 0.0);
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < chunks; ++c)
    part[c] = sum_squares_span(g + c * kChunk, std::min(kChunk, n - c * kChunk), unscale);
  double s = 0;
  for (double x : part) s += x;
  return s;
}

double sum(const double* x, int64_t n) {
  double s = 0;
  for (int64_t i = 0; i < n; ++i) s += x[i];
  return s;
}

}  // namespace fp8moe::cpu
