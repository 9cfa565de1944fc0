// The whole MoE transformer on one rank, forward and backward:
//   embedding | L x [x += Attention(RMSNorm(x)); x += FFN(RMSNorm(x))] | RMSNorm, head, cross-entropy
// FFN is a dense SwiGLU MLP in the first `first_dense_layers` blocks and an MoE after them. Every
// linear layer's GEMMs run in FP8 per fp8.recipe and fp8.layers; embedding, router, norms,
// attention core, head and loss stay FP32. Tokens are (B, T) row-major, N = B * T.
#pragma once

#include <map>
#include <memory>
#include <utility>
#include <string>
#include <vector>

#include "model/moe.h"
#include "model/param_table.h"
#include "model/placement.h"
#include "parallel/communicator.h"

namespace fp8moe {

struct StepResult {
  double loss = 0;     // cross-entropy mean over counted tokens + auxiliary losses
  double ce = 0;       // the cross-entropy part (sum over this batch / mean_over)
  double aux = 0;      // the auxiliary balance losses, summed over MoE layers
  int64_t tokens = 0;  // targets counted (not pad_id)
  std::vector<std::vector<int64_t>> expert_load;  // per MoE layer, tokens per expert
  std::vector<std::vector<int32_t>> routing;      // per MoE layer, (N, top_k) chosen experts
  int64_t fp8_saturated = 0;                      // elements clamped to the FP8 maximum (all GEMMs)
  int64_t fp8_underflowed = 0;                    // non-zero elements that became 0 in FP8
  int64_t dropped = 0;                            // assignments dropped by capacity
};

// The communicators the model computes over (none: one rank holds everything). Not owned.
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
  const StepResult& result() const;  // the loss on the last stage; routing and loads of this stage's layers
  const float* output() const;       // (N, D): the activation for the next stage (not the last stage)
  const float* input_grad() const;   // (N, D), after backward: for the previous stage (not the first)
  int64_t activation_size() const;   // N x D

 private:
  friend class Transformer;
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

class Transformer {
 public:
  // Parameters initialised from (train.seed, name, element index); with expert parallelism only
  // the local experts are held (the others' parameter and gradient vectors are empty).
  explicit Transformer(const Config& cfg, ModelGroups groups = {});

  const ParamTable& table() const { return table_; }
  std::vector<float>& param(const std::string& name) { return params_[slot(name)]; }
  std::vector<float>& grad(const std::string& name) { return grads_[slot(name)]; }
  std::vector<std::vector<float>>& params() { return params_; }
  std::vector<std::vector<float>>& grads() { return grads_; }
  void zero_grads();

  // Loss of a batch; with `backward`, adds d loss / d parameter into the gradients.
  // targets equal to model.pad_id are not counted.
  // loss_scale multiplies every gradient (loss scaling; the caller divides it out).
  // Data parallelism: the batch is this replica's part of a micro-batch of `mean_over` counted
  // tokens (0: this batch's own count); the cross-entropy is summed here and divided by it, so that
  // the replicas' losses and gradients SUM to the micro-batch's, with the same magnitudes as on one
  // rank (what FP8 scaling sees). aux_weight weighs the auxiliary loss (1 / replicas: their mean).
  // One rank holding every block (no pipeline parallelism): stage_forward + stage_backward.
  StepResult forward_backward(const int32_t* tokens, const int32_t* targets, int64_t B, int64_t T, bool backward,
                              float loss_scale = 1.0f, int64_t mean_over = 0, double aux_weight = 1.0);

  // Pipeline parallelism: the forward of this stage on one micro-batch (tokens on the first stage,
  // x_in (B*T, D) from the previous stage otherwise; targets used on the last stage), then later
  // its backward (dy: the gradient of output() from the next stage; nullptr on the last stage).
  // StepResult::expert_load and routing have one entry per MoE layer of the model; layers of
  // other stages are empty.
  StageRun stage_forward(const int32_t* tokens, const int32_t* targets, int64_t B, int64_t T, const float* x_in,
                         bool backward, float loss_scale = 1.0f, int64_t mean_over = 0, double aux_weight = 1.0);
  void stage_backward(StageRun& run, const float* dy);

