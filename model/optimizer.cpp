#include "model/optimizer.h"

#include <algorithm>
#include <cmath>

#include "kernels/check.h"

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

AdamW::AdamW(Backend& be, ParamTable table, const TrainConfig& cfg, std::vector<RowRange> owned)
    : be_(be), table_(std::move(table)), cfg_(cfg), owned_(std::move(owned)), sharded_(!owned_.empty()) {
  const bool bf16 = cfg.moments_dtype == MomentsDtype::bf16;
  if (owned_.empty())
    for (const ParamSpec& p : table_.params) owned_.push_back({0, p.rows});
  FP8MOE_ASSERT(owned_.size() == table_.params.size(), "AdamW: ", owned_.size(), " row ranges for ",
                table_.params.size(), " parameters");
  int64_t trainable = 0;
  for (size_t i = 0; i < table_.params.size(); ++i) {
    const ParamSpec& p = table_.params[i];
    FP8MOE_ASSERT(0 <= owned_[i].begin && owned_[i].begin <= owned_[i].end && owned_[i].end <= p.rows, "AdamW: rows [",
                  owned_[i].begin, ", ", owned_[i].end, ") of ", p.name);
    const int64_t n = p.trainable ? (owned_[i].end - owned_[i].begin) * p.cols : 0;
    m_.push_back(Tensor::zeros(be, bf16 ? DType::bf16 : DType::f32, {n}));
    v_.push_back(Tensor::zeros(be, bf16 ? DType::bf16 : DType::f32, {n}));
    trainable += p.trainable;
  }
  sq_parts_ = Tensor(be, DType::f64, {std::max<int64_t>(trainable, 1)});
}

int64_t AdamW::state_bytes() const {
  int64_t b = 0;
  for (size_t i = 0; i < m_.size(); ++i) b += int64_t(m_[i].bytes() + v_[i].bytes());
  return b;
}

namespace {
std::vector<float> decoded(const Tensor& t, bool bf16) {
  if (!bf16) return to_host<float>(t);
  const std::vector<uint16_t> bits = to_host<uint16_t>(t);
  std::vector<float> out(bits.size());
  for (size_t j = 0; j < out.size(); ++j) out[j] = bf16_decode(bits[j]);
  return out;
}
}  // namespace

std::vector<float> AdamW::first_moment(size_t i) const { return decoded(m_[i], bf16_moments()); }
std::vector<float> AdamW::second_moment(size_t i) const { return decoded(v_[i], bf16_moments()); }

void AdamW::grad_sq(const ParamStore& store, float unscale, const std::vector<bool>& counted, double* out) {
  FP8MOE_ASSERT(store.table().params.size() == table_.params.size(), "AdamW: a store of ",
                store.table().params.size(), " parameters, a table of ", table_.params.size());
  // The global norm counts every element once, in double, in a fixed order whatever the thread
  // count or backend: one partial per parameter (kernels/adamw.h), summed in parameter order.
  int64_t parts = 0;
  double* sq = sq_parts_.data<double>();
  for (size_t i = 0; i < table_.params.size(); ++i) {
    const ParamSpec& p = table_.params[i];
    if (!p.trainable || !store.holds(i) || (!counted.empty() && !counted[i])) continue;
    FP8MOE_ASSERT(store.shard(i).rows == p.rows && store.shard(i).cols == p.cols, "AdamW: ", p.name, " is ",
                  store.shard(i).rows, " x ", store.shard(i).cols, " here, ", p.rows, " x ", p.cols, " in its table");
    const int64_t n = (owned_[i].end - owned_[i].begin) * p.cols;
    be_.sum_squares(store.grad(i) + owned_[i].begin * p.cols, n, unscale, sq + parts++);
  }
  if (parts == 0) be_.zero(out, sizeof(double));
  else be_.sum(sq, parts, out);
}

OptimizerStats AdamW::step(ParamStore& store, int64_t step, double global_sq, float unscale) {
  OptimizerStats st;
  st.lr = learning_rate(cfg_, step);
  st.grad_norm = std::sqrt(global_sq);
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
  const bool bf16 = bf16_moments();
  for (size_t i = 0; i < table_.params.size(); ++i) {
    const ParamSpec& p = table_.params[i];
    if (!p.trainable || !store.holds(i)) continue;
    const float decay = p.weight_decay ? float(1.0 - st.lr * cfg_.weight_decay) : 1.0f;  // decoupled
    float* w = store.param(i) + owned_[i].begin * p.cols;  // the owned rows; moments index from 0
    const float* g = store.grad(i) + owned_[i].begin * p.cols;
    const int64_t n = (owned_[i].end - owned_[i].begin) * p.cols;
    const AdamWStep h{fb1, fb2, bc1, bc2, lr, eps, decay, clip, unscale};
    if (bf16)
      be_.adamw(h, w, g, nullptr, nullptr, m_[i].data<uint16_t>(), v_[i].data<uint16_t>(), n);
    else
      be_.adamw(h, w, g, m_[i].f32(), v_[i].f32(), nullptr, nullptr, n);
  }
  return st;
}

}  // namespace fp8moe
