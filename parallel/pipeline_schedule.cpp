#include "parallel/pipeline_schedule.h"

#include <algorithm>

namespace fp8moe {

std::vector<PipelineOp> one_f_one_b(int stages, int stage, int micro_batches) {
  const int M = micro_batches, warmup = std::min(stages - stage - 1, M);
  std::vector<PipelineOp> ops;
  ops.reserve(size_t(2 * M));
  for (int i = 0; i < warmup; ++i) ops.push_back({true, i});
  for (int i = 0; i < M - warmup; ++i) ops.push_back({true, warmup + i}), ops.push_back({false, i});
  for (int i = M - warmup; i < M; ++i) ops.push_back({false, i});
  return ops;
}

}  // namespace fp8moe
