// AdamW on FP32 master weights, with FP32 (or BF16, as DeepSeek-V3) moments, global-norm
// clipping, the learning-rate schedule and skipping of non-finite steps.
//
// NOTE: the optimizer lives in model/ (docs/ARCHITECTURE.md): it is driven by the ParamTable (which
// parameters train, which decay) and nothing in it knows about MPI or files; ZeRO-1 sharding will
// hand it a slice of each parameter, which this interface (flat tensors per parameter) allows.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "kernels/fp8.h"  // bf16_encode / bf16_decode
#include "model/config.h"
#include "model/param_table.h"
#include "model/placement.h"  // RowRange

namespace fp8moe {

// Learning rate of optimizer step `step` (0-based): linear warm-up to train.lr over warmup_steps
// (step s uses lr * (s + 1) / warmup_steps), then cosine or linear decay from lr at step
// warmup_steps to min_lr at the last step (min_lr after it; a single decay step is min_lr), or
// constant. A pure function of the step: resuming needs no state.
double learning_rate(const TrainConfig& t, int64_t step);

struct OptimizerStats {
  double grad_norm = 0;   // global L2 norm of the gradients before clipping
  double lr = 0;
  bool skipped = false;   // non-finite gradients: nothing was updated
};

// Loss scaling (train.loss_scale): none -> 1; a number -> that scale; dynamic -> starts at
// loss_scale_initial, multiplies by loss_scale_backoff after a step with non-finite gradients and
// by loss_scale_growth after loss_scale_growth_interval finite steps in a row. The loss gradient
// is multiplied by scale() and the gradients divided by it before the optimizer.
class LossScaler {
 public:
  explicit LossScaler(const TrainConfig& t);
  float scale() const { return scale_; }
  void update(bool finite);  // after every step
  int64_t good_steps() const { return good_steps_; }
  void restore(float scale, int64_t good_steps) { scale_ = scale, good_steps_ = good_steps; }  // from a checkpoint

 private:
  TrainConfig cfg_;
  float scale_ = 1.0f;
  int64_t good_steps_ = 0;
};

class AdamW {
 public:
  // `owned`: per parameter, the rows this rank updates and keeps moments for (ZeRO-1: its share
  // among the data-parallel replicas); empty: every row of every parameter.
  AdamW(ParamTable table, const TrainConfig& cfg, std::vector<RowRange> owned = {});

  // One update of the owned rows of the trainable parameters from their gradients (clipped in
  // place). `step` is the schedule's step; bias correction counts the updates actually applied.
  // A parameter this rank does not hold (expert parallelism) has empty vectors and owns no rows.
  // global_sq, when set, turns the squared norms of each parameter's owned rows (this rank's
  // gradients) into the global squared norm, every element counted once over the ranks; unset,
  // their sum is the global one.
  using NormReduce = std::function<double(const std::vector<double>& sq_per_param)>;
  OptimizerStats step(std::vector<std::vector<float>>& params, std::vector<std::vector<float>>& grads, int64_t step,
                      const NormReduce& global_sq = {});
  RowRange owned(size_t i) const { return owned_[i]; }
  bool sharded() const { return sharded_; }  // constructed with explicit row ranges
  // Bytes of optimizer state this rank holds (the moments; the FP32 masters are the model's weights).
  int64_t state_bytes() const;

  int64_t updates() const { return updates_; }
  int64_t skipped() const { return skipped_; }
  // The moments of parameter i's owned rows as FP32 (decoded from BF16 when stored so).
  std::vector<float> first_moment(size_t i) const;
  std::vector<float> second_moment(size_t i) const;

  // Checkpointing: the moments as stored (bf16_moments(): BF16 bits, else FP32), `which` 0 = first
  // (m), 1 = second (v), of the owned rows; empty for parameters the optimizer does not train.
  bool bf16_moments() const { return cfg_.moments_dtype == MomentsDtype::bf16; }
  std::vector<float>& moment_fp32(int which, size_t i) { return which == 0 ? m_[i] : v_[i]; }
  std::vector<uint16_t>& moment_bf16(int which, size_t i) { return which == 0 ? m16_[i] : v16_[i]; }
  void restore_counts(int64_t updates, int64_t skipped) { updates_ = updates, skipped_ = skipped; }

 private:
  ParamTable table_;
  TrainConfig cfg_;
  std::vector<std::vector<float>> m_, v_;          // fp32 moments
  std::vector<std::vector<uint16_t>> m16_, v16_;   // bf16 moments
  std::vector<RowRange> owned_;
  bool sharded_ = false;
  int64_t updates_ = 0, skipped_ = 0;
};

}  // namespace fp8moe
