// The CPU ops' vector math (kernels/cpu/vmath.h): every function on every level this CPU runs,
// against FP64 and extended-precision exponentials (std::exp in double, expl in x87 long double),
// bitwise the same on every level, at lengths around the 16-element chunks, in place and off
// alignment; the sums against long double sums and in their documented lane order.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "kernels/cpu/vmath.h"

namespace fp8moe::test {
namespace {

namespace vm = cpu::vm;

std::vector<vm::Level> supported_levels() {
  std::vector<vm::Level> out;
  for (vm::Level l : vm::kLevels)
    if (vm::supported(l)) out.push_back(l);
  return out;
}

// Runs fn on `level`, then restores the level in use.
template <class Fn>
auto on_level(vm::Level level, Fn&& fn) {
  const vm::Level previous = vm::set_level(level);
  auto r = fn();
  vm::set_level(previous);
  return r;
}

// Normal values of size up to `scale`, and the edges of FP32's exp: overflow, underflow to
// subnormals and to 0, infinities, NaN, signed zeros.
std::vector<float> inputs(int64_t n, uint64_t seed, float scale) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> x(static_cast<size_t>(n));
  for (float& v : x) v = d(rng);
  const float edges[] = {0.0f, -0.0f, 88.72f, 88.73f, 100.0f, -87.0f, -100.0f, -103.9f, -104.0f, -200.0f,
                         std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                         std::numeric_limits<float>::quiet_NaN()};
  for (size_t i = 0; i < std::size(edges) && i < x.size(); ++i) x[(i * 7) % x.size()] = edges[i];
  return x;
}

double float_ulps(float got, double want) {
  if (std::isnan(want)) return std::isnan(got) ? 0.0 : INFINITY;
  if (std::isinf(want) || want > double(std::numeric_limits<float>::max())) return std::isinf(got) ? 0.0 : INFINITY;
  const double ulp = want < double(std::numeric_limits<float>::min()) ? std::ldexp(1.0, -149)
                                                                       : std::ldexp(1.0, std::ilogb(want) - 23);
  return std::abs(double(got) - want) / ulp;
}

double double_ulps(double got, long double want) {
  if (std::isnan(want)) return std::isnan(got) ? 0.0 : INFINITY;
  if (std::isinf(want) || want > (long double)std::numeric_limits<double>::max())
    return std::isinf(got) ? 0.0 : INFINITY;
  const long double ulp = want < (long double)std::numeric_limits<double>::min()
                              ? std::ldexp(1.0L, -1074)
                              : std::ldexp(1.0L, std::ilogb(want) - 52);
  return double(std::abs((long double)got - want) / ulp);
}

// ---- each function against FP64 on every level ---------------------------------------------------

// SLEEF's bound for its u10 functions: 1.0 ulp. Measured (2026-12-04): 0.95 ulp in FP32 over all
// floats in [-104, 89], on the AVX-512, AVX and SSE2 levels.
constexpr double kMaxUlps = 1.0;

TEST(Vmath, Fp32ExponentialsAreWithinOneUlp) {
  // A dense sweep of the finite range (2^20 points) and the edges.
  const int64_t n = (1 << 20) + 13;
  std::vector<float> x(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) x[i] = -104.0f + 193.0f * float(i) / float(n);
  const std::vector<float> edges = inputs(64, 1, 1.0f);
  x.insert(x.end(), edges.begin(), edges.end());
  const float shift = 1.75f;
  for (vm::Level level : supported_levels()) {
    SCOPED_TRACE(vm::to_string(level));
    double worst = 0;
    on_level(level, [&] {
      std::vector<float> y(x.size()), z(x.size());
      vm::exp_sub(x.data(), shift, y.data(), int64_t(x.size()));
      vm::exp_neg(x.data(), z.data(), int64_t(x.size()));
      for (size_t i = 0; i < x.size(); ++i) {
        const double e = float_ulps(y[i], std::exp(double(x[i] - shift)));  // the FP32 difference
        const double en = float_ulps(z[i], std::exp(-double(x[i])));
        EXPECT_LE(e, kMaxUlps) << "exp(" << x[i] << " - " << shift << ") = " << y[i];
        EXPECT_LE(en, kMaxUlps) << "exp(-" << x[i] << ") = " << z[i];
        worst = std::max({worst, e, en});
      }
      return 0;
    });
    std::printf("[ MEASURE  ] %-6s FP32 exp: worst %.3f ulp (bound %.1f)\n", vm::to_string(level), worst, kMaxUlps);
  }
}

TEST(Vmath, DoubleExponentialsAreWithinOneUlp) {
  // Shifts that make the difference inexact in double too (against expl of the double difference).
  const int64_t n = (1 << 18) + 5;
  std::vector<float> x(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) x[i] = -700.0f + 1400.0f * float(i) / float(n);
  const std::vector<float> edges = inputs(64, 2, 1.0f);
  x.insert(x.end(), edges.begin(), edges.end());
  const double shift = 0.1, scale = 0.3;
  for (vm::Level level : supported_levels()) {
    SCOPED_TRACE(vm::to_string(level));
    double worst = 0, worst_scaled = 0;
    on_level(level, [&] {
      std::vector<float> y(x.size());
      std::vector<double> yd(x.size());
      vm::exp_sub_scale_f64(x.data(), shift, scale, y.data(), int64_t(x.size()));
      vm::exp_sub_f64(x.data(), shift, yd.data(), int64_t(x.size()));
      for (size_t i = 0; i < x.size(); ++i) {
        const long double want = std::exp((long double)(double(x[i]) - shift));
        const double e = double_ulps(yd[i], want);
        EXPECT_LE(e, kMaxUlps) << "exp(" << x[i] << " - " << shift << ")";
        // One element's sum is its exponential itself.
        const double s = vm::exp_sub_sum_f64(&x[i], shift, 1);
        EXPECT_EQ(std::memcmp(&s, &yd[i], sizeof s), 0) << s << " vs " << yd[i];
        worst = std::max(worst, e);
        // Rounded once to FP32 from double: within 1 FP32 ulp (half for the rounding, the rest
        // for the double exponential and the product).
        const double es = float_ulps(y[i], double(want * (long double)scale));
        EXPECT_LE(es, 1.0) << scale << " exp(" << x[i] << " - " << shift << ") = " << y[i];
        worst_scaled = std::max(worst_scaled, es);
      }
      return 0;
    });
    std::printf("[ MEASURE  ] %-6s double exp: worst %.3f ulp (bound %.1f); scaled to FP32 %.3f FP32 ulp\n",
                vm::to_string(level), worst, kMaxUlps, worst_scaled);
  }
}

// ---- the same bits on every level -------------------------------------------------------------------

struct AllOutputs {
  std::vector<float> exp_sub, exp_sub_y, exp_neg, scaled;
  std::vector<double> exp_f64, sums, sums_f64;
};

// Every function at every length in [0, 70) and a long one, off alignment (x + 1), and in place.
AllOutputs all_outputs(const std::vector<float>& x) {
  AllOutputs o;
  for (int64_t n = 0; n <= 70; n += n < 40 ? 1 : 15) {
    const float* xs = x.data() + 1;
    std::vector<float> a(static_cast<size_t>(n)), b(a.size()), c(a.size()), d(a.size());
    std::vector<double> e(a.size());
    vm::exp_sub(xs, 0.5f, a.data(), n);
    o.sums.push_back(vm::exp_sub_sum(xs, -0.25f, b.data(), n));
    vm::exp_neg(xs, c.data(), n);
    vm::exp_sub_scale_f64(xs, 0.3, 1.5, d.data(), n);
    vm::exp_sub_f64(xs, -0.7, e.data(), n);
    o.exp_f64.insert(o.exp_f64.end(), e.begin(), e.end());
    o.sums_f64.push_back(vm::exp_sub_sum_f64(xs, 0.3, n));
    o.exp_sub.insert(o.exp_sub.end(), a.begin(), a.end());
    o.exp_sub_y.insert(o.exp_sub_y.end(), b.begin(), b.end());
    o.exp_neg.insert(o.exp_neg.end(), c.begin(), c.end());
    o.scaled.insert(o.scaled.end(), d.begin(), d.end());
  }
  std::vector<float> big(x.begin() + 3, x.end());  // in place
  const int64_t n = int64_t(big.size());
  o.sums.push_back(vm::exp_sub_sum(big.data(), 1.0f, big.data(), n));
  vm::exp_neg(big.data(), big.data(), n);
  o.exp_neg.insert(o.exp_neg.end(), big.begin(), big.end());
  return o;
}

template <class T>
void expect_same_bits(const std::vector<T>& got, const std::vector<T>& want, const char* what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i)
    ASSERT_EQ(std::memcmp(&got[i], &want[i], sizeof(T)), 0)
        << what << " element " << i << ": " << got[i] << " vs " << want[i];
}

