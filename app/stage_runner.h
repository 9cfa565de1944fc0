// One training step of this rank's pipeline stage, and the validation loss: samples this
// replica's sequences of each micro-batch, runs the micro-batches in the 1F1B, ZB1P or DualPipeV
// order (parallel.pipeline_schedule; parallel/pipeline_schedule.h; with parallel.pair_micro_batches
// a forward and a backward at a time, parallel/pass_pair.h) with activations sent to the next
// stage and their gradients to the previous one, and sums what a step reports over the ranks. The
// model's gradients hold the step's (scaled) sum afterwards; the optimizer is the caller's.
//
// The step's data goes to the device once (one upload of every micro-batch's tokens and targets);
// what the host reads back is read at two kinds of points: each MoE layer's expert loads (in the
// model, once per layer and micro-batch) and finish_step's one synchronisation for the losses, the
// FP8 counters and the gradient norm.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "io/token_data.h"
#include "model/config.h"
#include "model/data_parallel.h"
#include "model/transformer.h"
#include "parallel/communicator.h"

namespace fp8moe {

// A step's totals, the same on every rank.
struct StepTotals {
  double loss = 0;  // the global batch's loss: the micro-batches' mean, summed over replicas and stages
  int64_t fp8_saturated = 0, fp8_underflowed = 0;  // over every rank
  std::vector<std::vector<int64_t>> expert_load;   // per MoE layer and expert, over replicas and stages
  double grad_sq = 0;                              // the squared global gradient norm (finish_step's argument, summed)
  // The multi-token prediction modules' mean cross-entropy (the micro-batches' mean, each module's
  // over its counted targets); NaN without them. Not in `loss` (Megatron's "lm loss" and
  // "mtp_1 loss"): the objective adds model.mtp_loss_weight x mtp_loss.
  double mtp_loss = 0;
};

// This rank's part of the step, for the communication and bubble accounting.
struct StepLocal {
  double rows_off_rank = 0;  // routed rows whose expert lives on another expert-parallel rank
  double rows_off_node = 0;  // of them, those whose expert's rank is on another node (runtime.ranks_per_node)
  // Of both, the rows of the blocks that run their forward again (train.recompute, recompute_layers).
  double rows_off_rank_again = 0, rows_off_node_again = 0;
  double waited_s = 0;       // seconds blocked in pipeline receives
};

// The communicators of the runner: the pipeline on the backend's memory (the activations), and
// host ones for the small numbers (token counts, losses, loads).
struct RunnerGroups {
  Communicator* pipe = nullptr;       // backend memory
  Communicator* pipe_host = nullptr;  // host memory, the same group
  Communicator* data_host = nullptr;  // host memory: the data-parallel replicas
  Communicator* world_host = nullptr;
};

class StageRunner {
 public:
  StageRunner(const Config& cfg, Transformer& model, const RunnerGroups& groups);

  // Sequences per replica in each micro-batch: global_batch / (micro_batches x replicas).
  int64_t sequences() const { return mbs_; }

  // Forward and backward of one step's micro-batches, the samples [first_sample, first_sample +
  // global_batch) of `data`, each micro-batch's loss scaled by loss_scale (model.begin_step() and
  // the FP8 counters zeroed first). Collective.
  void train_step(DataBlend& data, int64_t first_sample, float loss_scale, StepLocal* local);
  // The data-parallel reduction to post during the step's last backward, layer by layer
  // (optim.overlap_grad_reduce; model/data_parallel.h): its buckets are posted by the time
  // train_step returns, and the caller waits for them (ReplicaSync::reduce_gradients).
  void set_gradient_sync(ReplicaSync* sync) { sync_ = sync; }

  // The step's one host synchronisation, once the gradients are reduced: the losses the forwards
  // wrote, the FP8 counters and *grad_sq (device: this rank's part of the squared gradient norm),
  // then their sums over the ranks. Collective.
  StepTotals finish_step(const double* grad_sq);

  // The mean cross-entropy over eval.batches fixed micro-batches of `data` (their own seed: the
  // same sequences on any layout). Collective; every rank returns it.
  double validation_loss(DataBlend& data);

