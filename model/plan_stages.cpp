// The pipeline stages of `fp8moe plan` (model/plan_model.h): what a stage's rank holds in flight
// and runs per micro-batch, over the schedules of parallel/pipeline_schedule.h; the model a
// tensor-parallel rank runs.
#include <algorithm>

#include "model/plan_model.h"
#include "parallel/pipeline_schedule.h"

namespace fp8moe {

int in_flight_micro_batches(int stages, int stage, int micro_batches, bool paired) {
  int open = 0, most = 0;
  for (const PipelineOp& op : paired ? one_f_one_b_paired(stages, stage, micro_batches)
                                     : one_f_one_b(stages, stage, micro_batches)) {
    if (op.kind == PipeOpKind::weight) continue;
    open += op.kind == PipeOpKind::backward ? -1 : 1;  // (a pair: its forward's before its backward frees)
    most = std::max(most, open);
    if (op.kind == PipeOpKind::forward_backward) --open;
  }
  return most;
}

double dualpipev_activations(int ranks, int rank, int micro_batches, const double saved[2], int* most_chunks,
                             bool paired) {
  int open[2] = {0, 0};
  double most = 0;
  *most_chunks = 0;
  auto track = [&](int phase, int delta) {
    open[phase] += delta;
    most = std::max(most, open[0] * saved[0] + open[1] * saved[1]);
    *most_chunks = std::max(*most_chunks, open[0] + open[1]);
  };
  for (const DualOp& op : dualpipev_as_run(ranks, rank, micro_batches, paired)) {
    if (op.kind == DualOpKind::forward_backward) {  // (its forward's state made before its backward frees)
      track(op.phase, 1), track(1 - op.phase, -1);
      continue;
    }
    track(op.phase, op.kind == DualOpKind::forward ? 1 : -1);
  }
  return most;
}

int stage_moe_blocks(const ModelConfig& m, const StageMemory& s) {
  auto moe = [&](int b, int e) { return std::max(0, e - std::max(b, m.first_dense_layers)); };
  return moe(s.layer_begin, s.layer_end) + (s.v_shape ? moe(s.layer_begin2, s.layer_end2) : 0) + s.mtp_blocks;
}

double stage_seconds(const ModelConfig& m, const StageMemory& s, const BlockSeconds& t) {
  auto dense = [&](int b, int e) { return std::max(0, std::min(e, m.first_dense_layers) - b); };
  const int nd = dense(s.layer_begin, s.layer_end) + (s.v_shape ? dense(s.layer_begin2, s.layer_end2) : 0);
  const int nm = stage_moe_blocks(m, s) - s.mtp_blocks;
  double seconds = nd * t.dense + nm * t.moe;
  if (s.head) seconds += t.outside;  // (parallel.mtp_own_stage: the head's stage, the one before the modules')
  if (s.last) seconds += s.mtp_blocks * t.mtp;
  return seconds;
}

ModelConfig tensor_rank_model(const ModelConfig& m, int tp) {
  ModelConfig n = m;
  n.n_heads /= tp, n.d_ff_dense /= tp, n.moe.d_expert /= tp, n.vocab_size /= tp;
  if (!n.mla()) n.n_kv_heads /= tp;
  if (n.pad_id >= 0) n.pad_id %= n.vocab_size;  // (a rank's tokens folded into its slice)
  return n;
}

}  // namespace fp8moe
