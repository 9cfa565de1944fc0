// The MoE transformer on one rank: the stage driver, forward and backward, on the rank's backend:
//   embedding | L x Block | head (final norm, head, cross-entropy) | multi-token prediction
// The pieces are their own units: model/block.h (a block: attention and a dense or MoE FFN),
// model/attention.h (GQA, MLA), model/head.h, model/mtp.h, model/fp8_state.h (the linear layers'
// FP8 state and the Pass each forward and backward runs as). Every linear layer's GEMMs run in
// FP8 per fp8.recipe and fp8.layers; embedding, router, norms, attention core, head and loss stay
// FP32. Tokens are (B, T) row-major, N = B * T. Parameters are resolved once, when the model is
// built: the passes look nothing up by name.
//
// Every tensor lives in the backend's memory (device memory on a GPU): parameters and gradients
// in one flat buffer each (model/param_store.h), activations, FP8 copies, scales and delayed-
// scaling histories. The host reads device memory at two kinds of points only: each MoE layer's
// expert loads (once per layer and micro-batch: the experts' GEMM shapes and the expert-parallel
// exchange need them), and what its caller reads once per step (the losses the forwards write into
// LossSlots, the FP8 counters, the gradient norm).
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "model/block.h"
#include "model/context.h"
#include "model/head.h"
#include "model/mtp.h"
#include "model/param_store.h"
#include "model/param_table.h"
#include "model/placement.h"
#include "parallel/communicator.h"

namespace fp8moe {

// What the host knows of one micro-batch on this stage without reading device memory, and the
// loads it read.
struct StepResult {
  int64_t tokens = 0;  // targets counted (not pad_id), on the last stage
  std::vector<std::vector<int64_t>> expert_load;  // per MoE layer of the model, tokens per expert (this stage's layers)
  std::vector<std::vector<int32_t>> routing;      // per MoE layer, (N, top_k) chosen experts: with keep_routing only
  int64_t dropped = 0;                            // assignments dropped by capacity
  // forward_backward only (it reads them back: one more synchronisation): the batch's losses.
  double loss = 0;  // cross-entropy mean over counted tokens + auxiliary losses
  double ce = 0;    // the cross-entropy part (sum over this batch / mean_over)
  double aux = 0;   // the auxiliary balance losses, summed over MoE layers, times aux_weight
  // The multi-token prediction modules' cross-entropy (each over its counted targets), their
  // mean; the training objective is loss + model.mtp_loss_weight x mtp. 0 without them.
  double mtp = 0;
};

// Where a micro-batch's forward writes what the host reads after the step (device memory).
struct LossSlots {
  double* ce_sum = nullptr;  // the last stage's sum of the counted tokens' cross-entropy
  double* aux = nullptr;     // one slot per MoE layer of the model: its auxiliary loss (unweighted)
  double* mtp = nullptr;     // one slot per multi-token prediction module: its cross-entropy sum
};

// The communicators the model computes over (none: one rank holds everything). Not owned. All but
// expert_counts work on the backend's memory (parallel/device_communicator.h).
struct ModelGroups {
  // Pipeline parallelism: this rank's stage (its rank in the group) runs a contiguous range of
  // blocks (model/placement.h); only its parameters are held.
  Communicator* pipeline = nullptr;
  // Tensor parallelism (Megatron): heads, FFN widths, expert widths and the vocabulary split over
  // these ranks; the forward all-reduce after row-parallel layers, the backward one for the inputs
  // of column-parallel layers; per-tensor FP8 amax values reduced (max) over them.
  Communicator* tensor = nullptr;
  // The data-parallel replicas of the dense parameters: delayed scaling reduces every amax (max)
  // over them, so that every replica keeps the same state and it does not depend on the layout.
  Communicator* data = nullptr;
  // Expert parallelism: the ranks that exchange tokens; each holds its share of the routed experts
  // of every MoE layer (model/placement.h).
  Communicator* expert = nullptr;
  // The same expert group over host memory: the per-expert row counts it exchanges.
  Communicator* expert_counts = nullptr;
  // The replicas of this rank's experts (their amax reduction; their gradients are summed there).
  Communicator* expert_data = nullptr;
};

class Transformer;

// One micro-batch on this rank's pipeline stage, between its forward and its backward.
class StageRun {
 public:
  StageRun();
  ~StageRun();
  StageRun(StageRun&&) noexcept;
  StageRun& operator=(StageRun&&) noexcept;
  const StepResult& result() const;  // routing and loads of this stage's layers, the counted tokens
  const float* output() const;       // (N, D): the activation for the next stage (not the last stage)
  const float* input_grad() const;   // (N, D), after backward: for the previous stage (not the first)
  int64_t activation_size() const;   // N x D
  // Multi-token prediction across stages: the first stage's embeddings of the modules' input
  // tokens, (depth, N, D), for the last stage; after the last stage's backward, their gradient for
  // the first stage. nullptr without the modules (or outside a training forward).
  const float* mtp_output() const;
  const float* mtp_input_grad() const;
  int64_t mtp_size() const;          // depth x N x D, or 0

