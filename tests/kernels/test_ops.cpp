// The transformer ops against independent FP64 references written here as naive loops: forward
// values, and backward against central finite differences of the FP64 forward (h = 1e-6) for a
// random linear functional L = sum(r * y) of the output.
// Bounds, relative to |want| + 1% of the tensor's largest |want| (each check prints its worst):
// measured (2-core VM, 2026-12-01) forward 1.2e-7 (RMSNorm) to 1.9e-6 (attention, T = 12), bound
// 1e-5; backward 1.6e-7 (cross-entropy) to 6.7e-6 (attention dk), bound 5e-5 (was 1e-4). FP32
// rounding of sums over up to a few hundred terms, about 1e-7 to 1e-6 of their size, is what is left.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <functional>
#include <random>
#include <vector>

#include "kernels/elem.h"
#include "kernels/attention.h"
#include "kernels/cross_entropy.h"
#include "kernels/embedding.h"
#include "kernels/rmsnorm.h"
#include "kernels/rope.h"

namespace fp8moe {
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

using Vec = std::vector<float>;
using DVec = std::vector<double>;

Vec random_vec(size_t n, uint64_t seed, float scale = 1.0f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.0f, scale);
  Vec v(n);
  for (float& x : v) x = d(rng);
  return v;
}

DVec to_double(const Vec& v) { return DVec(v.begin(), v.end()); }

