// Element-wise arithmetic: kernels/elem.h's rounding contract (what the CPU ops and the CUDA
// kernels that share it rely on), and the residual add (kernels/elementwise.h) through each device
// backend against the CPU backend (backend_cases.h), in place too. Then Backend::copy_2d, the
// pitched copy, against a loop written here on every backend.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <tuple>
#include <utility>
#include <vector>

#include "kernels/elem.h"
#include "kernels/elementwise.h"
#include "tests/kernels/bf16_reference.h"
#include "tests/kernels/backend_cases.h"
#include "tests/test_random.h"

namespace fp8moe::test {
namespace {

// kernels/elem.h's contract: on the host, mul_rn then add_rn round twice, as the device
// intrinsics do. With a = b = 1 + 2^-12, a * b = 1 + 2^-11 + 2^-24 rounds (half-way, to even) to
// 1 + 2^-11, so adding c = -(1 + 2^-11) gives 0; a fused multiply-add (what GCC makes of it on a
// host with FMA unless -ffp-contract=off) gives 2^-24. volatile keeps the compiler from folding it.
TEST(ElemRounding, MultiplyAndAddRoundSeparately) {
  volatile float a = 1.0f + std::ldexp(1.0f, -12), c = -(1.0f + std::ldexp(1.0f, -11));
  const float x = a, y = a, z = c;
  EXPECT_EQ(add_rn(mul_rn(x, y), z), 0.0f);
  EXPECT_EQ(x * y + z, 0.0f);  // the plain operators of the CPU ops and the tests' references
  EXPECT_EQ(std::fma(x, y, z), std::ldexp(1.0f, -24));  // the case is one where fusing shows
}

// The sum of two floats is exact in FP64 and rounds once to FP32: the CPU op is the FP64 sum rounded.
TEST_P(DeviceOps, ElementwiseAddMatchesCpuBitwise) {
  for (int64_t n : {int64_t(0), int64_t(1), int64_t(1000), int64_t(1 << 20) + 3}) {
    SCOPED_TRACE(n);
    const auto a = normal_vector(n, 1 + n), b = normal_vector(n, 2 + n);
    auto [c, g] = both([&](Backend& be) {
      Tensor ga = up(be, a), gb = up(be, b), out = poisoned(be, DType::f32, n);
      be.add(ga.f32(), gb.f32(), out.f32(), n);
      expect_unchanged(gb, b, "b");
      be.add(ga.f32(), out.f32(), ga.f32(), n);  // in place: a + (a + b)
      return std::make_pair(down<float>(out), down<float>(ga));
    });
    std::vector<float> sum(static_cast<size_t>(n)), again(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      sum[i] = float(double(a[i]) + double(b[i]));
      again[i] = float(double(a[i]) + double(sum[i]));
    }
    expect_bitwise(c.first, sum, "cpu backend a + b vs the rounded FP64 sum");
    expect_bitwise(c.second, again, "cpu backend a += out vs the rounded FP64 sum");
    expect_bitwise(g.first, c.first, "a + b");
    expect_bitwise(g.second, c.second, "a += out");
  }
}

// ---- BF16 (train.activations: bf16) -------------------------------------------------------------

TEST_P(DeviceOps, Bf16ConversionsRoundToNearestEven) {
  // Random values over many binades, the half-way cases either way, the largest values, subnormals,
  // infinities, NaN and signed zeros.
  std::vector<float> x = normal_vector(4099, 71);
  for (size_t i = 0; i < x.size(); i += 3) x[i] = std::ldexp(x[i], int(i % 200) - 100);
  auto bits = [](uint32_t u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  };
  for (uint32_t u : {0x3F808000u, 0x3F818000u, 0xBF808000u, 0x3F808001u, 0x7F7FFFFFu, 0x7F7F8000u, 0x7F7F7FFFu,
                     0x00000001u, 0x00008000u, 0x00018000u, 0x7F800000u, 0xFF800000u, 0x7FC00000u, 0x7F800001u,
                     0x80000000u, 0x00000000u})
    x.push_back(bits(u));
  const int64_t n = int64_t(x.size());
  std::vector<uint16_t> want(x.size());
  std::vector<float> want_f(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    want[i] = nearest_bf16(x[i]);
    want_f[i] = bits(uint32_t(want[i]) << 16);
  }
  auto [c, g] = both([&](Backend& be) {
    Tensor gx = up(be, x), y16 = poisoned(be, DType::bf16, n), yf = poisoned(be, DType::f32, n);
    Tensor inplace = up(be, x);
    be.to_bf16(gx.f32(), y16.data<uint16_t>(), n);
    be.from_bf16(y16.data<uint16_t>(), yf.f32(), n);
    be.round_bf16(inplace.f32(), inplace.f32(), n);
    expect_unchanged(gx, x, "x");
    return std::make_tuple(down<uint16_t>(y16), down<float>(yf), down<float>(inplace));
  });
  expect_bitwise(std::get<0>(c), want, "cpu backend to_bf16 vs the nearest BF16");
  expect_bitwise(std::get<1>(c), want_f, "cpu backend from_bf16 vs the nearest BF16's value");
  expect_bitwise(std::get<2>(c), want_f, "cpu backend round_bf16 in place");
  // CUDA's conversion is bf16_encode too: bitwise on both devices.
  expect_bitwise(std::get<0>(g), want, "device to_bf16");
  expect_bitwise(std::get<1>(g), want_f, "device from_bf16");
  expect_bitwise(std::get<2>(g), want_f, "device round_bf16 in place");
  // Nothing to convert is nothing done.
  for (Backend* be : {&cpu(), &dev()}) {
    be->to_bf16(nullptr, nullptr, 0), be->from_bf16(nullptr, nullptr, 0), be->round_bf16(nullptr, nullptr, 0);
  }
}

// ---- the pitched copy (Backend::copy_2d) ---------------------------------------------------------

struct Copy2d {
  int64_t rows, cols, ld_src, ld_dst, src_off, dst_off;  // src_off, dst_off: where the region starts
};

// dst[dst_off + r ld_dst + c] = src[src_off + r ld_src + c] into a destination that starts as
// `before`, through the backend, in its memory; both tensors hold rows * ld + off elements.
std::vector<float> copy_2d_on(Backend& be, const Copy2d& p, const std::vector<float>& src,
                              const std::vector<float>& before) {
  Tensor s = up(be, src), d = up(be, before);
  // An empty tensor is nullptr: the op gets nullptr, not an offset from it.
  be.copy_2d(d.empty() ? d.f32() : d.f32() + p.dst_off, p.ld_dst, s.empty() ? s.f32() : s.f32() + p.src_off,
             p.ld_src, p.rows, p.cols);
  expect_unchanged(s, src, "src");
  return down<float>(d);
}

TEST_P(DeviceOps, Copy2dMatchesAHostLoopBitwise) {
  // Gaps in the destination (its untouched elements must stay), gaps in the source, both dense,
  // MLA's rotary parts out of (rows, heads x 192) into (rows, heads x 64) and back, one element,
  // no rows, no columns.
  for (Copy2d p : {Copy2d{17, 5, 12, 8, 3, 1}, Copy2d{9, 7, 7, 13, 0, 2}, Copy2d{5, 6, 6, 6, 0, 0},
                   Copy2d{64, 64, 192, 64, 128, 0}, Copy2d{64, 64, 64, 192, 0, 128}, Copy2d{1, 1, 1, 1, 0, 0},
                   Copy2d{0, 5, 7, 9, 0, 0}, Copy2d{3, 0, 4, 4, 1, 2}}) {
    SCOPED_TRACE(testing::Message() << p.rows << " x " << p.cols << " from stride " << p.ld_src << " at "
                                    << p.src_off << " to stride " << p.ld_dst << " at " << p.dst_off);
    const int64_t ns = p.rows ? p.src_off + p.rows * p.ld_src : 0, nd = p.rows ? p.dst_off + p.rows * p.ld_dst : 0;
    const auto src = normal_vector(ns, 61 + p.rows), before = normal_vector(nd, 62 + p.cols);
    std::vector<float> want = before;
    for (int64_t r = 0; r < p.rows; ++r)
      for (int64_t c = 0; c < p.cols; ++c) want[p.dst_off + r * p.ld_dst + c] = src[p.src_off + r * p.ld_src + c];
    auto [c, g] = both([&](Backend& be) { return copy_2d_on(be, p, src, before); });
    expect_bitwise(c, want, "cpu backend vs the loop");
    expect_bitwise(g, want, "device vs the loop");
    if (p.rows * p.cols > 0) {
      EXPECT_NE(want, before) << "the copy changed the destination";
    }
  }
}

}  // namespace
}  // namespace fp8moe::test