 private:
  friend class Transformer;
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// A backward's weight part, left for a later pipeline op (the zero-bubble split of a backward
// into its input part B and its weight part W; parallel.pipeline_schedule zb1p): each block's
// linear layers' weight-gradient GEMMs, and on the last stage the head's and the multi-token
// prediction modules' (their blocks' linear layers, eh_proj, their heads), with copies of the FP8,
// BF16 or FP32 inputs and gradients they read, in the order the backward left them. The
// micro-batch's StageRun may be gone when they run. The norms', the router's and the embedding's
// weight gradients are not among them, nor the experts' where their exchange is posted: B makes
// them. Running each step once, in the order of the
// micro-batches, gives the same bits as a whole backward (the same GEMMs on the same bytes, each
// gradient accumulated in the same order).
class StageWeights {
 public:
  // after_block (optional): called with each block's index once its weight gradients are final
  // here (the data-parallel reduction posts that layer's buckets after the step's last W; the
  // head's and the modules' go with the rest, after run()).
  void run(const std::function<void(int)>& after_block = {});
  bool empty() const { return blocks_.empty(); }

 private:
  friend class Transformer;
  std::vector<std::pair<int, LaterWork>> blocks_;
};

class Transformer {
 public:
  // Parameters initialised from (train.seed, name, element index) in `be`'s memory; with expert
  // parallelism only the local experts are held.
  Transformer(Backend& be, const Config& cfg, ModelGroups groups = {});
  ~Transformer();

  Backend& backend() const { return be_; }
  const ParamTable& table() const { return table_; }
  ParamStore& store() { return *store_; }
  // Expert parallelism's exchange (nullptr without it).
  ExpertDispatcher* dispatcher() { return dispatcher_.get(); }
  const ExpertDispatcher* dispatcher() const { return dispatcher_.get(); }
  const ParamStore& store() const { return *store_; }
  void zero_grads() { store_->zero_grads(); }
  // Host copies and writes of parameters (tests, tools): a download and synchronisation each.
  std::vector<std::vector<float>> params_to_host() const { return store_->params_to_host(); }
  std::vector<std::vector<float>> grads_to_host() const { return store_->grads_to_host(); }
  std::vector<float> param_to_host(const std::string& name) const { return store_->param_to_host(slot(name)); }
  void set_param(size_t i, const std::vector<float>& values) { store_->param_from_host(i, values); }

  // The next training forward belongs to a new optimizer step: every FP8 weight is quantized anew
  // at its first use and reused by the step's other micro-batches, its recomputations and dgrad
  // (with delayed scaling, a weight's amax enters its history once per step).
  void begin_step() {
    fp8_->begin_step();
    relay_again_ = {};
  }
  // Device [saturated, underflowed] counters that every quantization of a training forward and
  // backward adds to; the caller zeroes and reads them.
  uint64_t* fp8_counts() { return fp8_->counts(); }
  // Also download each MoE layer's choice of experts into StepResult::routing (tests: one more
  // synchronisation per layer).
  void set_keep_routing(bool on) { keep_routing_ = on; }

  // One rank holding every block, for tests and tools: host tokens and targets, stage_forward and
  // stage_backward, and the losses read back. begin_step() first when `backward`. Targets equal to
  // model.pad_id are not counted. loss_scale multiplies every gradient; mean_over and aux_weight
  // as in stage_forward. weights: as stage_backward's (the weight part left to it).
  StepResult forward_backward(const int32_t* tokens, const int32_t* targets, int64_t B, int64_t T, bool backward,
                              float loss_scale = 1.0f, int64_t mean_over = 0, double aux_weight = 1.0,
                              StageWeights* weights = nullptr);