double dot(const DVec& a, const Vec& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

// d/dx of sum(r * f(x)) by central differences, for every element of x.
DVec numeric_grad(const std::function<DVec(const DVec&)>& f, DVec x, const Vec& r) {
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
void expect_close(const Vec& got, const DVec& want, double rel, const char* what) {
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

// ---- RMSNorm -----------------------------------------------------------------------------------

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

// ---- RoPE --------------------------------------------------------------------------------------

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

// ---- Attention ---------------------------------------------------------------------------------

struct AttnShape {
  int64_t B, T, H, KVH, hd;
};

// Naive causal GQA attention in FP64, out: (B*T, H, hd).
DVec attention_ref(const DVec& q, const DVec& k, const DVec& v, const AttnShape& s) {
  DVec out(size_t(s.B * s.T * s.H * s.hd), 0.0);
  const int64_t group = s.H / s.KVH;
  for (int64_t b = 0; b < s.B; ++b)
    for (int64_t h = 0; h < s.H; ++h)
      for (int64_t i = 0; i < s.T; ++i) {
        std::vector<double> sc(size_t(i + 1));
        double m = -1e300;
        for (int64_t j = 0; j <= i; ++j) {
          double d = 0;
          for (int64_t e = 0; e < s.hd; ++e)
            d += q[((b * s.T + i) * s.H + h) * s.hd + e] * k[((b * s.T + j) * s.KVH + h / group) * s.hd + e];
          sc[j] = d / std::sqrt(double(s.hd));
          m = std::max(m, sc[j]);
        }
        double z = 0;
        for (double& x : sc) z += (x = std::exp(x - m));
        for (int64_t j = 0; j <= i; ++j)
          for (int64_t e = 0; e < s.hd; ++e)
            out[((b * s.T + i) * s.H + h) * s.hd + e] += sc[j] / z * v[((b * s.T + j) * s.KVH + h / group) * s.hd + e];
      }
  return out;
}

class AttentionTest : public testing::TestWithParam<AttnShape> {};

TEST_P(AttentionTest, ForwardAndBackward) {
  const AttnShape s = GetParam();
  const size_t nq = size_t(s.B * s.T * s.H * s.hd), nk = size_t(s.B * s.T * s.KVH * s.hd);
  const Vec q = random_vec(nq, 6), k = random_vec(nk, 7), v = random_vec(nk, 8), r = random_vec(nq, 9);
  Vec out(nq), lse(size_t(s.B * s.H * s.T)), dq(nq), dk(nk, 123.0f), dv(nk, 123.0f);  // dk, dv are written
  cpu::attention_forward(q.data(), k.data(), v.data(), s.B, s.T, s.H, s.KVH, s.hd, out.data(), lse.data());
  const DVec qd = to_double(q), kd = to_double(k), vd = to_double(v);
  expect_close(out, attention_ref(qd, kd, vd, s), 1e-5, "out");
  cpu::attention_backward(q.data(), k.data(), v.data(), out.data(), lse.data(), r.data(), s.B, s.T, s.H, s.KVH, s.hd,
                          dq.data(), dk.data(), dv.data());
  expect_close(dq, numeric_grad([&](const DVec& x) { return attention_ref(x, kd, vd, s); }, qd, r), 5e-5, "dq");
  expect_close(dk, numeric_grad([&](const DVec& x) { return attention_ref(qd, x, vd, s); }, kd, r), 5e-5, "dk");
  expect_close(dv, numeric_grad([&](const DVec& x) { return attention_ref(qd, kd, x, s); }, vd, r), 5e-5, "dv");
}

INSTANTIATE_TEST_SUITE_P(Shapes, AttentionTest,
                         testing::Values(AttnShape{2, 7, 4, 2, 6},   // grouped-query
                                         AttnShape{1, 5, 3, 3, 4},   // multi-head
                                         AttnShape{2, 1, 2, 1, 4},   // one token
                                         AttnShape{1, 12, 4, 1, 8}));  // multi-query

// ---- Cross-entropy and embedding ---------------------------------------------------------------

TEST(Ops, CrossEntropyValueAndGradient) {
  const int64_t N = 6, V = 11;
  const Vec logits = random_vec(N * V, 10, 3.0f);
  const std::vector<int32_t> targets = {3, 0, -1, 10, 7, -1};  // -1: ignored (padding)
  auto ref = [&](const DVec& l) {
    DVec loss(1, 0.0);
    for (int64_t n = 0; n < N; ++n) {
      if (targets[n] == -1) continue;
      double m = -1e300, z = 0;
      for (int64_t v = 0; v < V; ++v) m = std::max(m, l[n * V + v]);
      for (int64_t v = 0; v < V; ++v) z += std::exp(l[n * V + v] - m);
      loss[0] += m + std::log(z) - l[n * V + targets[n]];
    }
    return loss;
  };
  Vec dl(N * V, 9.0f);
  int64_t count = 0;
  const double loss = cpu::cross_entropy(logits.data(), targets.data(), N, V, -1, 0.25f, dl.data(), &count);
  EXPECT_EQ(count, 4);
  EXPECT_NEAR(loss, ref(to_double(logits))[0], 1e-6 * std::abs(loss));
  DVec want = numeric_grad(ref, to_double(logits), Vec{1.0f});
  for (double& g : want) g *= 0.25;
  expect_close(dl, want, 5e-5, "dlogits");
  // Large logits do not overflow.
  Vec big = logits;
  for (float& x : big) x *= 1000.0f;
  EXPECT_TRUE(std::isfinite(cpu::cross_entropy(big.data(), targets.data(), N, V, -1, 1.0f, nullptr, &count)));
}

TEST(Ops, EmbeddingGatherAndScatterAdd) {
  const int64_t V = 5, D = 3;
  const Vec table = random_vec(V * D, 11);
  const std::vector<int32_t> ids = {4, 0, 4, 2};
  Vec out(ids.size() * D);
  cpu::embedding_forward(table.data(), ids.data(), int64_t(ids.size()), D, 0, V, out.data());
  for (size_t n = 0; n < ids.size(); ++n)
    for (int64_t d = 0; d < D; ++d) EXPECT_EQ(out[n * D + d], table[ids[n] * D + d]);
  Vec dtable(V * D, 1.0f);
  const Vec dout = random_vec(ids.size() * D, 12);
  cpu::embedding_backward(dout.data(), ids.data(), int64_t(ids.size()), D, 0, V, dtable.data());
  for (int64_t d = 0; d < D; ++d) {
    EXPECT_FLOAT_EQ(dtable[4 * D + d], 1.0f + dout[0 * D + d] + dout[2 * D + d]);  // id 4 twice
    EXPECT_FLOAT_EQ(dtable[0 * D + d], 1.0f + dout[1 * D + d]);
    EXPECT_EQ(dtable[1 * D + d], 1.0f);  // unused row untouched
  }
}

}  // namespace
}  // namespace fp8moe
