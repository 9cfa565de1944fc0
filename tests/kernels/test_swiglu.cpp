// SwiGLU (kernels/swiglu.h): the CPU op against an FP64 evaluation of the same formulas and
// against finite differences, on fresh random inputs; then the op through each device backend
// against the CPU backend (backend_cases.h), from no elements to 2^22 + 5.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdio>
#include <random>
#include <tuple>
#include <vector>

#include "kernels/swiglu.h"
#include "tests/kernels/backend_cases.h"
#include "tests/kernels/vmath_levels.h"

namespace fp8moe::test {
namespace {

// ---- the CPU op against FP64 ---------------------------------------------------------------------

double sigmoid64(double a) { return 1.0 / (1.0 + std::exp(-a)); }

struct Inputs {
  std::vector<float> a, b, dy;
};

Inputs random_inputs(int64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  Inputs in{std::vector<float>(n), std::vector<float>(n), std::vector<float>(n)};
  for (int64_t i = 0; i < n; ++i) in.a[i] = normal(rng), in.b[i] = normal(rng), in.dy[i] = normal(rng);
  // Edge values of the gate: saturated sigmoid both ways, and zero.
  if (n >= 4) in.a[0] = 0.0f, in.a[1] = 30.0f, in.a[2] = -30.0f, in.a[3] = -100.0f;
  return in;
}

// |x - ref| <= 1e-6 (|ref| + scale): relative error, with an absolute floor of 1e-6 scale. Measured
// (2-core VM, 2026-12-01): at most 9.5e-8 (1.6 FP32 ulps) over 2^20 random elements; the bound, 10x
// that, was 1e-5. Returns the measured |x - ref| / (|ref| + scale).
double expect_close(float x, double ref, double scale, int64_t i) {
  EXPECT_LE(std::abs(double(x) - ref), 1e-6 * (std::abs(ref) + scale)) << "element " << i << ": " << x << " vs " << ref;
  return std::abs(double(x) - ref) / (std::abs(ref) + scale);
}

class SwigluCpu : public testing::TestWithParam<int64_t> {};

TEST_P(SwigluCpu, ForwardAndBackwardMatchFp64) {
  const int64_t n = GetParam();
  const Inputs in = random_inputs(n, 1000 + n);
  std::vector<float> y(n), da(n), db(n);
  cpu::swiglu_forward(in.a.data(), in.b.data(), n, y.data(), 1, n);
  cpu::swiglu_backward(in.a.data(), in.b.data(), n, in.dy.data(), da.data(), db.data(), 1, n);
  double worst = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double a = in.a[i], b = in.b[i], dy = in.dy[i], s = sigmoid64(a);
    const double ref_y = a * s * b;
    const double ref_da = dy * b * s * (1 + a * (1 - s));
    const double ref_db = dy * a * s;
    // Scales bound the cancellation in the products: |a|, |b|, |dy| are O(10).
    worst = std::max({worst, expect_close(y[i], ref_y, std::abs(a * b), i),
                      expect_close(da[i], ref_da, std::abs(dy * b) * (1 + std::abs(a)), i),
                      expect_close(db[i], ref_db, std::abs(dy * a), i)});
  }
  std::printf("[ MEASURE  ] n %lld: worst |x - ref| / (|ref| + scale) = %.2e (bound 1e-6)\n", (long long)n, worst);
}

TEST_P(SwigluCpu, BackwardIsTheDerivativeOfForward) {
  // Central differences in FP64 of the FP32 forward formula's FP64 twin: checks the calculus,
  // independently of the FP32 evaluation above. Measured: at most 3.0e-7 of 1 + |numeric| (the
  // FP32 backward's rounding); bound 3e-6 (was 1e-4).
  const int64_t n = std::min<int64_t>(GetParam(), 64);
  const Inputs in = random_inputs(n, 7 + n);
  std::vector<float> da(n), db(n);
  cpu::swiglu_backward(in.a.data(), in.b.data(), n, in.dy.data(), da.data(), db.data(), 1, n);
  auto f = [](double a, double b) { return a * sigmoid64(a) * b; };
  double worst = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double a = in.a[i], b = in.b[i], dy = in.dy[i], h = 1e-6;
    const double num_da = dy * (f(a + h, b) - f(a - h, b)) / (2 * h);
    const double num_db = dy * (f(a, b + h) - f(a, b - h)) / (2 * h);
    EXPECT_NEAR(da[i], num_da, 3e-6 * (1 + std::abs(num_da))) << i;
    EXPECT_NEAR(db[i], num_db, 3e-6 * (1 + std::abs(num_db))) << i;
    worst = std::max({worst, std::abs(da[i] - num_da) / (1 + std::abs(num_da)), std::abs(db[i] - num_db) / (1 + std::abs(num_db))});
  }
  std::printf("[ MEASURE  ] n %lld: worst |analytic - numeric| / (1 + |numeric|) = %.2e (bound 3e-6)\n", (long long)n, worst);
}