  // Logits (V) of the token after tokens[0..T) (one sequence), for generation. FP8 histories are
  // not advanced.
  std::vector<float> next_token_logits(const int32_t* tokens, int64_t T);

  // Aux-loss-free balancing after an optimizer step: each MoE layer's router bias moves by
  // model.moe.bias_update_rate towards balance, from the step's load per MoE layer and expert
  // (StepResult::expert_load, summed over micro-batches).
  void update_router_biases(const std::vector<std::vector<int64_t>>& expert_load);

  // Where this rank's share of the model lies: its pipeline stage's blocks, its experts, its
  // tensor-parallel slices (model/placement.h).
  const Placement& placement() const { return placement_; }
  // Whether this rank holds parameter i (expert parallelism: its experts only), and which block of
  // the global tensor (tensor parallelism: a row or column slice); params()[i] is that block.
  bool holds(size_t i) const { return shards_[i].held(); }
  const Shard& shard(size_t i) const { return shards_[i]; }
  // The delayed-scaling state per linear weight name (checkpointed). Entries appear at the first
  // training forward; a loaded entry (non-empty history) is used as it is.
  std::map<std::string, LinearScaling>& fp8_scaling() { return scaling_; }

  // Bytes of activations saved for backward per token per block, as of the last forward.
  double saved_bytes_per_token_per_layer() const { return saved_bytes_per_token_; }

 public:
  struct BlockSaved;  // one block's forward state (defined in transformer.cpp)

 private:
  size_t slot(const std::string& name) const;  // the table index of a parameter; asserts it exists
  const float* P(const std::string& name) const { return params_[slot(name)].data(); }
  float* G(const std::string& name) { return grads_[slot(name)].data(); }
  // record: a training forward (advances delayed-scaling histories); otherwise a recomputation
  // (recompute_ true: the forward's scales) or an evaluation (the current scales).
  LinearFp8 fp8_for(const std::string& weight, LinearClass cls, bool record);
  FfnWeights ffn_weights(const std::string& prefix) const;
  FfnGrads ffn_grads(const std::string& prefix);
  FfnFp8 ffn_fp8(const std::string& prefix, LinearClass cls, bool record);
  MoeWeights moe_weights(int layer) const;
  bool recomputed(int layer) const;
  void block_forward(int layer, const float* x, int64_t B, int64_t T, float* out, BlockSaved* s, bool record);
  void block_backward(int layer, const BlockSaved& s, const float* dout, float* dx, float aux_grad_scale);

  Config cfg_;
  ParamTable table_;
  std::vector<std::vector<float>> params_, grads_;
  std::map<std::string, LinearScaling> scaling_;  // delayed-scaling state per linear weight
  double saved_bytes_per_token_ = 0;
  int64_t saturated_ = 0, underflowed_ = 0;  // FP8 counts of the current forward_backward
  bool recompute_ = false; // inside a recomputation (see fp8_for)
  ModelGroups groups_;
  std::unique_ptr<ExpertDispatcher> dispatcher_;  // expert parallelism (ep > 1)
  std::vector<Shard> shards_;
  Placement placement_;
  const ModelConfig& local() const { return placement_.local(); }  // this tensor-parallel rank's dims
  int tp_size() const { return placement_.at().tensor; }
  void tp_sum(float* x, int64_t n);  // allreduce over the tensor group (nothing without one)
  // Vocabulary-parallel embedding, head and cross-entropy (tensor parallelism: this rank holds
  // the vocabulary rows [vocab_first, vocab_first + local vocab)); the full logits are never formed.
  void embed_forward(const int32_t* tokens, int64_t N, float* out);
  void embed_backward(const float* dx, const int32_t* tokens, int64_t N);
  double cross_entropy(const float* logits, const int32_t* targets, int64_t N, float grad_scale, float* dlogits,
                       int64_t* count);
};

}  // namespace fp8moe
