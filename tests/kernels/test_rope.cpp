// RoPE (kernels/rope.h): the CPU op against FP64 rotations and finite differences
// (fp64_reference.h), then the op through each device backend against the CPU backend
// (backend_cases.h), forward and inverse, from one token to 512. Then RoPE on a strided part of
// each head (MLA's rotary query part): the contiguous op applied to a copy of that part, the rest
// of every head untouched, on the CPU and on each device backend.
#include <gtest/gtest.h>

#include <cmath>
#include <ostream>
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
        be.rope(gx.f32(), B, T, heads, hd, gc.f32(), gs.f32(), hd);
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

// ---- a strided part of each head -----------------------------------------------------------------

// (B*T, heads, stride) rows; hd elements of each head rotated, starting `off` into the head.
struct StridedRope {
  int64_t B, T, heads, off, hd, stride;
};
std::ostream& operator<<(std::ostream& os, const StridedRope& r) {
  return os << "B " << r.B << " T " << r.T << " heads " << r.heads << " rotated " << r.hd << " at " << r.off
            << " of " << r.stride;
}

// What the strided op must give: the rotated parts copied out, rotated by the contiguous op (the
// FP64 test above checks it), and copied back; every other element as it was.
std::vector<float> strided_rope_expected(const StridedRope& r, const std::vector<float>& x, bool inverse) {
  const int64_t heads = r.B * r.T * r.heads;
  std::vector<float> part(size_t(heads * r.hd)), y = x;
  for (int64_t i = 0; i < heads; ++i)
    for (int64_t e = 0; e < r.hd; ++e) part[i * r.hd + e] = x[i * r.stride + r.off + e];
  cpu::rope(part.data(), r.B, r.T, r.heads, r.hd, 10000.0, inverse);
  for (int64_t i = 0; i < heads; ++i)
    for (int64_t e = 0; e < r.hd; ++e) y[i * r.stride + r.off + e] = part[i * r.hd + e];
  return y;
}

// MLA's query (128 position-free then 64 rotary elements), a rotated part with elements on both
// sides, the whole head (stride = hd), one token, no batch.
const std::vector<StridedRope>& strided_shapes() {
  static const std::vector<StridedRope> shapes{
      {2, 17, 3, 128, 64, 192}, {1, 9, 2, 3, 4, 12}, {2, 5, 4, 0, 8, 8}, {1, 1, 2, 6, 2, 8}, {0, 4, 2, 6, 4, 10}};
  return shapes;
}

TEST(Ops, RopeOnAStridedPartOfEachHead) {
  for (const StridedRope& r : strided_shapes())
    for (bool inverse : {false, true}) {
      SCOPED_TRACE(testing::Message() << r << (inverse ? " inverse" : ""));
      const auto x = normal_vector(r.B * r.T * r.heads * r.stride, 70 + r.T);
      std::vector<float> cs(size_t(r.T * r.hd / 2)), sn(cs.size()), y = x;
      cpu::rope_table(r.T, r.hd, 10000.0, inverse, cs.data(), sn.data());
      if (!y.empty()) cpu::rope(y.data() + r.off, r.B, r.T, r.heads, r.hd, cs.data(), sn.data(), r.stride);
      const std::vector<float> want = strided_rope_expected(r, x, inverse);
      expect_bitwise(y, want, "strided rope vs the contiguous rope of the rotated parts");
      if (r.B * r.T > 1) {
        EXPECT_NE(want, x) << "the rotation changed x (position 0 is the identity)";
      }
    }
}

TEST_P(DeviceOps, RopeOnAStridedPartMatchesCpuBitwise) {
  for (const StridedRope& r : strided_shapes())
    for (bool inverse : {false, true}) {
      SCOPED_TRACE(testing::Message() << r << (inverse ? " inverse" : ""));
      const auto x = normal_vector(r.B * r.T * r.heads * r.stride, 80 + r.T);
      std::vector<float> cs(size_t(r.T * r.hd / 2)), sn(cs.size());
      cpu::rope_table(r.T, r.hd, 10000.0, inverse, cs.data(), sn.data());
      auto [c, g] = both([&](Backend& be) {
        Tensor gx = up(be, x), gc = up(be, cs), gs = up(be, sn);
        // An empty tensor is nullptr: the op gets nullptr, not an offset from it.
        be.rope(gx.empty() ? gx.f32() : gx.f32() + r.off, r.B, r.T, r.heads, r.hd, gc.f32(), gs.f32(), r.stride);
        expect_unchanged(gc, cs, "cos table");
        expect_unchanged(gs, sn, "sin table");
        return down<float>(gx);
      });
      expect_bitwise(c, strided_rope_expected(r, x, inverse), "cpu backend vs the contiguous rope of the parts");
      expect_bitwise(g, c, "strided rope");
    }
}

}  // namespace
}  // namespace fp8moe::test
