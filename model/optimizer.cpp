#include "model/optimizer.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "kernels/check.h"
#include "kernels/dispatch.h"

namespace fp8moe {

double learning_rate(const TrainConfig& t, int64_t step) {
  FP8MOE_ASSERT(step >= 0, "learning_rate of step ", step);
  if (t.warmup_steps > 0 && step < t.warmup_steps) return t.lr * double(step + 1) / double(t.warmup_steps);
  if (t.schedule == Schedule::constant) return t.lr;
  const int64_t decay_steps = t.steps - t.warmup_steps;
  const double progress =
      decay_steps <= 1 ? 1.0 : std::min(1.0, double(step - t.warmup_steps) / double(decay_steps - 1));
  if (t.schedule == Schedule::linear) return t.lr - (t.lr - t.min_lr) * progress;
  return t.min_lr + 0.5 * (t.lr - t.min_lr) * (1.0 + std::cos(M_PI * progress));
}

LossScaler::LossScaler(const TrainConfig& t) : cfg_(t) {
  scale_ = t.loss_scale.mode == LossScaleMode::fixed     ? float(t.loss_scale.value)
           : t.loss_scale.mode == LossScaleMode::dynamic ? float(t.loss_scale_initial)
                                                         : 1.0f;
}

void LossScaler::update(bool finite) {
  if (cfg_.loss_scale.mode != LossScaleMode::dynamic) return;
  if (!finite) {
    scale_ = std::max(float(scale_ * cfg_.loss_scale_backoff), 1.17549435e-38f);
    good_steps_ = 0;
  } else if (++good_steps_ >= cfg_.loss_scale_growth_interval) {
    scale_ = std::min(float(scale_ * cfg_.loss_scale_growth), 3.0e38f);
    good_steps_ = 0;
  }
}

AdamW::AdamW(ParamTable table, const TrainConfig& cfg, std::vector<RowRange> owned)
    : table_(std::move(table)), cfg_(cfg), owned_(std::move(owned)), sharded_(!owned_.empty()) {
  const bool bf16 = cfg.moments_dtype == MomentsDtype::bf16;
  if (owned_.empty())
    for (const ParamSpec& p : table_.params) owned_.push_back({0, p.rows});
  FP8MOE_ASSERT(owned_.size() == table_.params.size(), "AdamW: ", owned_.size(), " row ranges for ",
                table_.params.size(), " parameters");
  for (size_t i = 0; i < table_.params.size(); ++i) {
    const ParamSpec& p = table_.params[i];
    FP8MOE_ASSERT(0 <= owned_[i].begin && owned_[i].begin <= owned_[i].end && owned_[i].end <= p.rows, "AdamW: rows [",
                  owned_[i].begin, ", ", owned_[i].end, ") of ", p.name);
    const size_t n = p.trainable ? size_t((owned_[i].end - owned_[i].begin) * p.cols) : 0;
    m_.emplace_back(bf16 ? 0 : n, 0.0f);
    v_.emplace_back(bf16 ? 0 : n, 0.0f);
    m16_.emplace_back(bf16 ? n : 0, uint16_t(0));
    v16_.emplace_back(bf16 ? n : 0, uint16_t(0));
  }
}

int64_t AdamW::state_bytes() const {
  int64_t b = 0;
  for (size_t i = 0; i < m_.size(); ++i)
    b += int64_t((m_[i].size() + v_[i].size()) * sizeof(float) + (m16_[i].size() + v16_[i].size()) * sizeof(uint16_t));
  return b;
}

std::vector<float> AdamW::first_moment(size_t i) const {
  if (cfg_.moments_dtype == MomentsDtype::fp32) return m_[i];
  std::vector<float> out(m16_[i].size());
  for (size_t j = 0; j < out.size(); ++j) out[j] = bf16_decode(m16_[i][j]);
  return out;
}

std::vector<float> AdamW::second_moment(size_t i) const {
  if (cfg_.moments_dtype == MomentsDtype::fp32) return v_[i];
  std::vector<float> out(v16_[i].size());
  for (size_t j = 0; j < out.size(); ++j) out[j] = bf16_decode(v16_[i][j]);
  return out;
}

OptimizerStats AdamW::step(std::vector<std::vector<float>>& params, std::vector<std::vector<float>>& grads, int64_t step,
                           const NormReduce& global_sq) {
  FP8MOE_ASSERT(params.size() == table_.params.size() && grads.size() == params.size(), "AdamW: ", params.size(),
                " parameters, ", grads.size(), " gradients, table of ", table_.params.size());
  OptimizerStats st;
  st.lr = learning_rate(cfg_, step);
  // The global norm counts every element once, in double, in a fixed order whatever the thread
  // count: partial sums of fixed chunks, added serially.
  constexpr int64_t kChunk = 1 << 14;
  std::vector<double> sq_param(grads.size(), 0.0);
  for (size_t i = 0; i < grads.size(); ++i) {
    const ParamSpec& p = table_.params[i];
    const int64_t want = owned_[i].begin == owned_[i].end && params[i].empty() ? 0 : p.numel();  // not held: nothing
    FP8MOE_ASSERT(int64_t(params[i].size()) == want && int64_t(grads[i].size()) == want, "AdamW: ", p.name, " has ",
                  params[i].size(), " values and ", grads[i].size(), " gradients, expected ", want);
    if (!p.trainable) continue;
    const int64_t n = (owned_[i].end - owned_[i].begin) * p.cols, chunks = (n + kChunk - 1) / kChunk;
    std::vector<double> part(static_cast<size_t>(chunks), 0.0);
    const float* g = grads[i].data() + owned_[i].begin * p.cols;
#pragma omp parallel for schedule(static)
    for (int64_t c = 0; c < chunks; ++c)
      for (int64_t j = c * kChunk; j < std::min(n, (c + 1) * kChunk); ++j) part[c] += double(g[j]) * g[j];
    for (double x : part) sq_param[i] += x;
  }
  double sq = 0;
  if (global_sq) sq = global_sq(sq_param);
  else
    for (double x : sq_param) sq += x;
  st.grad_norm = std::sqrt(sq);
  if (!std::isfinite(st.grad_norm)) {  // a NaN or inf anywhere: skip the step, touch nothing
    st.skipped = true;
    ++skipped_;
    return st;
  }
  // As torch.nn.utils.clip_grad_norm_: scale by clip / (norm + 1e-6) when the norm exceeds clip.
  const float clip = cfg_.grad_clip > 0 && st.grad_norm > cfg_.grad_clip ? float(cfg_.grad_clip / (st.grad_norm + 1e-6)) : 1.0f;

  ++updates_;
  const double b1 = cfg_.beta1, b2 = cfg_.beta2;
  const float bc1 = float(1.0 - std::pow(b1, double(updates_))), bc2 = float(1.0 - std::pow(b2, double(updates_)));
  const float lr = float(st.lr), eps = float(cfg_.eps), fb1 = float(b1), fb2 = float(b2);
  const bool bf16 = cfg_.moments_dtype == MomentsDtype::bf16;
  for (size_t i = 0; i < params.size(); ++i) {
    const ParamSpec& p = table_.params[i];
    if (!p.trainable) continue;
    const float decay = p.weight_decay ? float(1.0 - st.lr * cfg_.weight_decay) : 1.0f;  // decoupled
    float* w = params[i].data() + owned_[i].begin * p.cols;  // the owned rows; moments index from 0
    float* g = grads[i].data() + owned_[i].begin * p.cols;
    const int64_t n = (owned_[i].end - owned_[i].begin) * p.cols;
    const AdamWStep h{fb1, fb2, bc1, bc2, lr, eps, decay, clip};
    // kernels/elem.h's adamw_elem on the CPU or the GPU (runtime.device)
    if (bf16)
      dev::adamw(h, w, g, nullptr, nullptr, m16_[i].data(), v16_[i].data(), n);
    else
      dev::adamw(h, w, g, m_[i].data(), v_[i].data(), nullptr, nullptr, n);
  }
  return st;
}

}  // namespace fp8moe
