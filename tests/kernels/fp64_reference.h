// What the CPU tests of the transformer ops (test_rmsnorm, test_rope, test_attention,
// test_cross_entropy, test_embedding) share: their independent FP64 references are naive loops
// written in each test file; forward values are compared with them, and backward against central
// finite differences of the FP64 forward (h = 1e-6) for a random linear functional L = sum(r * y)
// of the output.
// Bounds, relative to |want| + 1% of the tensor's largest |want| (each check prints its worst):
// measured (2-core VM, 2026-12-01) forward 1.2e-7 (RMSNorm) to 1.9e-6 (attention, T = 12), bound
// 1e-5; backward 1.6e-7 (cross-entropy) to 6.7e-6 (attention dk), bound 5e-5 (was 1e-4). With value
// head sizes other than the query/key one (measured 2026-12-01, same VM): forward up to 4.6e-6, dq up to
// 1.6e-5 (hd 12, hdv 20), dk 9.6e-6, dv 1.5e-6. FP32 rounding of sums over up to a few hundred
// terms, about 1e-7 to 1e-6 of their size, is what is left. Attention's softmax with FP32
// exponentials (kernels/cpu/vmath.h; they were double) measured (2026-12-04, same VM, all seven
// shapes): forward 2.2e-6, dq 1.3e-5, dk 1.0e-5, dv 2.0e-6, against 3.6e-6, 1.3e-5, 9.2e-6, 3.6e-6
// with double ones in the same build: the bounds hold as they were.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <random>
#include <vector>

namespace fp8moe::test {

using Vec = std::vector<float>;
using DVec = std::vector<double>;

inline Vec random_vec(size_t n, uint64_t seed, float scale = 1.0f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.0f, scale);
  Vec v(n);
  for (float& x : v) x = d(rng);
  return v;
}

inline DVec to_double(const Vec& v) { return DVec(v.begin(), v.end()); }

inline double dot(const DVec& a, const Vec& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

// d/dx of sum(r * f(x)) by central differences, for every element of x.
inline DVec numeric_grad(const std::function<DVec(const DVec&)>& f, DVec x, const Vec& r) {
  DVec g(x.size());
  const double h = 1e-6;
  for (size_t i = 0; i < x.size(); ++i) {
    const double keep = x[i];
    x[i] = keep + h;
    const double up = dot(f(x), r);
    x[i] = keep - h;
    const double down = dot(f(x), r);
    x[i] = keep;
    g[i] = (up - down) / (2 * h);
  }
  return g;
}

// |got - want| <= rel (|want| + 1% of the largest |want|) + 1e-6. NOTE: the absolute 1e-6 covers
// gradients that are exactly 0 (one-token attention), where FP32 rounding of O(1) terms remains.
// Prints the worst relative error (the measure the bounds come from).
inline void expect_close(const Vec& got, const DVec& want, double rel, const char* what) {
  ASSERT_EQ(got.size(), want.size());
  double scale = 0, worst = 0;
  for (double w : want) scale = std::max(scale, std::abs(w));
  for (size_t i = 0; i < got.size(); ++i) {
    const double err = std::abs(got[i] - want[i]), denom = std::abs(want[i]) + 1e-2 * scale;
    worst = std::max(worst, denom > 0 ? err / denom : err);
    ASSERT_NEAR(got[i], want[i], rel * denom + 1e-6) << what << " element " << i;
  }
  std::printf("[ MEASURE  ] %-6s worst |got - want| / (|want| + 1e-2 max|want|) = %.2e (bound %.0e)\n", what, worst, rel);
}

}  // namespace fp8moe::test