TEST(SwigluGated, ForwardAndBackwardMatchFp64) {
  // train.moe_gates expert: y = g_r silu(a) b per row r; dgate_r = sum_c dy silu(a) b; da, db of
  // g_r dy. Against FP64 over rows of 1, 7 and 3000 columns (two spans), both layouts; and the
  // forward is exactly g_r times the ungated op's FP32 value (the product rounded first). Measured
  // (2-core VM, 2026-12-06): y, da, db within the ungated test's bound; dgate relative error
  // against FP64 at most 1e-7 of the sum of |terms|.
  for (int64_t cols : {int64_t(1), int64_t(7), int64_t(3000)})
    for (int64_t ld : {cols, 2 * cols}) {
      SCOPED_TRACE(testing::Message() << cols << " columns, ld " << ld);
      const int64_t rows = 5;
      const Inputs in = random_inputs(2 * rows * ld, 300 + cols + ld);
      const float* a = in.a.data();
      const float* b = in.b.data() + (ld == cols ? 0 : cols);  // any other layout of the same values
      std::vector<float> gate = {0.25f, 1.0f, 0.0f, 0.8173f, 2.5f}, y(rows * cols), y0(rows * cols), da(rows * ld),
                         db(rows * ld);
      std::vector<double> dgate(rows, -1.0);
      cpu::swiglu_gated_forward(a, b, ld, gate.data(), y.data(), rows, cols);
      cpu::swiglu_forward(a, b, ld, y0.data(), rows, cols);
      cpu::swiglu_gated_backward(a, b, ld, gate.data(), in.dy.data(), da.data(), db.data(), dgate.data(), rows, cols);
      for (int64_t r = 0; r < rows; ++r) {
        double ref_dg = 0, terms = 0;
        for (int64_t c = 0; c < cols; ++c) {
          const int64_t j = r * ld + c, i = r * cols + c;
          const double av = a[j], bv = b[j], g = gate[size_t(r)], dy = in.dy[size_t(i)], s = sigmoid64(av);
          ASSERT_EQ(y[size_t(i)], gate[size_t(r)] * y0[size_t(i)]) << "row " << r << " col " << c;
          expect_close(y[size_t(i)], g * av * s * bv, std::abs(g * av * bv), i);
          expect_close(da[size_t(j)], g * dy * bv * s * (1 + av * (1 - s)), std::abs(g * dy * bv) * (1 + std::abs(av)), i);
          expect_close(db[size_t(j)], g * dy * av * s, std::abs(g * dy * av), i);
          ref_dg += dy * av * s * bv, terms += std::abs(dy * av * s * bv);
        }
        // (FP32 denormals: a = -100 makes silu(a) b about 1e-42, so an absolute floor.)
        EXPECT_LE(std::abs(dgate[size_t(r)] - ref_dg), 1e-6 * terms + 1e-36) << "row " << r;
      }
    }
}

// 0: an expert with no tokens; 1: one element; odd and large sizes switch OpenMP chunking.
INSTANTIATE_TEST_SUITE_P(Sizes, SwigluCpu, testing::Values<int64_t>(0, 1, 7, 1000, (1 << 20) + 3));