 private:
  // This replica's sequences of `batches` micro-batches (global micro-batch index mb0 + i) into
  // the host buffers, and their counted targets (this replica's; with count_all, also summed over
  // the replicas).
  void sample(DataBlend& data, uint64_t seed, int64_t first_sample, int64_t mb0, int64_t batches, bool count_all);
  void upload_batches(int64_t batches, bool with_mtp);
  // A message of n values from `peer` into buf (FP32); with train.activations bf16 it travels as
  // BF16 (n / 2 words) and is widened here, exactly: what was sent is already BF16
  // (model/context.h's rounding points). full: its first act_ values in FP32 whatever the
  // activations (the head's input gradient from a last chunk of no block: Placement::head_alone),
  // the rest (the modules' embeddings' gradient, rounded) as the activations.
  void recv(float* buf, int64_t n, int peer, int tag, StepLocal* local, bool full = false);
  // The non-blocking send of a (act_ values) and, with multi-token prediction, extra (depth_ x act_)
  // to `peer`, built into `keep` where it is not `a` itself (BF16, or the two parts in one message);
  // keep stays alive until the send is complete. copy: into keep even where it could be `a` (a
  // that the sender frees before the send may be complete: the head chunk's hf).
  // Returns the send's number since the last wait_sends() (Communicator::send_complete's k).
  // full: as recv's.
  int64_t send(Tensor& keep, const float* a, const float* extra, int64_t n_extra, int peer, int tag, bool copy = false,
               bool full = false);
  void wait_sends();  // the pipeline's, and the count of sends since
  // parallel.mtp_own_stage: the tied head's gradient to the head stage (Transformer::
  // tie_head_gradient), then the data-parallel reduction of the rest posted.
  void tie_head();
  // train_step's DualPipeV order (parallel.pipeline_schedule dualpipev), once the batches are up.
  void train_step_v(float loss_scale, StepLocal* local);
  void count_loads(const StepResult& r, StepLocal* local);
  // The training forward of micro-batch mb on this rank's `chunk` (x: its input, nullptr where the
  // chunk embeds; mtp_embeddings: the modules' embeddings where the chunk ends the model and did
  // not embed them).
  StageRun forward_micro_batch(int mb, const float* x, const float* mtp_embeddings, float loss_scale, int chunk);
  // Losses per micro-batch: CE, each MoE layer's aux, each multi-token prediction module's CE.
  int64_t slots() const { return 1 + moe_layers_ + depth_; }

  const Config& cfg_;
  Transformer& model_;
  ReplicaSync* sync_ = nullptr;
  // During a step's last backward of a layer: its gradient buckets posted (set_gradient_sync).
  std::function<void(int)> post_layer_;
  Backend& be_;
  RunnerGroups g_;
  int64_t T_ = 0, mbs_ = 0, act_ = 0, moe_layers_ = 0;  // sequence length, sequences per replica, activation floats
  int depth_ = 0;                                        // multi-token prediction modules
  bool first_ = false, last_ = false;                    // holds the embedding / the last chunk
  // Holds the main head and its loss (the last chunk's rank, or with parallel.mtp_own_stage the
  // one before it); holds the head's weight tied with another rank (Transformer::tie_head_gradient).
  bool head_ = false, tied_ = false;
  bool v_shape_ = false;                                 // DualPipeV: two chunks, messages both ways
  int64_t sends_ = 0;                                    // pipeline sends since the last wait_sends()
  HostBuffer<int32_t> tokens_h_, targets_h_;             // (batches, mbs, T), pinned
  std::vector<int64_t> counted_, counted_all_;           // per micro-batch: this replica's, every replica's
  Tensor tokens_, targets_;                              // the same on the device
  Tensor x_in_, dy_in_;                                  // from the previous stage, from the next one (+ MTP's)
  bool bf16_wire_ = false;                               // train.activations bf16: messages in BF16
  Tensor wire_in_;                                       // a received BF16 message before widening
  // Multi-token prediction (training): the modules' shifted tokens and targets (batches, depth,
  // mbs, T), their counted targets per micro-batch and module (this replica's, every replica's).
  HostBuffer<int32_t> mtp_tokens_h_, mtp_targets_h_;
  std::vector<int64_t> mtp_counted_, mtp_counted_all_;
  Tensor mtp_tokens_, mtp_targets_;
  Tensor losses_;                                        // (micro-batches, slots()) FP64
  std::vector<int64_t> load_flat_;                       // (MoE layers, experts) this step, this rank
  HostBuffer<double> losses_h_;                          // finish_step's read: losses_, then the norm part
  HostBuffer<uint64_t> counts_h_;                        // and the FP8 counters
};

}  // namespace fp8moe
