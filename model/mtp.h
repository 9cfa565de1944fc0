// Multi-token prediction (model.mtp_depth modules, DeepSeek-V3's MTP) on the last pipeline stage,
// after the main model's head. Module k (0-based) reads the embedding of the token k + 1 ahead and
// the normed hidden state h_k (h_0: the main model's head input, h_k: module k - 1's):
//   x = eh_proj [enorm(embedding) | hnorm(h_k)];  out = Block(x);  h_{k+1} = norm(out)
// and predicts the target k + 1 ahead through the shared head (model/head.h), weighted by
// mtp_loss_weight / depth over its counted targets. This is the order of the inference
// implementations that run DeepSeek-V3's MTP weights (vLLM's DeepSeekMTP, transformers' MtpLayer),
// so that exported modules work there. Here too is the one builder of the modules' batch.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "model/block.h"
#include "model/head.h"

namespace fp8moe {

// One micro-batch of B x T tokens for the modules, in a training forward.
struct MtpBatch {
  const int32_t* tokens = nullptr;   // first stage: (depth, B*T) the modules' input tokens (device)
  const int32_t* targets = nullptr;  // last stage: (depth, B*T) their targets (device)
  // Last stage of several: (depth, B*T, D) the first stage's embeddings of `tokens` (passed along
  // the pipeline with the activations).
  const float* embeddings = nullptr;
  std::vector<int64_t> mean_over;    // last stage: per module, its counted targets (over the replicas)
};

// The modules' inputs of one micro-batch (B, T) on the host, into (depth, B, T) each: module k's
// tokens are the tokens k + 1 ahead within each sequence (0 past the end: any token; that
// position predicts nothing), its targets the targets k + 1 ahead (pad_id past the end: not
// counted). Returns each module's counted targets (not pad_id).
std::vector<int64_t> mtp_batch(const int32_t* tokens, const int32_t* targets, int64_t B, int64_t T, int depth,
                               int32_t pad_id, int32_t* tokens_out, int32_t* targets_out);
// The same uploaded to `be`, with the MtpBatch that points at it (mean_over: this batch's counts).
struct MtpInputs {
  Tensor tokens, targets;
  MtpBatch batch;
};
MtpInputs mtp_inputs(Backend& be, const int32_t* tokens, const int32_t* targets, int64_t B, int64_t T, int depth,
                     int32_t pad_id);

// One module's forward state.
struct MtpSaved {
  BlockSaved block;
  Tensor rstd_e, rstd_h;  // (N) enorm's and hnorm's 1 / rms
  Tensor cat;             // (N, 2D) [enorm(embedding) | hnorm(h)], eh_proj's input
  Tensor x, out;          // (N, D) the block's input (eh_proj's output) and output
  HeadSaved head;         // its norm's output (the head's input, the next module's h) and dlogits
};

class Mtp {
 public:
  // blocks: the modules' blocks (layers n_layers + k), owned by the caller; head: the shared head
  // weight; embed: the embedding (generation's teacher-forced logits).
  Mtp(const ModelContext& ctx, std::vector<Block*> blocks, Weight head, Weight embed);
  int depth() const { return int(modules_.size()); }

  // The training forward of every module on N = B*T positions: emb (depth, N, D) the embeddings
  // of their tokens, h the main model's normed output; losses into mtp_ce[k] and aux[k] (device,
  // nullptr: not kept). `finished` is called with each module's block state right after its
  // forward (the caller records its routing and drops what recomputation will redo).
  void forward(const float* emb, const float* h, int64_t B, int64_t T, const MtpBatch& batch, float loss_scale,
               double* mtp_ce, double* aux, std::vector<MtpSaved>* saved,
               const std::function<void(const Block&, BlockSaved*)>& finished);
  // The backward of every module, last first: demb (depth, N, D) written, the gradient of h added
  // to dh, the module weights' and the head's gradients accumulated (the head's, eh_proj's and the
  // blocks' linear layers' GEMMs left to `weights` where given, detached). Frees `saved`.
  void backward(std::vector<MtpSaved>* saved, const float* emb, const float* h, int64_t N, float aux_grad_scale,
                float* demb, float* dh, LaterWork* weights = nullptr);

  // Every module's logits (T, V) of one sequence, teacher-forced as in training (host tokens; h:
  // the main model's normed output of every position). One rank holding the whole model.
  std::vector<std::vector<float>> logits(const int32_t* tokens, int64_t T, const float* h);

 private:
  struct Module {
    Block* block;
    Weight enorm, hnorm, eh_proj;
    HeadParams head;  // the module's own norm, the shared head
  };
  void module_forward(const Module& mod, const float* emb, const float* h, int64_t B, int64_t T, MtpSaved* s,
                      const Pass& pass, double* aux);

  const ModelContext& ctx_;
  std::vector<Module> modules_;
  Weight embed_;
};

}  // namespace fp8moe