// exp(-a) (kernels/cpu/vmath.h) on every vector width this CPU has, both layouts: 3 rows of 37
// (partial chunks of 16 in every row of the strided layout).
TEST(Ops, SwigluIsTheSameOnEveryVectorMathLevel) {
  const int64_t rows = 3, cols = 37;
  const Inputs in = random_inputs(2 * rows * cols, 77);  // the strided layout reads 2 cols per row
  expect_same_bits_on_every_level(
      [&] {
        std::vector<double> all;
        for (int64_t ld : {cols, 2 * cols}) {
          std::vector<float> y(rows * cols), da(2 * rows * cols), db(2 * rows * cols);
          const float* b = in.a.data() + (ld == cols ? rows * cols : cols);
          cpu::swiglu_forward(in.a.data(), b, ld, y.data(), rows, cols);
          cpu::swiglu_backward(in.a.data(), b, ld, in.dy.data(), da.data(), db.data(), rows, cols);
          append(all, y), append(all, da), append(all, db);
        }
        return all;
      },
      "swiglu forward and backward");
}

// ---- each device backend against the CPU backend ------------------------------------------------

// NOTE: the same source (kernels/swiglu.h) runs on both sides, but the device expf differs from
// the CPU's (SLEEF, kernels/cpu/vmath.h) by up to 2 ulp and nvcc fuses multiply-adds (1 + a * (1 - s) cancels near a = -1.28),
// so CUDA's results agree to rounding relative to the size of the terms (`scale`), not bitwise.
// The emulated device runs the CPU kernel: bitwise.
void expect_close_to_terms(bool exact, const std::vector<float>& got, const std::vector<float>& cpu_result,
                           const std::vector<float>& scale, const char* what) {
  if (exact) return expect_bitwise(got, cpu_result, what);
  ASSERT_EQ(got.size(), cpu_result.size());
  for (size_t i = 0; i < got.size(); ++i)
    ASSERT_LE(std::abs(got[i] - cpu_result[i]), 1e-5f * (std::abs(cpu_result[i]) + scale[i])) << what << " element " << i;
}

TEST_P(DeviceOps, SwigluMatchesCpu) {
  // Both layouts of the inputs: two tensors (ld = cols), and the two halves of one fused W1|W3
  // output (ld = 2 cols, b = a + cols), whose gradients go to the same two halves of one buffer.
  // The reference is the CPU kernel on contiguous copies of the halves.
  const std::vector<std::pair<int64_t, int64_t>> shapes = {{0, 8}, {1, 1}, {10, 100}, {1025, 4093}};
  for (auto [rows, cols] : shapes)
    for (bool fused : {false, true}) {
      SCOPED_TRACE(testing::Message() << rows << " x " << cols << (fused ? " fused" : " separate"));
      const int64_t n = rows * cols, ld = fused ? 2 * cols : cols;
      std::mt19937_64 rng(42 + n + fused);
      std::normal_distribution<float> normal(0.0f, 3.0f);
      std::vector<float> a(n), b(n), dy(n);
      for (int64_t i = 0; i < n; ++i) a[i] = normal(rng), b[i] = normal(rng), dy[i] = normal(rng);
      // The device inputs in their layout: fused, row r is [a(r, :) | b(r, :)].
      std::vector<float> ab(size_t(2 * n));
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < cols; ++c)
          ab[size_t(r * ld + c)] = a[size_t(r * cols + c)], ab[size_t(r * ld + c + (fused ? cols : n))] = b[size_t(r * cols + c)];
      auto [c, g] = both([&](Backend& be) {
        Tensor gab = up(be, ab), gdy = up(be, dy), y = poisoned(be, DType::f32, n), dab = poisoned(be, DType::f32, 2 * n);
        const float* pa = gab.f32();
        float* pda = dab.f32();
        // (No elements: no memory, and no pointer into it.)
        const float* pb = n ? pa + (fused ? cols : n) : nullptr;
        float* pdb = n ? pda + (fused ? cols : n) : nullptr;
        be.swiglu_forward(pa, pb, ld, y.f32(), rows, cols);
        be.swiglu_backward(pa, pb, ld, gdy.f32(), pda, pdb, rows, cols);
        expect_unchanged(gab, ab, "a, b");
        expect_unchanged(gdy, dy, "dy");
        // Back to separate (rows, cols) gradients: every element of dab is one of them.
        const std::vector<float> d = down<float>(dab);
        std::vector<float> da(n), db(n);
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t k = 0; k < cols; ++k)
            da[size_t(r * cols + k)] = d[size_t(r * ld + k)], db[size_t(r * cols + k)] = d[size_t(r * ld + k + (fused ? cols : n))];
        return std::make_tuple(down<float>(y), da, db);
      });
      // The CPU backend is the CPU kernel.
      std::vector<float> y = poisoned_f32(n), da = poisoned_f32(n), db = poisoned_f32(n);
      cpu::swiglu_forward(a.data(), b.data(), cols, y.data(), rows, cols);
      cpu::swiglu_backward(a.data(), b.data(), cols, dy.data(), da.data(), db.data(), rows, cols);
      expect_bitwise(std::get<0>(c), y, "cpu backend y vs cpu::swiglu_forward");
      expect_bitwise(std::get<1>(c), da, "cpu backend da vs cpu::swiglu_backward");
      expect_bitwise(std::get<2>(c), db, "cpu backend db vs cpu::swiglu_backward");
      // Term sizes as in the FP64 test above: |a b|, |dy b| (1 + |a|), |dy a|.
      std::vector<float> sy(n), sda(n), sdb(n);
      for (int64_t i = 0; i < n; ++i)
        sy[i] = std::abs(a[i] * b[i]), sda[i] = std::abs(dy[i] * b[i]) * (1 + std::abs(a[i])), sdb[i] = std::abs(dy[i] * a[i]);
      expect_close_to_terms(exact(), std::get<0>(g), std::get<0>(c), sy, "y");
      expect_close_to_terms(exact(), std::get<1>(g), std::get<1>(c), sda, "da");
      expect_close_to_terms(exact(), std::get<2>(g), std::get<2>(c), sdb, "db");
    }
}

