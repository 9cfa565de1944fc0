// SwiGLU feed-forward: y = (silu(x W1^T) * (x W3^T)) W2^T, three linear layers (FP8 per recipe).
// Used by the dense MLP, the shared experts and every routed expert. Backend memory throughout.
//   x (M, D), W1, W3 (F, D), W2 (D, F), y (M, D)
//
// W1 and W3 run as ONE linear layer W13 = [W1; W3] (2F, D) (fused: one GEMM of N = 2F forward, one
// of K = 2F for dgrad, one wgrad, and x quantized once instead of twice) when W3 follows W1 in
// memory (the parameter store lays them out so, per rank's shard), in every recipe but blockwise
// FP8 with F not a multiple of the tile. Blockwise (F a multiple of T): each T x T weight block and
// each 1 x T gradient tile lies inside W1 or inside W3, so the quantization is the two layers'.
// Per-tensor recipes: one scale for W13 and one for its output gradient (as Transformer Engine's
// fused gate/up projection); delayed scaling keeps that layer's state under W1's name (W3's stays
// empty). Routed experts under train.activations bf16 read their input and W2's output gradient
// at the expert exchange's one scale instead (model/moe.h MoeWire): those x and dy histories stay
// empty, the weight's is kept.
#pragma once

#include "model/linear.h"

namespace fp8moe {

struct FfnWeights {
  const float *w1, *w3, *w2;
};
struct FfnGrads {
  float *w1, *w3, *w2;  // accumulated
};
// Per-linear FP8 contexts (their delayed-scaling states and weight caches differ).
struct FfnFp8 {
  LinearFp8 w1, w3, w2;
};

struct FfnSaved {
  LinearSaved l1, l3, l2;  // FP32 layers read the caller's x in backward: it must outlive it
  Tensor h1, h3;           // (M, F) pre-activation gate and up projections (BF16 once kept, activations bf16)
  Tensor a;                // (M, F) swiglu output, the input of W2 (freed when cached in FP8)
  // W1|W3 fused: l1 is the W13 layer (N = 2F) and h1 its (M, 2F) output, row m = [gate | up];
  // l3 and h3 are empty.
  bool fused = false;
  // train.recompute selective: the SwiGLU output is not kept (nor W2's copy of it); the backward
  // makes it again from h1, h3 (linear_reinput). Where W2 is blockwise FP8 with
  // fp8.cache_activations (DeepSeek-V3), h1 and h3 themselves are kept only in FP8, 1 x T tiles
  // (h1q, h3q): the backward differentiates the SwiGLU at those values and W2's weight gradient
  // reads the output made from them.
  bool a_rebuilt = false;
  QTensor h1q, h3q;
  // train.moe_gates expert (a routed expert): row m's SwiGLU output scaled by gate[m] (the caller's
  // device memory, kept with the caller's saved state), and its gradient written by the backward.
  const float* gate = nullptr;
  int64_t bytes() const {
    return int64_t(h1.bytes() + h3.bytes() + a.bytes()) + l1.fp8_activation_bytes() + l3.fp8_activation_bytes() +
           l2.fp8_activation_bytes() + (h1q.empty() ? 0 : h1q.bytes()) + (h3q.empty() ? 0 : h3q.bytes());
  }
};

// Whether an FFN of width F runs W1|W3 as one layer (above).
bool fuses_w13(const FfnWeights& w, const FfnFp8& fp8, int64_t F, int64_t D);

// activations bf16: the pre-activations h1, h3 rounded to BF16 where they are made and kept in BF16
// for the backward (model/context.h's stash). rebuild_a (train.recompute selective): what a backward
// reads of the SwiGLU output is made again there, not kept (FfnSaved::a_rebuilt).
void ffn_forward(Backend& be, const float* x, int64_t M, int64_t D, int64_t F, const FfnWeights& w, const FfnFp8& fp8,
                 float* y, FfnSaved* saved, ActivationDtype activations = ActivationDtype::fp32,
                 bool rebuild_a = false);
// One FFN per group (the routed experts of a MoE layer), each as ffn_forward, with each of the
// three layers' GEMMs grouped over them (linear_forward_grouped).
struct FfnGroup {
  const float* x = nullptr;
  int64_t M = 0;
  const FfnWeights* w = nullptr;
  const FfnFp8* fp8 = nullptr;
  float* y = nullptr;
  FfnSaved* saved = nullptr;  // may be nullptr
  const QuantView* xq = nullptr;  // blockwise: x already in 1 x T FP8 tiles (LinearGroup::xq); x unread
  const float* gate = nullptr;    // (M) each row's SwiGLU output scaled by it (FfnSaved::gate)
};
void ffn_forward_grouped(Backend& be, int64_t D, int64_t F, const std::vector<FfnGroup>& groups,
                         ActivationDtype activations = ActivationDtype::fp32, bool rebuild_a = false);

// dx (M, D) written (may be nullptr); weight gradients accumulated (fused: W3's gradient must follow
// W1's in memory, as in the parameter store; asserted); wgrad_later as ffn_backward_grouped's.
void ffn_backward(Backend& be, const FfnSaved& saved, const FfnWeights& w, const float* dy, const FfnFp8& fp8, float* dx,
                  const FfnGrads& g, LaterWork* wgrad_later = nullptr);

// ffn_backward of each group (the routed experts), each layer's dgrad and wgrad GEMMs grouped over them.
struct FfnGradGroup {
  const FfnSaved* saved = nullptr;
  const FfnWeights* w = nullptr;
  const float* dy = nullptr;
  const FfnFp8* fp8 = nullptr;
  float* dx = nullptr;  // may be nullptr
  const FfnGrads* g = nullptr;
  const QuantView* dyq = nullptr;  // blockwise: dy already in 1 x T FP8 tiles (LinearGradGroup::dyq); dy unread
  double* dgate = nullptr;         // (M) written where the forward had gates (FfnSaved::gate)
};
// wgrad_later: the three layers' wgrad GEMMs left to it (linear_backward_grouped), with what they
// read that is made here (a recomputation's W2 input, FP32 layers' pre-activation gradients); the
// groups' saved state and dy the caller keeps until it runs (unless it is detached: its steps own
// copies of what they read).
void ffn_backward_grouped(Backend& be, const std::vector<FfnGradGroup>& groups, LaterWork* wgrad_later = nullptr);

}  // namespace fp8moe
