// RMSNorm (kernels/rmsnorm.h): the CPU op against an FP64 loop and finite differences
// (fp64_reference.h), then the op through each device backend against the CPU backend
// (backend_cases.h) at shapes that switch code paths: no rows, one element, D not a multiple of
// a block, DeepSeek-V3's width.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <utility>
#include <vector>

#include "kernels/rmsnorm.h"
#include "tests/kernels/backend_cases.h"
#include "tests/kernels/fp64_reference.h"
#include "tests/test_random.h"

namespace fp8moe::test {
namespace {

// ---- the CPU op against FP64 ---------------------------------------------------------------------

DVec rmsnorm_ref(const DVec& x, const DVec& w, int64_t N, int64_t D, double eps) {
  DVec y(x.size());
  for (int64_t n = 0; n < N; ++n) {
    double ss = 0;
    for (int64_t d = 0; d < D; ++d) ss += x[n * D + d] * x[n * D + d];
    const double r = 1 / std::sqrt(ss / D + eps);
    for (int64_t d = 0; d < D; ++d) y[n * D + d] = x[n * D + d] * r * w[d];
  }
  return y;
}

TEST(Ops, RmsNormForwardAndBackward) {
  const int64_t N = 5, D = 24;
  const float eps = 1e-6f;
  const Vec x = random_vec(N * D, 1), w = random_vec(D, 2), r = random_vec(N * D, 3);
  Vec y(N * D), rstd(N), dx(N * D), dw(D, 0.5f);  // dw accumulates onto 0.5
  cpu::rmsnorm_forward(x.data(), w.data(), N, D, eps, y.data(), rstd.data());
  expect_close(y, rmsnorm_ref(to_double(x), to_double(w), N, D, eps), 1e-5, "y");
  cpu::rmsnorm_backward(x.data(), w.data(), rstd.data(), r.data(), N, D, dx.data(), dw.data());
  const DVec wd = to_double(w), xd = to_double(x);
  expect_close(dx, numeric_grad([&](const DVec& v) { return rmsnorm_ref(v, wd, N, D, eps); }, xd, r), 5e-5, "dx");
  DVec dw_want = numeric_grad([&](const DVec& v) { return rmsnorm_ref(xd, v, N, D, eps); }, wd, r);
  for (double& g : dw_want) g += 0.5;
  expect_close(dw, dw_want, 5e-5, "dw");
}

// dw over several chunks of kRmsNormDwChunk tokens (the last one partial): the FP64 sum, and
// bitwise the documented order (kernels/rmsnorm.h), which the CUDA kernels follow too.
TEST(Ops, RmsNormWeightGradientInChunks) {
  const int64_t N = 2 * kRmsNormDwChunk + 88, D = 40;
  ASSERT_EQ(rmsnorm_dw_chunks(N), 3);
  const Vec x = random_vec(N * D, 11), w = random_vec(D, 12), dy = random_vec(N * D, 13);
  Vec y(N * D), rstd(N), dx(N * D), dw(D, 0.25f);
  cpu::rmsnorm_forward(x.data(), w.data(), N, D, 1e-6f, y.data(), rstd.data());
  cpu::rmsnorm_backward(x.data(), w.data(), rstd.data(), dy.data(), N, D, dx.data(), dw.data());
  DVec exact(D, 0.25);
  Vec ordered(D, 0.25f);
  for (int64_t d = 0; d < D; ++d) {
    for (int64_t n = 0; n < N; ++n) exact[d] += double(dy[n * D + d]) * x[n * D + d] * rstd[n];
    for (int64_t c = 0; c < 3; ++c) {
      float part = 0.0f;
      for (int64_t n = c * kRmsNormDwChunk; n < std::min(N, (c + 1) * kRmsNormDwChunk); ++n)
        part += dy[n * D + d] * x[n * D + d] * rstd[n];
      ordered[d] += part;
    }
  }
  expect_close(dw, exact, 1e-5, "dw vs FP64");
  expect_bitwise(dw, ordered, "dw vs the chunked order");
}

// ---- each device backend against the CPU backend ------------------------------------------------

TEST_P(DeviceOps, RmsNormMatchesCpu) {
  for (auto [N, D] : {std::pair<int64_t, int64_t>{0, 64}, {1, 1}, {37, 300}, {4096, 7168}}) {
    SCOPED_TRACE(testing::Message() << N << "x" << D);
    const auto x = normal_vector(N * D, 1 + N), w = normal_vector(D, 2 + D), dy = normal_vector(N * D, 3 + N);
    const auto dw0 = normal_vector(D, 4);
    struct Out {
      std::vector<float> y, rstd, dx, dw;
    };
    std::vector<float> cpu_rstd;
    auto [c, g] = both([&](Backend& be) {
      Tensor gx = up(be, x), gw = up(be, w), gdy = up(be, dy), gdw = up(be, dw0);
      Tensor y = poisoned(be, DType::f32, N * D), r = poisoned(be, DType::f32, N), dx = poisoned(be, DType::f32, N * D);
      be.rmsnorm_forward(gx.f32(), gw.f32(), N, D, 1e-6f, y.f32(), r.f32());
      Out o{down<float>(y), down<float>(r), {}, {}};
      if (is_cpu(be)) cpu_rstd = o.rstd;
      // The backward from the CPU's rstd on both backends, so that dw can be compared bitwise.
      Tensor rc = up(be, cpu_rstd);
      be.rmsnorm_backward(gx.f32(), gw.f32(), rc.f32(), gdy.f32(), N, D, dx.f32(), gdw.f32());
      o.dx = down<float>(dx), o.dw = down<float>(gdw);
      expect_unchanged(gx, x, "x");
      expect_unchanged(gw, w, "w");
      expect_unchanged(gdy, dy, "dy");
      return o;
    });
    // The CPU backend is the CPU kernel (same pointers, same results).
    std::vector<float> y = poisoned_f32(N * D), rstd = poisoned_f32(N), dx = poisoned_f32(N * D), dw = dw0;
    cpu::rmsnorm_forward(x.data(), w.data(), N, D, 1e-6f, y.data(), rstd.data());
    cpu::rmsnorm_backward(x.data(), w.data(), rstd.data(), dy.data(), N, D, dx.data(), dw.data());
    expect_bitwise(c.y, y, "cpu backend y vs cpu::rmsnorm_forward");
    expect_bitwise(c.rstd, rstd, "cpu backend rstd vs cpu::rmsnorm_forward");
    expect_bitwise(c.dx, dx, "cpu backend dx vs cpu::rmsnorm_backward");
    expect_bitwise(c.dw, dw, "cpu backend dw vs cpu::rmsnorm_backward");
    // CUDA: row sums in double in another order: rstd may differ in its last bit, rarely.
    expect_match(g.y, c.y, 1e-6, "y");
    expect_match(g.rstd, c.rstd, 1e-6, "rstd");
    expect_match(g.dx, c.dx, 1e-5, "dx");
    // dw: the chunked order of kernels/rmsnorm.h on both (bitwise, same rstd).
    expect_bitwise(g.dw, c.dw, "dw");
  }
}

TEST_P(DeviceOps, RmsNormReadsBf16AsWidened) {
  // rmsnorm_forward_bf16 and rmsnorm_backward_bf16 (x kept in BF16, train.activations bf16) against
  // the same backend's FP32 forms on the widened x (BF16 -> FP32 is exact): y, rstd, dx and the
  // accumulated dw bitwise, over several dw chunks. The FP32 forms are checked against FP64 above.
  for (auto [N, D] : {std::pair<int64_t, int64_t>{0, 64}, {1, 1}, {37, 300}, {600, 256}}) {
    SCOPED_TRACE(testing::Message() << N << "x" << D);
    const auto xf = normal_vector(N * D, 5 + N), w = normal_vector(D, 6 + D), dy = normal_vector(N * D, 7 + N);
    const auto dw0 = normal_vector(D, 8), rstd = normal_vector(N, 9);
    std::vector<uint16_t> x16(size_t(N * D));
    std::vector<float> x32(size_t(N * D));
    for (size_t i = 0; i < x16.size(); ++i)
      x16[i] = uint16_t(std::bit_cast<uint32_t>(xf[i]) >> 16), x32[i] = std::bit_cast<float>(uint32_t(x16[i]) << 16);
    both([&](Backend& be) {
      Tensor g16 = up(be, x16), g32 = up(be, x32), gw = up(be, w), gdy = up(be, dy), gr = up(be, rstd);
      Tensor dw16 = up(be, dw0), dw32 = up(be, dw0);
      Tensor dx16 = poisoned(be, DType::f32, N * D), dx32 = poisoned(be, DType::f32, N * D);
      be.rmsnorm_backward_bf16(g16.data<uint16_t>(), gw.f32(), gr.f32(), gdy.f32(), N, D, dx16.f32(), dw16.f32());
      be.rmsnorm_backward(g32.f32(), gw.f32(), gr.f32(), gdy.f32(), N, D, dx32.f32(), dw32.f32());
      Tensor y16 = poisoned(be, DType::f32, N * D), y32 = poisoned(be, DType::f32, N * D);
      Tensor r16 = poisoned(be, DType::f32, N), r32 = poisoned(be, DType::f32, N);
      be.rmsnorm_forward_bf16(g16.data<uint16_t>(), gw.f32(), N, D, 1e-6f, y16.f32(), r16.f32());
      be.rmsnorm_forward(g32.f32(), gw.f32(), N, D, 1e-6f, y32.f32(), r32.f32());
      expect_unchanged(g16, x16, "x");
      expect_bitwise(down<float>(y16), down<float>(y32), "y from BF16 vs from the widened x");
      expect_bitwise(down<float>(r16), down<float>(r32), "rstd from BF16 vs from the widened x");
      expect_bitwise(down<float>(dx16), down<float>(dx32), "dx from BF16 vs from the widened x");
      expect_bitwise(down<float>(dw16), down<float>(dw32), "dw from BF16 vs from the widened x");
      return 0;
    });
  }
}

}  // namespace
}  // namespace fp8moe::test