// The BF16-input forms' cases: gated and not, the fused and the separate layouts, rows longer than
// the CPU's 2,048-element spans; a and b any BF16 values (ab16) and the same widened (ab32, exact),
// b at off; dy and the rows' gates random. fn(Bf16Case) runs each under its SCOPED_TRACE.
struct Bf16Case {
  int64_t rows, cols, n, ld, off;
  bool gated;
  std::vector<uint16_t> ab16;
  std::vector<float> ab32, dy, gate;
};
template <class Fn>
void for_each_bf16_case(uint64_t seed, Fn&& fn) {
  for (auto [rows, cols] : std::vector<std::pair<int64_t, int64_t>>{{0, 8}, {1, 1}, {33, 100}, {5, 4100}})
    for (bool fused : {false, true})
      for (bool gated : {false, true}) {
        SCOPED_TRACE(testing::Message() << rows << " x " << cols << (fused ? " fused" : " separate")
                                        << (gated ? " gated" : ""));
        const int64_t n = rows * cols;
        Bf16Case k{rows, cols, n, fused ? 2 * cols : cols, fused ? cols : n, gated, std::vector<uint16_t>(size_t(2 * n)),
                   std::vector<float>(size_t(2 * n)), std::vector<float>(size_t(n)), std::vector<float>(size_t(rows))};
        std::mt19937_64 rng(seed + n + 2 * fused + gated);
        std::normal_distribution<float> normal(0.0f, 3.0f);
        std::uniform_real_distribution<float> unit(0.0f, 2.5f);
        for (size_t i = 0; i < k.ab16.size(); ++i) {
          k.ab16[i] = uint16_t(std::bit_cast<uint32_t>(normal(rng)) >> 16);  // any BF16 value
          k.ab32[i] = std::bit_cast<float>(uint32_t(k.ab16[i]) << 16);
        }
        for (float& v : k.dy) v = normal(rng);
        for (float& v : k.gate) v = unit(rng);
        fn(k);
      }
}

