#include "kernels/rope.h"

#include <cmath>
#include <vector>

#include "kernels/check.h"
#include "kernels/cpu/vmath.h"  // FP8MOE_SIMD_CLONES

namespace fp8moe::cpu {

namespace {
// The heads of one token row by one position's table: the halves [0, half) and [half, 2 half) of
// each head are distinct memory, which lets the pairs rotate a vector at a time.
FP8MOE_SIMD_CLONES void rotate_row(float* x, int64_t heads, int64_t head_stride, int64_t half,
                                   const float* __restrict c, const float* __restrict s) {
  for (int64_t h = 0; h < heads; ++h) {
    float* __restrict lo = x + h * head_stride;
    float* __restrict hi = lo + half;
    for (int64_t i = 0; i < half; ++i) rope_rotate(&lo[i], &hi[i], c[i], s[i]);
  }
}
}  // namespace

void rope_table(int64_t T, int64_t hd, double theta, bool inverse, float* cs, float* sn) {
  const int64_t half = hd / 2;
  // Angles in double: t * theta^(-2i / hd) for every position and pair.
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < half; ++i) {
      const double a = double(t) * std::pow(theta, -2.0 * double(i) / double(hd));
      cs[t * half + i] = float(std::cos(a));
      sn[t * half + i] = float(inverse ? -std::sin(a) : std::sin(a));
    }
}

void rope(float* x, int64_t B, int64_t T, int64_t heads, int64_t hd, const float* cs, const float* sn,
          int64_t head_stride) {
  FP8MOE_ASSERT(hd % 2 == 0, "rope needs an even head_dim, got ", hd);
  FP8MOE_ASSERT(head_stride >= hd, "rope: head stride ", head_stride, " below the rotated size ", hd);
  const int64_t half = hd / 2;
#pragma omp parallel for schedule(static)
  for (int64_t row = 0; row < B * T; ++row) {
    const int64_t t = row % T;
    rotate_row(x + row * heads * head_stride, heads, head_stride, half, cs + t * half, sn + t * half);
  }
}

void rope(float* x, int64_t B, int64_t T, int64_t heads, int64_t hd, double theta, bool inverse) {
  FP8MOE_ASSERT(hd % 2 == 0, "rope needs an even head_dim, got ", hd);
  std::vector<float> cs(size_t(T * (hd / 2))), sn(cs.size());
  rope_table(T, hd, theta, inverse, cs.data(), sn.data());
  rope(x, B, T, heads, hd, cs.data(), sn.data(), hd);
}

}  // namespace fp8moe::cpu
