// RoPE (kernels/rope.h): the CPU op against FP64 rotations and finite differences
// (fp64_reference.h), then the op through each device backend against the CPU backend
// (backend_cases.h), forward and inverse, from one token to 512.
#include <gtest/gtest.h>

#include <cmath>
#include <tuple>
#include <vector>

#include "kernels/rope.h"
#include "tests/kernels/backend_cases.h"
#include "tests/kernels/fp64_reference.h"
#include "tests/test_random.h"

namespace fp8moe::test {
namespace {

// ---- the CPU op against FP64 ---------------------------------------------------------------------

DVec rope_ref(const DVec& x, int64_t B, int64_t T, int64_t H, int64_t hd, double theta) {
  DVec y(x);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t i = 0; i < hd / 2; ++i) {
          const int64_t base = ((b * T + t) * H + h) * hd;
          const double a = t / std::pow(theta, 2.0 * i / hd);
          const double x1 = x[base + i], x2 = x[base + i + hd / 2];
          y[base + i] = x1 * std::cos(a) - x2 * std::sin(a);
          y[base + i + hd / 2] = x1 * std::sin(a) + x2 * std::cos(a);
        }
  return y;
}

TEST(Ops, RopeForwardAndBackward) {
  const int64_t B = 2, T = 9, H = 3, hd = 8;
  const double theta = 10000.0;
  const Vec x = random_vec(B * T * H * hd, 4), r = random_vec(B * T * H * hd, 5);
  Vec y = x;
  cpu::rope(y.data(), B, T, H, hd, theta, false);
  expect_close(y, rope_ref(to_double(x), B, T, H, hd, theta), 1e-5, "y");
  Vec dx = r;  // backward of y = R x is R^T r = rotation by -angle
  cpu::rope(dx.data(), B, T, H, hd, theta, true);
  expect_close(dx, numeric_grad([&](const DVec& v) { return rope_ref(v, B, T, H, hd, theta); }, to_double(x), r), 5e-5, "dx");
}

// ---- each device backend against the CPU backend ------------------------------------------------

TEST_P(DeviceOps, RopeMatchesCpuBitwise) {
  for (auto [B, T, heads, hd] : {std::tuple<int64_t, int64_t, int64_t, int64_t>{1, 1, 1, 2}, {2, 17, 3, 64}, {4, 512, 8, 128}, {0, 4, 2, 8}}) {
    for (bool inverse : {false, true}) {
      SCOPED_TRACE(testing::Message() << "B" << B << " T" << T << " heads " << heads << " hd " << hd << (inverse ? " inverse" : ""));
      const auto x = normal_vector(B * T * heads * hd, 5 + T);
      std::vector<float> cs(static_cast<size_t>(T * hd / 2)), sn(cs.size());
      cpu::rope_table(T, hd, 10000.0, inverse, cs.data(), sn.data());
      auto [c, g] = both([&](Backend& be) {
        Tensor gx = up(be, x), gc = up(be, cs), gs = up(be, sn);
        be.rope(gx.f32(), B, T, heads, hd, gc.f32(), gs.f32());
        expect_unchanged(gc, cs, "cos table");
        expect_unchanged(gs, sn, "sin table");
        return down<float>(gx);
      });
      // Against the op from theta (its own table), which the FP64 test above checks.
      std::vector<float> ref = x;
      cpu::rope(ref.data(), B, T, heads, hd, 10000.0, inverse);
      expect_bitwise(c, ref, "cpu backend vs cpu::rope");
      if (B * heads * hd > 0 && T > 1) {
        EXPECT_NE(ref, x) << "the rotation changed x (position 0 is the identity)";
      }
      expect_bitwise(g, c, "rope");
    }
  }
}

}  // namespace
}  // namespace fp8moe::test
