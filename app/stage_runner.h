// One training step of this rank's pipeline stage, and the validation loss: samples this
// replica's sequences of each micro-batch, runs the micro-batches in the 1F1B order
// (parallel/pipeline_schedule.h) with activations sent to the next stage and their gradients to
// the previous one, and sums what a step reports over the ranks. The model's gradients hold the
// step's (scaled) sum afterwards; the optimizer is the caller's.
#pragma once

#include <cstdint>
#include <vector>

#include "io/token_data.h"
#include "model/config.h"
#include "model/transformer.h"
#include "parallel/communicator.h"

namespace fp8moe {

// A step's totals, the same on every rank.
struct StepTotals {
  double loss = 0;  // the global batch's loss: the micro-batches' mean, summed over replicas and stages
  int64_t fp8_saturated = 0, fp8_underflowed = 0;  // over every rank
  std::vector<std::vector<int64_t>> expert_load;   // per MoE layer and expert, over replicas and stages
};

// This rank's part of the step, for the communication and bubble accounting.
struct StepLocal {
  double rows_off_rank = 0;  // routed rows whose expert lives on another expert-parallel rank
  double waited_s = 0;       // seconds blocked in pipeline receives
};

class StageRunner {
 public:
  // pipe: the pipeline group (this rank's stage is its rank); data: the data-parallel replicas;
  // world: every rank. The model is this rank's stage of it.
  StageRunner(const Config& cfg, Transformer& model, Communicator& pipe, Communicator& data, Communicator& world);

  // Sequences per replica in each micro-batch: global_batch / (micro_batches x replicas).
  int64_t sequences() const { return mbs_; }

  // Forward and backward of one step's micro-batches, the samples [first_sample, first_sample +
  // global_batch) of `data`, each micro-batch's loss scaled by loss_scale. Collective.
  StepTotals train_step(DataBlend& data, int64_t first_sample, float loss_scale, StepLocal* local);

  // The mean cross-entropy over eval.batches fixed micro-batches of `data` (their own seed: the
  // same sequences on any layout). Collective; every rank returns it.
  double validation_loss(DataBlend& data);

 private:
  // This replica's sequences of micro-batch `mb` (global micro-batch index) into tokens_, targets_.
  void sample(DataBlend& data, uint64_t seed, int64_t first_sample, int64_t mb);
  void recv(float* buf, int peer, int tag, StepLocal* local);

  const Config& cfg_;
  Transformer& model_;
  Communicator &pipe_, &data_, &world_;
  int64_t T_ = 0, mbs_ = 0, act_ = 0;  // sequence length, sequences per replica, activation floats
  bool first_ = false, last_ = false;  // first / last pipeline stage
  std::vector<int32_t> tokens_, targets_;
  std::vector<float> x_in_, dy_in_;  // from the previous stage, from the next one
};

}  // namespace fp8moe
