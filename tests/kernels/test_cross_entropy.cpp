// Cross-entropy (kernels/cross_entropy.h): the CPU op against an FP64 loss and finite differences
// (fp64_reference.h), then the whole-vocabulary op and the vocabulary-parallel steps (ce_row_max,
// ce_partials, ce_finish over two shards) through each device backend against the CPU backend
// (backend_cases.h), from no rows to DeepSeek-V3's vocabulary, with ignored targets.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

#include "kernels/cross_entropy.h"
#include "tests/kernels/backend_cases.h"
#include "tests/kernels/fp64_reference.h"
#include "tests/kernels/vmath_levels.h"
#include "tests/test_random.h"

namespace fp8moe::test {
namespace {

// ---- the CPU op against FP64 ---------------------------------------------------------------------

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

// The double exponentials (kernels/cpu/vmath.h) on every vector width this CPU has, whole and
// vocabulary-parallel, over rows of 37 logits (two chunks of 16 and a partial one) split 18 + 19.
TEST(Ops, CrossEntropyIsTheSameOnEveryVectorMathLevel) {
  const int64_t N = 9, V = 37, Vl = 18;
  const Vec logits = random_vec(N * V, 20, 4.0f);
  std::vector<int32_t> t(static_cast<size_t>(N));
  for (int64_t n = 0; n < N; ++n) t[n] = n == 4 ? -1 : int32_t((n * 11) % V);
  expect_same_bits_on_every_level(
      [&] {
        Vec dl(N * V), mx(N), dl1(N * (V - Vl));
        int64_t count = 0;
        std::vector<double> all{cpu::cross_entropy(logits.data(), t.data(), N, V, -1, 0.7f, dl.data(), &count)};
        append(all, dl);
        // The second shard's steps on its own logits (the max and the sums as all-reduced: this
        // shard's alone here, which the op does not know).
        Vec shard;
        for (int64_t n = 0; n < N; ++n)
          shard.insert(shard.end(), logits.begin() + n * V + Vl, logits.begin() + (n + 1) * V);
        std::vector<double> se(static_cast<size_t>(N)), tl(se.size());
        cpu::ce_row_max(shard.data(), N, V - Vl, mx.data());
        cpu::ce_partials(shard.data(), t.data(), N, V - Vl, Vl, -1, mx.data(), se.data(), tl.data());
        all.push_back(cpu::ce_finish(shard.data(), t.data(), N, V - Vl, Vl, -1, mx.data(), se.data(), tl.data(), 0.7f,
                                     dl1.data()));
        all.insert(all.end(), se.begin(), se.end());
        append(all, dl1);
        return all;
      },
      "cross-entropy");
}

// ---- each device backend against the CPU backend ------------------------------------------------

std::vector<int32_t> ce_targets(int64_t N, int64_t V) {
  std::vector<int32_t> t(static_cast<size_t>(N));
  for (int64_t n = 0; n < N; ++n) t[n] = n % 5 == 3 ? -1 : int32_t((n * 7919) % V);  // -1: ignored
  return t;
}

TEST_P(DeviceOps, CrossEntropyMatchesCpu) {
  for (auto [N, V] : {std::pair<int64_t, int64_t>{0, 7}, {1, 7}, {100, 1000}, {64, 129280}}) {
    SCOPED_TRACE(testing::Message() << N << "x" << V);
    const auto logits = normal_vector(N * V, 21 + V, 3.0f);
    const auto t = ce_targets(N, V);
    struct Out {
      std::vector<double> loss, loss_only;
      std::vector<float> dl;
    };
    auto [c, g] = both([&](Backend& be) {
      Tensor gl = up(be, logits), gt = up(be, t), gd = poisoned(be, DType::f32, N * V),
             loss = poisoned(be, DType::f64, 1), loss2 = poisoned(be, DType::f64, 1);
      be.cross_entropy(gl.f32(), gt.data<int32_t>(), N, V, -1, 0.5f, gd.f32(), loss.data<double>());
      be.cross_entropy(gl.f32(), gt.data<int32_t>(), N, V, -1, 0.5f, nullptr, loss2.data<double>());  // loss only
      expect_unchanged(gl, logits, "logits");
      expect_unchanged(gt, t, "targets");
      return Out{down<double>(loss), down<double>(loss2), down<float>(gd)};
    });
    // The CPU backend is the CPU kernel.
    std::vector<float> dl = poisoned_f32(N * V);
    int64_t count = 0;
    const double loss = cpu::cross_entropy(logits.data(), t.data(), N, V, -1, 0.5f, dl.data(), &count);
    expect_bitwise(c.loss, std::vector<double>{loss}, "cpu backend loss vs cpu::cross_entropy");
    expect_bitwise(c.loss_only, c.loss, "cpu backend loss without dlogits");
    expect_bitwise(c.dl, dl, "cpu backend dlogits vs cpu::cross_entropy");
    if (exact()) expect_bitwise(g.loss, c.loss, "loss");
    else EXPECT_NEAR(g.loss[0], c.loss[0], 1e-9 * (std::abs(c.loss[0]) + 1));
    EXPECT_EQ(g.loss_only[0], g.loss[0]) << "the loss does not depend on whether dlogits is asked for";
    expect_match(g.dl, c.dl, 1e-6, "dlogits");
  }
}

TEST_P(DeviceOps, VocabParallelCrossEntropyMatchesCpu) {
  // Two vocabulary shards, the all-reduces done on the host between the steps (the tensor-parallel
  // group's job): each step on the same inputs on both backends.
  for (auto [N, V] : {std::pair<int64_t, int64_t>{0, 8}, {1, 8}, {100, 1000}, {64, 129280}}) {
    SCOPED_TRACE(testing::Message() << N << "x" << V);
    const auto logits = normal_vector(N * V, 23 + V, 3.0f);
    const auto t = ce_targets(N, V);
    const int64_t v0s[2] = {0, V / 2}, Vls[2] = {V / 2, V - V / 2};
    std::vector<float> shard[2];
    for (int s = 0; s < 2; ++s)
      for (int64_t n = 0; n < N; ++n)
        shard[s].insert(shard[s].end(), logits.begin() + n * V + v0s[s], logits.begin() + n * V + v0s[s] + Vls[s]);
    std::vector<float> mx(static_cast<size_t>(N), -INFINITY);
    for (int s = 0; s < 2; ++s) {
      auto [c, g] = both([&](Backend& be) {
        Tensor gl = up(be, shard[s]), m = poisoned(be, DType::f32, N);
        be.ce_row_max(gl.f32(), N, Vls[s], m.f32());
        return down<float>(m);
      });
      std::vector<float> ref = poisoned_f32(N);
      cpu::ce_row_max(shard[s].data(), N, Vls[s], ref.data());
      expect_bitwise(c, ref, "cpu backend vs cpu::ce_row_max");
      expect_bitwise(g, c, "ce_row_max");
      for (int64_t n = 0; n < N; ++n) mx[n] = std::max(mx[n], c[n]);
    }
    std::vector<double> se(static_cast<size_t>(N), 0.0), tl(static_cast<size_t>(N), 0.0);
    for (int s = 0; s < 2; ++s) {
      auto [c, g] = both([&](Backend& be) {
        Tensor gl = up(be, shard[s]), gt = up(be, t), gm = up(be, mx), gse = poisoned(be, DType::f64, N),
               gtl = poisoned(be, DType::f64, N);
        be.ce_partials(gl.f32(), gt.data<int32_t>(), N, Vls[s], v0s[s], -1, gm.f32(), gse.data<double>(),
                       gtl.data<double>());
        return std::make_pair(down<double>(gse), down<double>(gtl));
      });
      std::vector<double> rse = poisoned_f64(N), rtl = poisoned_f64(N);
      cpu::ce_partials(shard[s].data(), t.data(), N, Vls[s], v0s[s], -1, mx.data(), rse.data(), rtl.data());
      expect_bitwise(c.first, rse, "cpu backend se vs cpu::ce_partials");
      expect_bitwise(c.second, rtl, "cpu backend tl vs cpu::ce_partials");
      expect_match(g.first, c.first, 1e-11, "se");  // up to 64640 terms: a block tree vs serial
      expect_bitwise(g.second, c.second, "tl");
      for (int64_t n = 0; n < N; ++n) se[n] += c.first[n], tl[n] += c.second[n];
    }
    double total[2] = {0, 0};  // cpu, device
    for (int s = 0; s < 2; ++s) {
      auto [c, g] = both([&](Backend& be) {
        Tensor gl = up(be, shard[s]), gt = up(be, t), gm = up(be, mx), gse = up(be, se), gtl = up(be, tl);
        Tensor gd = poisoned(be, DType::f32, N * Vls[s]), loss = poisoned(be, DType::f64, 1);
        be.ce_finish(gl.f32(), gt.data<int32_t>(), N, Vls[s], v0s[s], -1, gm.f32(), gse.data<double>(),
                     gtl.data<double>(), 0.5f, gd.f32(), loss.data<double>());
        return std::make_pair(down<double>(loss), down<float>(gd));
      });
      std::vector<float> rd = poisoned_f32(N * Vls[s]);
      const double rloss = cpu::ce_finish(shard[s].data(), t.data(), N, Vls[s], v0s[s], -1, mx.data(), se.data(),
                                          tl.data(), 0.5f, rd.data());
      expect_bitwise(c.first, std::vector<double>{rloss}, "cpu backend loss vs cpu::ce_finish");
      expect_bitwise(c.second, rd, "cpu backend dlogits vs cpu::ce_finish");
      if (exact()) expect_bitwise(g.first, c.first, "loss");
      else EXPECT_NEAR(g.first[0], c.first[0], 1e-9 * (std::abs(c.first[0]) + 1));
      expect_match(g.second, c.second, 1e-6, "dlogits");
      if (s == 0) total[0] = c.first[0], total[1] = g.first[0];
    }
    // Every shard's ce_finish returns the whole loss (the rows are the same on every rank).
    auto [c1, g1] = both([&](Backend& be) {
      Tensor gl = up(be, logits), gt = up(be, t), loss = poisoned(be, DType::f64, 1);
      be.cross_entropy(gl.f32(), gt.data<int32_t>(), N, V, -1, 0.5f, nullptr, loss.data<double>());
      return down<double>(loss);
    });
    EXPECT_NEAR(total[0], c1[0], 1e-9 * (std::abs(c1[0]) + 1)) << "vocabulary-parallel vs whole, cpu";
    EXPECT_NEAR(total[1], g1[0], 1e-9 * (std::abs(g1[0]) + 1)) << "vocabulary-parallel vs whole, device";
  }
}

}  // namespace
}  // namespace fp8moe::test
