// The order in which one pipeline stage runs the forwards and backwards of a step's micro-batches.
#pragma once

#include <vector>

namespace fp8moe {

struct PipelineOp {
  bool forward;      // else backward
  int micro_batch;
  bool operator==(const PipelineOp&) const = default;
};

// 1F1B (PipeDream-flush, Megatron's non-interleaved schedule) for stage `stage` of `stages`:
// min(stages - stage - 1, M) warm-up forwards, then alternately one forward and one backward,
// then the remaining backwards. At most min(stages - stage, M) micro-batches are in flight
// (forwarded, not yet backwarded) on a stage; with equal forward and backward times the bubble is
// (stages - 1) / (M + stages - 1) of the step. One stage: F0 B0 F1 B1 ...
std::vector<PipelineOp> one_f_one_b(int stages, int stage, int micro_batches);

}  // namespace fp8moe
