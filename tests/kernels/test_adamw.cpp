// The optimizer's ops (kernels/adamw.h): the AdamW update with FP32 and BF16 moments, the sum of
// squares of the gradient norm and the double sum, through each device backend against the CPU
// backend (backend_cases.h), the sums also against FP64 loops written here. The update's formula,
// clipping and decay exclusions are checked through the optimizer, in tests/model/test_optimizer.cpp
// (AdamW.*).
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "kernels/adamw.h"
#include "kernels/fp8.h"
#include "tests/kernels/backend_cases.h"
#include "tests/test_random.h"

namespace fp8moe::test {
namespace {

TEST_P(DeviceOps, AdamWMatchesCpuBitwise) {
  const int64_t n = (1 << 20) + 3;
  AdamWStep h{0.9f, 0.95f, 0.19f, 0.0975f, 3e-4f, 1e-8f, 0.9999f, 0.7f};
  h.unscale = 1.0f / 24.0f;  // micro-batches x loss scale, applied inside (g is never rewritten)
  for (bool bf16 : {false, true}) {
    SCOPED_TRACE(bf16 ? "BF16 moments" : "FP32 moments");
    const auto w = normal_vector(n, 51), g = normal_vector(n, 52), m0 = normal_vector(n, 53, 0.1f);
    auto v0 = normal_vector(n, 54, 0.1f);
    for (float& x : v0) x = x * x;
    std::vector<uint16_t> m16(static_cast<size_t>(n)), v16(static_cast<size_t>(n));
    for (int64_t j = 0; j < n; ++j) m16[j] = bf16_encode(m0[j]), v16[j] = bf16_encode(v0[j]);
    struct Out {
      std::vector<float> w, m, v;
      std::vector<uint16_t> m16, v16;
    };
    auto [c, gg] = both([&](Backend& be) {
      Tensor gw = up(be, w), ggr = up(be, g), gm = up(be, m0), gv = up(be, v0), gm16 = up(be, m16), gv16 = up(be, v16);
      for (int step = 0; step < 2; ++step) {
        if (bf16)
          be.adamw(h, gw.f32(), ggr.f32(), nullptr, nullptr, gm16.data<uint16_t>(), gv16.data<uint16_t>(), n);
        else
          be.adamw(h, gw.f32(), ggr.f32(), gm.f32(), gv.f32(), nullptr, nullptr, n);
      }
      expect_unchanged(ggr, g, "g");
      // The moments of the other precision are not touched.
      if (bf16) expect_unchanged(gm, m0, "FP32 m"), expect_unchanged(gv, v0, "FP32 v");
      else expect_unchanged(gm16, m16, "BF16 m"), expect_unchanged(gv16, v16, "BF16 v");
      return Out{down<float>(gw), down<float>(gm), down<float>(gv), down<uint16_t>(gm16), down<uint16_t>(gv16)};
    });
    // The CPU backend is the CPU kernel.
    Out ref{w, m0, v0, m16, v16};
    for (int step = 0; step < 2; ++step) {
      if (bf16) cpu::adamw(h, ref.w.data(), g.data(), nullptr, nullptr, ref.m16.data(), ref.v16.data(), n);
      else cpu::adamw(h, ref.w.data(), g.data(), ref.m.data(), ref.v.data(), nullptr, nullptr, n);
    }
    expect_bitwise(c.w, ref.w, "cpu backend w vs cpu::adamw");
    EXPECT_NE(c.w, w) << "the step moved w";
    expect_bitwise(gg.w, c.w, "w");
    if (bf16) {
      expect_bitwise(c.m16, ref.m16, "cpu backend m vs cpu::adamw");
      expect_bitwise(c.v16, ref.v16, "cpu backend v vs cpu::adamw");
      expect_bitwise(gg.m16, c.m16, "m");
      expect_bitwise(gg.v16, c.v16, "v");
    } else {
      expect_bitwise(c.m, ref.m, "cpu backend m vs cpu::adamw");
      expect_bitwise(c.v, ref.v, "cpu backend v vs cpu::adamw");
      expect_bitwise(gg.m, c.m, "m");
      expect_bitwise(gg.v, c.v, "v");
    }
  }
}

TEST_P(DeviceOps, SumOfSquaresMatchesDouble) {
  const float unscale = 0.37f;
  for (int64_t n : {int64_t(0), int64_t(1), int64_t(1000), int64_t(1 << 24) + 7}) {
    SCOPED_TRACE(n);
    const auto g = normal_vector(n, 61 + n);
    // NOTE: compensated (Neumaier) summation: a plain serial sum of 2^24 squares in double is off
    // by 1.2e-12 of the result itself (measured), beyond the bound the ops are held to.
    double ref = 0, carry = 0;
    for (float x : g) {
      const float y = x * unscale;  // rounded to FP32 first, then squared in double
      const double sq = double(y) * y, t = ref + sq;
      carry += std::abs(ref) >= std::abs(sq) ? (ref - t) + sq : (sq - t) + ref;
      ref = t;
    }
    ref += carry;
    auto [c, gs] = both([&](Backend& be) {
      Tensor gg = up(be, g), out = poisoned(be, DType::f64, 1);
      be.sum_squares(gg.f32(), n, unscale, out.data<double>());
      return down<double>(out);
    });
    EXPECT_NEAR(c[0], ref, 1e-12 * (ref + 1));
    // CUDA: the chunks of 2^14 in order on both; inside a chunk a block tree on the GPU.
    if (exact()) expect_bitwise(gs, c, "sum of squares");
    else EXPECT_NEAR(gs[0], c[0], 1e-12 * (c[0] + 1));
  }
  // sum: in order on both, bitwise, and the plain loop's.
  for (int64_t n : {int64_t(0), int64_t(1), int64_t(777)}) {
    std::vector<double> x(static_cast<size_t>(n));
    const auto f = normal_vector(n, 71);
    for (int64_t i = 0; i < n; ++i) x[i] = double(f[i]) * 1e3 + 1e-7 * i;
    auto [c, g] = both([&](Backend& be) {
      Tensor gx = up(be, x), out = poisoned(be, DType::f64, 1);
      be.sum(gx.data<double>(), n, out.data<double>());
      return down<double>(out);
    });
    double ref = 0;
    for (double v : x) ref += v;
    expect_bitwise(c, std::vector<double>{ref}, "cpu backend sum vs the loop");
    expect_bitwise(g, c, "sum");
  }
}

}  // namespace
}  // namespace fp8moe::test