TEST(Vmath, EveryLevelGivesTheSameBits) {
  const std::vector<vm::Level> levels = supported_levels();
  ASSERT_GE(levels.size(), 1u);
#if defined(__x86_64__)
  EXPECT_EQ(levels.size() >= 2 ? levels[1] : vm::Level::scalar, vm::Level::sse2) << "SSE2 is part of x86-64";
#endif
  EXPECT_EQ(vm::level(), levels.back()) << "the widest level is the default";
  const std::vector<float> x = inputs(5000, 3, 20.0f);
  const AllOutputs want = on_level(levels.back(), [&] { return all_outputs(x); });
  for (vm::Level level : levels) {
    SCOPED_TRACE(vm::to_string(level));
    const AllOutputs got = on_level(level, [&] { return all_outputs(x); });
    expect_same_bits(got.exp_sub, want.exp_sub, "exp_sub");
    expect_same_bits(got.exp_sub_y, want.exp_sub_y, "exp_sub_sum's y");
    expect_same_bits(got.exp_neg, want.exp_neg, "exp_neg");
    expect_same_bits(got.scaled, want.scaled, "exp_sub_scale_f64");
    expect_same_bits(got.exp_f64, want.exp_f64, "exp_sub_f64");
    expect_same_bits(got.sums, want.sums, "exp_sub_sum");
    expect_same_bits(got.sums_f64, want.sums_f64, "exp_sub_sum_f64");
  }
  std::printf("[ MEASURE  ] levels run here:");
  for (vm::Level level : levels) std::printf(" %s", vm::to_string(level));
  std::printf(" (default %s)\n", vm::to_string(vm::level()));
}

