// AdamW on FP32 master weights, with FP32 (or BF16, as DeepSeek-V3) moments, global-norm
// clipping, the learning-rate schedule and skipping of non-finite steps, on the backend's memory.
//
// A step is two calls with the host's one look at the gradients between them:
//   grad_sq   this rank's part of the squared global norm of the unscaled gradients, into device
//             memory (the caller reads it with the step's other numbers and sums it over the ranks);
//   step      from the global squared norm: skip when it is not finite, else clip and update the
//             owned rows. The gradient's unscale (1 / (micro-batches x loss scale)) and the clip
//             factor are applied inside the AdamW kernel: the gradients are never rewritten.
//
// NOTE: the optimizer lives in model/ (docs/ARCHITECTURE.md): it is driven by the ParamTable (which
// parameters train, which decay) and nothing in it knows about MPI or files.
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/backend.h"
#include "kernels/fp8.h"  // bf16_encode / bf16_decode
#include "model/config.h"
#include "model/param_store.h"
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
  // table: each parameter's shape is this rank's block of it (ReplicaSync::local_table). `owned`:
  // per parameter, the rows of that block this rank updates and keeps moments for (ZeRO-1: its
  // share among the data-parallel replicas); empty: every row of every parameter.
  AdamW(Backend& be, ParamTable table, const TrainConfig& cfg, std::vector<RowRange> owned = {});

  // *out (device) = the sum over the parameters with counted[i] (every one when empty) of the
  // squares of (gradient x unscale) over their owned rows, in parameter order.
  void grad_sq(const ParamStore& store, float unscale, const std::vector<bool>& counted, double* out);
  // One update of the owned rows of the trainable parameters. `step` is the schedule's step; bias
  // correction counts the updates actually applied. global_sq: the squared global norm over every
  // rank (grad_sq's parts summed).
  OptimizerStats step(ParamStore& store, int64_t step, double global_sq, float unscale);

  RowRange owned(size_t i) const { return owned_[i]; }
  bool sharded() const { return sharded_; }  // constructed with explicit row ranges
  // Bytes of optimizer state this rank holds (the moments; the FP32 masters are the model's weights).
  int64_t state_bytes() const;

  int64_t updates() const { return updates_; }
  int64_t skipped() const { return skipped_; }
  // The moments of parameter i's owned rows as FP32 (decoded from BF16 when stored so), on the host.
  std::vector<float> first_moment(size_t i) const;
  std::vector<float> second_moment(size_t i) const;

  // Checkpointing: the moments as stored (bf16_moments(): BF16 bits, else FP32), `which` 0 = first
  // (m), 1 = second (v), of the owned rows, in device memory; empty for parameters the optimizer
  // does not train.
  bool bf16_moments() const { return cfg_.moments_dtype == MomentsDtype::bf16; }
  Tensor& moment(int which, size_t i) { return which == 0 ? m_[i] : v_[i]; }
  const Tensor& moment(int which, size_t i) const { return which == 0 ? m_[i] : v_[i]; }
  void restore_counts(int64_t updates, int64_t skipped) { updates_ = updates, skipped_ = skipped; }

 private:
  Backend& be_;
  ParamTable table_;
  TrainConfig cfg_;
  std::vector<Tensor> m_, v_;  // per parameter: FP32, or BF16 bits with train.moments_dtype bf16
  std::vector<RowRange> owned_;
  Tensor sq_parts_;            // (trainable parameters) FP64: grad_sq's per-parameter partials
  bool sharded_ = false;
  int64_t updates_ = 0, skipped_ = 0;
};

}  // namespace fp8moe
