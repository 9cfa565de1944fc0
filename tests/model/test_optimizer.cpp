// AdamW against a direct FP64 evaluation of the PyTorch AdamW formulas over several steps, with
// decoupled weight decay and its exclusions, clipping, BF16 moments, and non-finite skipping; the
// learning-rate schedule at its boundaries.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "kernels/backend.h"
#include "model/optimizer.h"

namespace fp8moe {
namespace {

ModelConfig small_model() {
  ModelConfig m;
  m.vocab_size = 8, m.d_model = 4, m.n_layers = 2, m.n_heads = 2, m.n_kv_heads = 1, m.head_dim = 2;
  m.first_dense_layers = 1, m.d_ff_dense = 6;
  m.moe.n_experts = 2, m.moe.top_k = 1, m.moe.n_shared_experts = 0, m.moe.d_expert = 3;
  return m;
}

TrainConfig train_config() {
  TrainConfig t;
  t.lr = 1e-2, t.min_lr = 1e-3, t.warmup_steps = 2, t.steps = 10, t.weight_decay = 0.1, t.beta1 = 0.9;
  t.beta2 = 0.95, t.eps = 1e-8, t.grad_clip = 0.5;
  return t;
}

// AdamW on the CPU backend over a store holding every parameter whole: host vectors in, one step
// (the norm part, read back, then the update), the parameters back in the vectors.
struct Harness {
  std::unique_ptr<Backend> be = make_backend(DeviceKind::cpu);
  ParamTable table;
  std::vector<Shard> shards;
  ParamStore store;
  explicit Harness(const ParamTable& t) : table(t), shards(whole(t)), store(*be, table, shards, 1) {}
  static std::vector<Shard> whole(const ParamTable& t) {
    std::vector<Shard> s;
    for (const ParamSpec& p : t.params) s.push_back({0, p.rows, 0, p.cols});
    return s;
  }
  OptimizerStats step(AdamW& opt, std::vector<std::vector<float>>& params, const std::vector<std::vector<float>>& grads,
                      int64_t step) {
    for (size_t i = 0; i < params.size(); ++i) store.param_from_host(i, params[i]), store.grad_from_host(i, grads[i]);
    Tensor sq(*be, DType::f64, {1});
    opt.grad_sq(store, 1.0f, {}, sq.data<double>());
    const OptimizerStats st = opt.step(store, step, to_host<double>(sq)[0], 1.0f);
    params = store.params_to_host();
    return st;
  }
};

std::vector<std::vector<float>> random_like(const ParamTable& t, uint64_t seed, float scale) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<std::vector<float>> out;
  for (const ParamSpec& p : t.params) {
    out.emplace_back(size_t(p.numel()));
    for (float& x : out.back()) x = d(rng);
  }
  return out;
}

TEST(AdamW, MatchesTheFormulaOverSeveralStepsWithClippingAndDecayExclusions) {
  for (MomentsDtype md : {MomentsDtype::fp32, MomentsDtype::bf16}) {
    const ParamTable table = build_param_table(small_model());
    TrainConfig cfg = train_config();
    cfg.moments_dtype = md;
    Harness h(table);
    AdamW opt(*h.be, table, cfg);
    auto params = random_like(table, 1, 1.0f);
    // Reference state in FP64.
    std::vector<std::vector<double>> p(params.size()), m(params.size()), v(params.size());
    for (size_t i = 0; i < params.size(); ++i) {
      p[i].assign(params[i].begin(), params[i].end());
      m[i].assign(params[i].size(), 0.0);
      v[i].assign(params[i].size(), 0.0);
    }
    double worst = 0;
    for (int64_t step = 0; step < 5; ++step) {
      auto grads = random_like(table, 100 + step, step == 2 ? 0.01f : 1.0f);  // step 2: below the clip
      double sq = 0;
      for (size_t i = 0; i < grads.size(); ++i)
        if (table.params[i].trainable)
          for (float g : grads[i]) sq += double(g) * g;
      const double norm = std::sqrt(sq), c = norm > cfg.grad_clip ? cfg.grad_clip / (norm + 1e-6) : 1.0;
      const double lr = learning_rate(cfg, step);
      for (size_t i = 0; i < p.size(); ++i) {
        if (!table.params[i].trainable) continue;
        for (size_t j = 0; j < p[i].size(); ++j) {
          const double g = grads[i][j] * c;
          if (table.params[i].weight_decay) p[i][j] -= lr * cfg.weight_decay * p[i][j];
          m[i][j] = cfg.beta1 * m[i][j] + (1 - cfg.beta1) * g;
          v[i][j] = cfg.beta2 * v[i][j] + (1 - cfg.beta2) * g * g;
          const double mh = m[i][j] / (1 - std::pow(cfg.beta1, step + 1)), vh = v[i][j] / (1 - std::pow(cfg.beta2, step + 1));
          p[i][j] -= lr * mh / (std::sqrt(vh) + cfg.eps);
          // BF16 moments: this step's update uses the FP32 values; what is stored (and read next
          // step) is their BF16 rounding.
          if (md == MomentsDtype::bf16) m[i][j] = bf16_decode(bf16_encode(float(m[i][j])));
          if (md == MomentsDtype::bf16) v[i][j] = bf16_decode(bf16_encode(float(v[i][j])));
        }
      }
      const OptimizerStats st = h.step(opt, params, grads, step);
      EXPECT_FALSE(st.skipped);
      EXPECT_NEAR(st.grad_norm, norm, 1e-9 * norm);  // both sum squares in double: ~1e-14 apart
      EXPECT_DOUBLE_EQ(st.lr, lr);
      for (size_t i = 0; i < p.size(); ++i)
        for (size_t j = 0; j < p[i].size(); ++j) {
          // FP32 masters against FP64 over 5 steps: measured at most 2.0e-7 of |w| + 1 (~2 FP32
          // ulps of weights of size 1; 2-core VM, 2026-12-01); bound 10x that.
          ASSERT_NEAR(params[i][j], p[i][j], 2e-6 * (std::abs(p[i][j]) + 1)) << table.params[i].name << " step " << step;
          worst = std::max(worst, std::abs(params[i][j] - p[i][j]) / (std::abs(p[i][j]) + 1));
        }
    }
    std::printf("[ MEASURE  ] moments %s: worst |w - w_fp64| / (|w_fp64| + 1) over 5 steps = %.2e\n",
                to_string(md).data(), worst);
    EXPECT_EQ(opt.updates(), 5);
  }
}

TEST(AdamW, WeightDecaySkipsNormsAndTheRouterBias) {
  const ParamTable table = build_param_table(small_model());
  TrainConfig cfg = train_config();
  Harness h(table);
  AdamW opt(*h.be, table, cfg);
  auto params = random_like(table, 2, 1.0f);
  const auto before = params;
  auto zero = random_like(table, 3, 0.0f);  // zero gradients: only decay moves a parameter
  h.step(opt, params, zero, 5);
  const double lr = learning_rate(cfg, 5);
  for (size_t i = 0; i < params.size(); ++i) {
    const ParamSpec& s = table.params[i];
    for (size_t j = 0; j < params[i].size(); ++j) {
      const float want = s.trainable && s.weight_decay ? float(before[i][j] * (1.0 - lr * cfg.weight_decay)) : before[i][j];
      ASSERT_FLOAT_EQ(params[i][j], want) << s.name;
    }
  }
}

TEST(AdamW, NonFiniteGradientsSkipTheStepAndTouchNothing) {
  const ParamTable table = build_param_table(small_model());
  Harness h(table);
  AdamW opt(*h.be, table, train_config());
  auto params = random_like(table, 4, 1.0f);
  auto grads = random_like(table, 5, 1.0f);
  h.step(opt, params, grads, 0);
  const auto params_before = params;
  const auto m_before = opt.first_moment(1), v_before = opt.second_moment(1);
  auto bad = random_like(table, 6, 1.0f);
  bad[3][2] = NAN;
  const OptimizerStats st = h.step(opt, params, bad, 1);
  EXPECT_TRUE(st.skipped);
  EXPECT_EQ(opt.skipped(), 1);
  EXPECT_EQ(opt.updates(), 1);
  EXPECT_EQ(params, params_before);
  EXPECT_EQ(opt.first_moment(1), m_before);
  EXPECT_EQ(opt.second_moment(1), v_before);
  bad[3][2] = INFINITY;
  EXPECT_TRUE(h.step(opt, params, bad, 1).skipped);
  // The next good step is update number 2 for bias correction (not schedule step + 1 = 3).
  const TrainConfig cfg = train_config();
  auto good = random_like(table, 7, 0.001f);  // below the clip
  const auto m1 = opt.first_moment(1), v1 = opt.second_moment(1);
  std::vector<float> want(params[1].size());
  const double lr = learning_rate(cfg, 2);
  for (size_t j = 0; j < want.size(); ++j) {
    const double g = good[1][j];
    const double m = cfg.beta1 * m1[j] + (1 - cfg.beta1) * g, v = cfg.beta2 * v1[j] + (1 - cfg.beta2) * g * g;
    const double mh = m / (1 - cfg.beta1 * cfg.beta1), vh = v / (1 - cfg.beta2 * cfg.beta2);
    const double decay = table.params[1].weight_decay ? 1 - lr * cfg.weight_decay : 1.0;
    want[j] = float(params[1][j] * decay - lr * mh / (std::sqrt(vh) + cfg.eps));
  }
  ASSERT_TRUE(table.params[1].trainable) << table.params[1].name;
  EXPECT_FALSE(h.step(opt, params, good, 2).skipped);
  // One FP32 step from the same state: a few FP32 ulps of weights of size ~1 (1.2e-7 each).
  for (size_t j = 0; j < want.size(); ++j) ASSERT_NEAR(params[1][j], want[j], 1e-6) << j;
}

TEST(AdamW, UnscaleIsTheGradientsDivisorInTheNormAndTheUpdate) {
  // The training loop hands the optimizer the step's summed, loss-scaled gradients and the factor
  // 1 / (micro-batches x loss scale): the norm and the update must be those of the gradients times
  // that factor, bitwise (both round g * unscale to FP32 first). unscale = 1/8 is exact, so the
  // comparison is with gradients divided beforehand.
  const ParamTable table = build_param_table(small_model());
  const TrainConfig cfg = train_config();
  Harness a(table), b(table);
  AdamW opt_a(*a.be, table, cfg), opt_b(*b.be, table, cfg);
  auto pa = random_like(table, 8, 1.0f), pb = pa;
  auto g = random_like(table, 9, 1.0f), g8 = g;
  for (auto& t : g8)
    for (float& x : t) x *= 0.125f;
  for (int64_t step = 0; step < 3; ++step) {
    for (size_t i = 0; i < pa.size(); ++i) a.store.param_from_host(i, pa[i]), a.store.grad_from_host(i, g[i]);
    Tensor sq(*a.be, DType::f64, {1});
    opt_a.grad_sq(a.store, 0.125f, {}, sq.data<double>());
    const OptimizerStats sa = opt_a.step(a.store, step, to_host<double>(sq)[0], 0.125f);
    pa = a.store.params_to_host();
    const OptimizerStats sb = b.step(opt_b, pb, g8, step);
    EXPECT_EQ(sa.grad_norm, sb.grad_norm) << "step " << step;
    ASSERT_EQ(pa, pb) << "step " << step;
  }
}

TEST(LossScaler, NoneFixedAndDynamic) {
  TrainConfig t = train_config();
  EXPECT_EQ(LossScaler(t).scale(), 1.0f);  // none
  t.loss_scale = {LossScaleMode::fixed, 1024.0};
  LossScaler fixed(t);
  fixed.update(false);
  EXPECT_EQ(fixed.scale(), 1024.0f);  // a fixed scale never moves
  t.loss_scale = {LossScaleMode::dynamic, 1.0};
  t.loss_scale_initial = 65536, t.loss_scale_growth_interval = 3, t.loss_scale_growth = 2, t.loss_scale_backoff = 0.5;
  LossScaler d(t);
  EXPECT_EQ(d.scale(), 65536.0f);
  d.update(true), d.update(true);
  EXPECT_EQ(d.scale(), 65536.0f);
  d.update(true);  // third finite step in a row: grow
  EXPECT_EQ(d.scale(), 131072.0f);
  d.update(true), d.update(true);
  d.update(false);  // overflow: back off, and the run of finite steps starts again
  EXPECT_EQ(d.scale(), 65536.0f);
  d.update(true), d.update(true);
  EXPECT_EQ(d.scale(), 65536.0f);
  d.update(true);
  EXPECT_EQ(d.scale(), 131072.0f);
}

TEST(Schedule, ValuesAtTheBoundaries) {
  TrainConfig t = train_config();  // lr 1e-2, min 1e-3, warmup 2, 10 steps
  EXPECT_DOUBLE_EQ(learning_rate(t, 0), 0.5e-2);
  EXPECT_DOUBLE_EQ(learning_rate(t, 1), 1e-2);
  EXPECT_DOUBLE_EQ(learning_rate(t, 2), 1e-2);   // decay starts at the peak
  EXPECT_DOUBLE_EQ(learning_rate(t, 9), 1e-3);   // and ends at min_lr on the last step
  t.steps = 11;  // 9 decay steps: the middle one (step 6) is halfway
  EXPECT_NEAR(learning_rate(t, 6), 1e-3 + 0.5 * 9e-3, 1e-15);
  t.schedule = Schedule::linear;
  EXPECT_NEAR(learning_rate(t, 6), 1e-2 - 0.5 * 9e-3, 1e-15);
  EXPECT_DOUBLE_EQ(learning_rate(t, 10), 1e-3);
  EXPECT_DOUBLE_EQ(learning_rate(t, 50), 1e-3);  // past the end: stays at min_lr
  t.schedule = Schedule::constant;
  EXPECT_DOUBLE_EQ(learning_rate(t, 7), 1e-2);
  t.warmup_steps = 0;
  EXPECT_DOUBLE_EQ(learning_rate(t, 0), 1e-2);
  // One decay step (warmup = steps - 1): warm up to the peak, then the last step is min_lr.
  t.schedule = Schedule::cosine, t.steps = 5, t.warmup_steps = 4;
  EXPECT_DOUBLE_EQ(learning_rate(t, 3), 1e-2);
  EXPECT_DOUBLE_EQ(learning_rate(t, 4), 1e-3);
}

}  // namespace
}  // namespace fp8moe
