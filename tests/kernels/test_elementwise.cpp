// Element-wise arithmetic: kernels/elem.h's rounding contract (what the CPU ops and the CUDA
// kernels that share it rely on), and the residual add (kernels/elementwise.h) through each device
// backend against the CPU backend (backend_cases.h), in place too.
#include <gtest/gtest.h>

#include <cmath>
#include <utility>
#include <vector>

#include "kernels/elem.h"
#include "kernels/elementwise.h"
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

}  // namespace
}  // namespace fp8moe::test