TEST_P(DeviceOps, SwigluBackwardReadsBf16AsWidened) {
  // swiglu_backward_bf16 (the pre-activations kept in BF16, train.activations bf16) against the
  // same backend's FP32 backward of the widened values (BF16 -> FP32 is exact): bitwise.
  for_each_bf16_case(11, [&](const Bf16Case& k) {
    const int64_t n = k.n, off = k.off, rows = k.rows, cols = k.cols, ld = k.ld;
    const bool gated = k.gated;
    both([&](Backend& be) {
      Tensor g16 = up(be, k.ab16), g32 = up(be, k.ab32), gdy = up(be, k.dy), gg = up(be, k.gate);
      Tensor d16 = poisoned(be, DType::f32, 2 * n), d32 = poisoned(be, DType::f32, 2 * n);
      Tensor dg16 = poisoned(be, DType::f64, rows), dg32 = poisoned(be, DType::f64, rows);
      const uint16_t* a16 = g16.data<uint16_t>();
      const float* a32 = g32.f32();
      float *p16 = d16.f32(), *p32 = d32.f32();
      be.swiglu_backward_bf16(a16, n ? a16 + off : nullptr, ld, gated ? gg.f32() : nullptr, gdy.f32(), p16,
                              n ? p16 + off : nullptr, gated ? dg16.data<double>() : nullptr, rows, cols);
      if (gated)
        be.swiglu_gated_backward(a32, n ? a32 + off : nullptr, ld, gg.f32(), gdy.f32(), p32, n ? p32 + off : nullptr,
                                 dg32.data<double>(), rows, cols);
      else
        be.swiglu_backward(a32, n ? a32 + off : nullptr, ld, gdy.f32(), p32, n ? p32 + off : nullptr, rows, cols);
      expect_unchanged(g16, k.ab16, "a, b");
      expect_bitwise(down<float>(d16), down<float>(d32), "da, db from BF16 vs from the widened values");
      if (gated) expect_bitwise(down<double>(dg16), down<double>(dg32), "dgate from BF16 vs from the widened values");
      return 0;
    });
  });
}

TEST_P(DeviceOps, SwigluForwardReadsBf16AsWidened) {
  // swiglu_forward_bf16 (a SwiGLU output made again from pre-activations kept in BF16, train.
  // recompute selective) against the same backend's FP32 forward of the widened values (exact):
  // bitwise. The FP32 forward is checked against FP64 above.
  for_each_bf16_case(21, [&](const Bf16Case& k) {
    const int64_t n = k.n, off = k.off, rows = k.rows, cols = k.cols, ld = k.ld;
    auto [c, g] = both([&](Backend& be) {
      Tensor g16 = up(be, k.ab16), g32 = up(be, k.ab32), gg = up(be, k.gate);
      Tensor y16 = poisoned(be, DType::f32, n), y32 = poisoned(be, DType::f32, n);
      const uint16_t* a16 = g16.data<uint16_t>();
      const float* a32 = g32.f32();
      be.swiglu_forward_bf16(a16, n ? a16 + off : nullptr, ld, k.gated ? gg.f32() : nullptr, y16.f32(), rows, cols);
      if (k.gated)
        be.swiglu_gated_forward(a32, n ? a32 + off : nullptr, ld, gg.f32(), y32.f32(), rows, cols);
      else
        be.swiglu_forward(a32, n ? a32 + off : nullptr, ld, y32.f32(), rows, cols);
      expect_unchanged(g16, k.ab16, "a, b");
      expect_bitwise(down<float>(y16), down<float>(y32), "y from BF16 vs from the widened values");
      return down<float>(y16);
    });
    if (n > 0) {
      EXPECT_NE(c, std::vector<float>(size_t(n), 0.0f)) << "something was written";
    }
    (void)g;
  });
}