  // The forward of this stage on one micro-batch (tokens on the first stage, x_in (B*T, D) from the
  // previous stage otherwise; targets used on the last stage: device memory, kept alive by the
  // caller until the backward). `counted`: the targets that are not pad_id. Data parallelism: the
  // batch is this replica's part of a micro-batch of `mean_over` counted tokens (0: counted); the
  // cross-entropy is summed here and divided by it, so that the replicas' losses and gradients SUM
  // to the micro-batch's with the magnitudes of one rank (what FP8 scaling sees). aux_weight
  // weighs the auxiliary loss's gradient (1 / replicas: their mean); loss_scale multiplies every
  // gradient (the caller divides it out). The losses go to `slots` (nullptr slots: not recorded).
  // chunk: which of this rank's chunks of blocks runs (model/placement.h; DualPipeV's ranks hold
  // two: 1 is the V's way back); the embedding where it is the model's first chunk, the head, the
  // loss and the modules where it is the last. With multi-token prediction a last chunk that did
  // not embed its tokens reads their embeddings from mtp->embeddings (the first chunk's
  // mtp_output(): another rank's, sent, or this rank's own run of the other chunk).
  StageRun stage_forward(const int32_t* tokens, const int32_t* targets, int64_t counted, int64_t B, int64_t T,
                         const float* x_in, bool backward, const LossSlots& slots, float loss_scale = 1.0f,
                         int64_t mean_over = 0, double aux_weight = 1.0, const MtpBatch* mtp = nullptr,
                         int chunk = 0);
  // The backward of run's chunk. dy: the gradient of output() from the next stage (device memory);
  // nullptr on the model's last chunk. d_mtp: on the model's first chunk where it does not also end
  // the model, the last chunk's run's mtp_input_grad() (with the modules).
  // after_block (optional): called with each block's index once its backward is over (the
  // data-parallel reduction posts that layer's buckets when this is the step's last backward).
  // weights (may be nullptr): the blocks' weight-gradient GEMMs left to it, not run (after_block
  // is then its run()'s).
  void stage_backward(StageRun& run, const float* dy, const float* d_mtp = nullptr,
                      const std::function<void(int)>& after_block = {}, StageWeights* weights = nullptr);

  // parallel.mtp_own_stage: the head stage and the last stage hold the head's weight, tied. Once
  // a step, after the stage's last backward or weight op and before the data-parallel reduction
  // of the head (post_rest, reduce_gradients), the last stage sends its gradient of it (the
  // modules' heads') to the head stage, which adds it to its own (the main head's): the head
  // stage's is the whole gradient, which its replicas reduce and its optimizer applies. After the
  // optimizer's step (and ZeRO-1's gather), share_tied_head sends the head stage's updated weight
  // to the last stage, whose copy it replaces: the two stay the same bits whatever their
  // data-parallel reductions' orders (the copy's own update is discarded). Elsewhere, nothing.
  // Each returns the FP32 values this rank sent (the communication accounting's).
  int64_t tie_head_gradient();
  int64_t share_tied_head();
  // Per parameter: whether this rank holds it as a tied copy (model/placement.h holds_tied_copy).
  std::vector<bool> tied_copies() const;

  // Logits (V) of the token after tokens[0..T) (one sequence, host ids), for generation. FP8
  // histories are not advanced.
  std::vector<float> next_token_logits(const int32_t* tokens, int64_t T);
  // Logits (T, V) of every position of one sequence (tools and tests: the comparison with Hugging
  // Face transformers); with `mtp`, also each multi-token prediction module's (T, V), teacher-forced.
  std::vector<float> sequence_logits(const int32_t* tokens, int64_t T, std::vector<std::vector<float>>* mtp = nullptr);

  // Aux-loss-free balancing after an optimizer step: each MoE layer's router bias moves by
  // model.moe.bias_update_rate towards balance, from the step's load per MoE layer and expert
  // (host counts, summed over micro-batches and ranks).
  void update_router_biases(const std::vector<std::vector<int64_t>>& expert_load);