// ---- the sums ---------------------------------------------------------------------------------------

TEST(Vmath, SumsAreTheLaneOrderSumsOfTheExponentials) {
  const std::vector<float> x = inputs(1000, 4, 3.0f);
  for (vm::Level level : supported_levels()) {
    SCOPED_TRACE(vm::to_string(level));
    on_level(level, [&] {
      for (int64_t n : {int64_t(0), int64_t(1), int64_t(15), int64_t(16), int64_t(17), int64_t(257), int64_t(1000)}) {
        SCOPED_TRACE(n);
        // Finite inputs only: NaN and infinities are checked bitwise above.
        std::vector<float> xs(x.begin(), x.begin() + n);
        for (float& v : xs) v = std::isfinite(v) ? std::min(v, 80.0f) : 1.0f;
        std::vector<float> y(static_cast<size_t>(n));
        const double s = vm::exp_sub_sum(xs.data(), 2.0f, y.data(), n);
        // In the documented order: the lane sum of the FP32 exponentials, bit for bit.
        const double lanes = vm::lane_sum(n, [&](int64_t i) { return double(y[i]); });
        EXPECT_EQ(std::memcmp(&s, &lanes, sizeof s), 0) << s << " vs " << lanes;
        // Against the exact sum of the exponentials in long double: the terms' 1-ulp errors.
        long double exact = 0, exact_f64 = 0;
        for (float v : xs) exact += std::exp((long double)(v - 2.0f)), exact_f64 += std::exp((long double)v - 0.5L);
        EXPECT_LE(std::abs((long double)s - exact), 1.2e-7L * exact + 1e-300L);
        const double s64 = vm::exp_sub_sum_f64(xs.data(), 0.5, n);
        EXPECT_LE(std::abs((long double)s64 - exact_f64), 1e-15L * exact_f64 + 1e-300L)
            << s64 << " vs " << double(exact_f64);
      }
      return 0;
    });
  }
}

TEST(Vmath, LaneSumIsExactlyItsOrderAndCloseToTheExactSum) {
  std::mt19937_64 rng(5);
  std::normal_distribution<double> d(1.0, 10.0);
  for (int64_t n : {int64_t(0), int64_t(1), int64_t(16), int64_t(31), int64_t(4099)}) {
    SCOPED_TRACE(n);
    std::vector<double> v(static_cast<size_t>(n));
    for (double& x : v) x = d(rng);
    const double got = vm::lane_sum(n, [&](int64_t i) { return v[i]; });
    // The order of vmath.h, written out: lane l takes l, l + 16, ...; then the lanes pairwise.
    double lanes[16] = {};
    for (int64_t i = 0; i < n; ++i) lanes[i % 16] += v[i];
    for (int w = 8; w >= 1; w /= 2)
      for (int l = 0; l < w; ++l) lanes[l] += lanes[l + w];
    EXPECT_EQ(std::memcmp(&got, &lanes[0], sizeof got), 0) << got << " vs " << lanes[0];
    long double exact = 0, size = 0;
    for (double x : v) exact += x, size += std::abs(x);
    EXPECT_LE(std::abs((long double)got - exact), 1e-15L * size);
  }
  // The order shows in the bits: a serial sum of these terms differs.
  std::vector<double> v(4099);
  for (double& x : v) x = d(rng);
  double serial = 0;
  for (double x : v) serial += x;
  EXPECT_NE(serial, vm::lane_sum(int64_t(v.size()), [&](int64_t i) { return v[i]; }));
}

}  // namespace
}  // namespace fp8moe::test
