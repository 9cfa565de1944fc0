// The output head, once for the main model, every multi-token prediction module and generation:
//   hf = RMSNorm(x);  logits = hf W_head^T (FP32);  loss = cross-entropy(logits, targets)
// Vocabulary-parallel under tensor parallelism: this rank holds the head rows (and the logits) of
// its vocabulary slice [vocab_first, vocab_first + local vocab); the cross-entropy reduces its row
// maxima and sums over the group, so the full logits are never formed.
#pragma once

#include <cstdint>
#include <functional>

#include "model/context.h"

namespace fp8moe {

struct HeadParams {
  Weight norm;  // (D): the final norm (a module's own `norm` for a multi-token prediction module)
  Weight head;  // (V_local, D), shared by the main model and every module
};

// What the head's forward keeps for its backward.
struct HeadSaved {
  Tensor hf, rstd;  // (N, D) the normed input (the head's input, and the next module's), (N)
  Tensor dlogits;   // (N, V_local) the loss's gradient of the logits
};

// The loss of a training or evaluation forward.
struct HeadLoss {
  const int32_t* targets = nullptr;  // (N) device; model.pad_id: not counted
  float grad_scale = 0;              // d loss / d (summed cross-entropy): loss scale / counted targets
  double* loss_sum = nullptr;        // device: the counted tokens' cross-entropy sum (nullptr: not kept)
  bool backward = false;             // keep dlogits for head_backward
};

// hf and rstd into `s` (kept for the backward, and for a reader of hf), then with `loss` the
// cross-entropy (dlogits into `s` when loss->backward), else the logits (N, V_local) into *logits.
void head_forward(const ModelContext& ctx, const HeadParams& p, const float* x, int64_t N, const HeadLoss* loss,
                  HeadSaved* s, Tensor* logits = nullptr);

// dx (N, D) written from s's dlogits: the head weight's gradient accumulated, the gradient of hf
// summed over the group; then `more` (may be empty) adds the gradient of hf from its other
// readers (the multi-token prediction modules read the main model's hf, module k + 1 module k's)
// before the norm's backward. Frees s.dlogits and s.hf. weights (detached; may be nullptr): the
// head weight's gradient GEMM left to it (hp_backward).
void head_backward(const ModelContext& ctx, const HeadParams& p, const float* x, int64_t N, HeadSaved* s, float* dx,
                   const std::function<void(float* dhf)>& more = {}, LaterWork* weights = nullptr);

// The vocabulary-parallel cross-entropy of logits (N, V_local) against targets: the loss sum into
// *loss_sum, grad_scale x its gradient into dlogits (nullptr: none).
void vocab_parallel_cross_entropy(const ModelContext& ctx, const float* logits, const int32_t* targets, int64_t N,
                                  float grad_scale, float* dlogits, double* loss_sum);

}  // namespace fp8moe