  // Where this rank's share of the model lies: its pipeline stage's blocks, its experts, its
  // tensor-parallel slices (model/placement.h).
  const Placement& placement() const { return placement_; }
  bool holds(size_t i) const { return store_->holds(i); }
  const Shard& shard(size_t i) const { return store_->shard(i); }
  // The delayed-scaling state per linear weight name, in host form (checkpoints): an entry per FP8
  // linear weight this rank holds (Fp8State::to_host); set_fp8_scaling replaces every entry (a
  // loaded entry with a history is used as it is).
  std::map<std::string, HostLinearScaling> fp8_scaling_to_host() const { return fp8_->to_host(); }
  void set_fp8_scaling(const std::map<std::string, HostLinearScaling>& scaling) { fp8_->from_host(scaling); }

  // Bytes of activations saved for backward per token per block, as of the last forward.
  double saved_bytes_per_token_per_layer() const { return saved_bytes_per_token_; }
  // Of the relay's rows this step's training forwards planned (ExpertDispatcher::relay_rows), those
  // of the blocks that run their forward again (train.recompute, recompute_layers): the
  // communication formulas count their exchanges twice. Reset by begin_step().
  const ExpertDispatcher::RelayRows& relay_rows_again() const { return relay_again_; }

 private:
  size_t slot(const std::string& name) const;
  // parallel.mtp_own_stage: the head's weight's parameter and its size on this rank where it is one
  // of the tie's two (the head stage, the last), else {0, 0}.
  std::pair<size_t, int64_t> tied_head() const;
  Tensor modules_hf(const StageRun::Impl& st) const;  // the table index of a parameter; asserts it exists
  const ModelConfig& local() const { return placement_.local(); }  // this tensor-parallel rank's dims
  // Which blocks train.recompute drops after a training forward (and runs again before backward).
  bool recomputed(int layer) const;
  // After a block's training forward: its MoE routing into the stage's result and, where the block
  // is recomputed, its state dropped but for the routing.
  void finish_block(const Block& block, BlockSaved* s, StepResult* result);
  // (rows, V) of the last positions; with mtp (rows == T), the modules' logits too.
  std::vector<float> last_logits(const int32_t* tokens, int64_t T, int64_t rows, std::vector<std::vector<float>>* mtp);
  // Vocabulary-parallel embedding (tensor parallelism: each token's row comes from the one rank
  // holding it, summed over the group) and its weight gradient.
  void embed_forward(const int32_t* tokens, int64_t N, float* out);
  void embed_backward(const float* dx, const int32_t* tokens, int64_t N);
  void stage_head_forward(StageRun& run, const int32_t* targets, int64_t counted, const LossSlots& slots,
                          float loss_scale, int64_t mean_over, const MtpBatch* mtp);

  Backend& be_;
  Config cfg_;
  ParamTable table_;
  ModelGroups groups_;
  Placement placement_;
  std::unique_ptr<ParamStore> store_;
  std::unique_ptr<Fp8State> fp8_;
  RopeTables rope_;
  HostBuffer<int64_t> loads_h_;                   // (n_experts) pinned: each MoE layer's loads, read back
  std::unique_ptr<ExpertDispatcher> dispatcher_;  // expert parallelism (ep > 1)
  std::unique_ptr<ModelContext> ctx_;
  // This rank's chunks' blocks (each chunk's [layer_begin, layer_end) in turn), then with the head
  // the modules' blocks.
  std::vector<std::unique_ptr<Block>> blocks_;
  std::vector<int> chunk_block0_;                 // per chunk of this rank: the index of its first block
  Weight embed_;                                  // first stage
  HeadParams head_;                               // last stage
  std::unique_ptr<Mtp> mtp_;                      // last stage, with model.mtp_depth modules
  std::vector<std::pair<int, float*>> router_biases_;  // (layer, bias) of this rank's MoE blocks
  double saved_bytes_per_token_ = 0;
  bool keep_routing_ = false;
  // relay_rows_again: its sums, the dispatcher's counts at the last block's end, and whether the
  // forward in progress is a training one.
  ExpertDispatcher::RelayRows relay_again_, relay_mark_;
  bool training_forward_ = false;
};

}  // namespace fp8moe