TEST_P(DeviceOps, SwigluGatedMatchesCpu) {
  // The gated forms on the fused layout (ld = 2 cols) and a separate one, against the CPU backend
  // (emulated: bitwise; CUDA: the ungated test's bounds, dgate within 1e-5 of the row's terms).
  for (auto [rows, cols] : std::vector<std::pair<int64_t, int64_t>>{{0, 8}, {1, 1}, {33, 100}, {257, 2048}})
    for (bool fused : {false, true}) {
      SCOPED_TRACE(testing::Message() << rows << " x " << cols << (fused ? " fused" : " separate"));
      const int64_t n = rows * cols, ld = fused ? 2 * cols : cols;
      std::mt19937_64 rng(7 + n + fused);
      std::normal_distribution<float> normal(0.0f, 3.0f);
      std::uniform_real_distribution<float> unit(0.0f, 2.5f);
      std::vector<float> ab(size_t(2 * n)), dy(n), gate(rows);
      for (float& v : ab) v = normal(rng);
      for (float& v : dy) v = normal(rng);
      for (float& v : gate) v = unit(rng);
      auto [c, g] = both([&](Backend& be) {
        Tensor gab = up(be, ab), gdy = up(be, dy), gg = up(be, gate), y = poisoned(be, DType::f32, n),
               dab = poisoned(be, DType::f32, 2 * n), dgate = poisoned(be, DType::f64, rows);
        const float* pa = gab.f32();
        float* pda = dab.f32();
        const float* pb = n ? pa + (fused ? cols : n) : nullptr;
        float* pdb = n ? pda + (fused ? cols : n) : nullptr;
        be.swiglu_gated_forward(pa, pb, ld, gg.f32(), y.f32(), rows, cols);
        be.swiglu_gated_backward(pa, pb, ld, gg.f32(), gdy.f32(), pda, pdb, dgate.data<double>(), rows, cols);
        expect_unchanged(gab, ab, "a, b");
        expect_unchanged(gg, gate, "gate");
        return std::make_tuple(down<float>(y), down<float>(dab), down<double>(dgate));
      });
      // The CPU backend is the CPU kernel.
      std::vector<float> y = poisoned_f32(n), dab = poisoned_f32(2 * n);
      std::vector<double> dgate(size_t(rows), -1.0);
      const float* b = n ? ab.data() + (fused ? cols : n) : nullptr;
      cpu::swiglu_gated_forward(ab.data(), b, ld, gate.data(), y.data(), rows, cols);
      cpu::swiglu_gated_backward(ab.data(), b, ld, gate.data(), dy.data(), dab.data(), n ? dab.data() + (fused ? cols : n) : nullptr,
                                 dgate.data(), rows, cols);
      expect_bitwise(std::get<0>(c), y, "cpu backend y vs cpu::swiglu_gated_forward");
      expect_bitwise(std::get<1>(c), dab, "cpu backend da, db vs cpu::swiglu_gated_backward");
      expect_bitwise(std::get<2>(c), dgate, "cpu backend dgate vs cpu::swiglu_gated_backward");
      if (exact()) {
        expect_bitwise(std::get<0>(g), std::get<0>(c), "y");
        expect_bitwise(std::get<1>(g), std::get<1>(c), "da, db");
        expect_bitwise(std::get<2>(g), std::get<2>(c), "dgate");
        continue;
      }
      // Term sizes: |g a b| for y; |g dy b| (1 + |a|) and |g dy a| for the gradients; sum |dy a b| for dgate.
      for (int64_t r = 0; r < rows; ++r) {
        double terms = 0;
        for (int64_t k = 0; k < cols; ++k) {
          const int64_t j = r * ld + k, jb = j + (fused ? cols : n), i = r * cols + k;
          const float av = ab[size_t(j)], bv = ab[size_t(jb)], gv = gate[size_t(r)], d = dy[size_t(i)];
          ASSERT_LE(std::abs(std::get<0>(g)[size_t(i)] - y[size_t(i)]), 1e-5f * (std::abs(y[size_t(i)]) + std::abs(gv * av * bv)));
          ASSERT_LE(std::abs(std::get<1>(g)[size_t(j)] - dab[size_t(j)]),
                    1e-5f * (std::abs(dab[size_t(j)]) + std::abs(gv * d * bv) * (1 + std::abs(av))));
          ASSERT_LE(std::abs(std::get<1>(g)[size_t(jb)] - dab[size_t(jb)]), 1e-5f * (std::abs(dab[size_t(jb)]) + std::abs(gv * d * av)));
          terms += std::abs(double(d) * av * bv);
        }
        ASSERT_LE(std::abs(std::get<2>(g)[size_t(r)] - dgate[size_t(r)]), 1e-5 * terms) << "dgate row " << r;
      }
    }
}

}  // namespace
}  // namespace fp8moe::test
