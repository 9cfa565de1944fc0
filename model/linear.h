// A linear layer y = x W^T with its three GEMMs (forward, input gradient, weight gradient) in FP8
// through the configured recipe, or in FP32 when FP8 is off for it. Every pointer is memory of the
// backend `be` (device memory on a GPU); nothing here reads it on the host.
//   x (M, K), W (N, K), y (M, N)
//   forward  y  = x W^T           x: 1xT tiles (or per-tensor), W: TxT blocks (or per-tensor)
//   dgrad    dx = dy W            dy: 1xT tiles (E5M2 per-tensor with format hybrid)
//   wgrad    dW += dy^T x         dy, x: Tx1 tiles, quantized from FP32 (never transposed FP8): x's
//                                 in the forward beside its 1xT tiles, dy's beside dgrad's, each
//                                 from one read of the FP32 tensor (Backend::quantize_tiled_pair)
// The weight is quantized once per optimizer step (WeightCache) and reused by every micro-batch,
// by recomputation and by dgrad. Per-tensor scales and amax values never leave device memory.
#pragma once

#include <functional>

#include <cstdint>
#include <vector>

#include "kernels/backend.h"
#include "model/config.h"

namespace fp8moe {

// One tensor's delayed-scaling state in device memory (kernels/quantize.h's DelayedScaling).
struct DelayedState {
  Tensor history;      // (history_len) amax ring buffer
  Tensor scale;        // (2): [0] the scale the next quantization uses, [1] the one the last used
  int64_t steps = 0;   // amax values recorded (the host counts them: no synchronisation)
  bool empty() const { return history.empty(); }
};
// Delayed-scaling states of one linear layer (checkpointed state).
struct LinearScaling {
  DelayedState x, w, dy;
};

// The same in host form (checkpoints).
struct HostLinearScaling {
  DelayedScaling x, w, dy;
};

// A linear weight's FP8 copy and the optimizer step it was made in.
struct WeightCache {
  QTensor q;
  int64_t step = -1;
};

// What the FP8 GEMMs of one call need beyond the operands.
struct LinearFp8 {
  const Fp8Config* cfg = nullptr;  // nullptr or recipe off: FP32 GEMMs
  LinearScaling* state = nullptr;  // delayed scaling only
  AmaxReduce reduce;               // per-tensor amax (device memory) over the tensor-parallel group (empty: local)
  bool record = true;              // false: quantize, but do not advance delayed-scaling histories
  bool reuse_last_scale = false;   // with record false: the scale the last recorded pass used
                                   // (recomputation), not the one the next pass will use (evaluation)
  bool backward_follows = true;    // false: no backward reads this forward's LinearSaved (an
                                   // evaluation, the first pass of a recomputed block): no wgrad copy
  uint64_t* counts = nullptr;      // device [saturated, underflowed] counters (nullptr: not counted)
  WeightCache* weight = nullptr;   // the step's FP8 weight (nullptr: quantized afresh, e.g. evaluation)
  int64_t step = 0;                // the optimizer step the cache is valid for
  bool enabled() const { return cfg && cfg->recipe != Fp8Recipe::off; }
};

// What forward keeps for backward.
struct LinearSaved {
  LinearSaved() = default;
  LinearSaved(const LinearSaved&) = delete;  // wq may point into own_wq
  LinearSaved& operator=(const LinearSaved&) = delete;
  LinearSaved(LinearSaved&& o) noexcept { *this = std::move(o); }
  LinearSaved& operator=(LinearSaved&& o) noexcept;
  // (M, K) the FP32 input, NOT owned: the caller keeps it alive until backward (the layers share
  // their inputs: q, k and v read one normed x). Only FP32 layers need it: per-tensor recipes read
  // xq, blockwise reads xt (or, with fp8.cache_activations, xq).
  const float* x = nullptr;
  QTensor xq;                   // the input as the forward GEMM used it (FP8 paths)
  QTensor xt;                   // blockwise without cache_activations: the input in T x 1 tiles for wgrad
  const QTensor* wq = nullptr;  // the weight as the forward GEMM used it: the cache or own_wq
  QTensor own_wq;               // the weight quantized for this call alone (no cache)
  // An input the caller quantized (LinearGroup::xq) that the weight gradient reads (per-tensor
  // recipes; blockwise with cache_activations: that 1 x T copy): NOT owned (the caller keeps it
  // until backward), read where xq would be.
  QuantView xq_ext;
  bool has_xq_ext = false;
  int64_t M = 0, K = 0, N = 0;
  bool needs_fp32_input() const { return x != nullptr; }
  // Bytes this layer holds of its own: the FP8 input and its scales (the weight is not an activation).
  int64_t fp8_activation_bytes() const { return (xq.empty() ? 0 : xq.bytes()) + (xt.empty() ? 0 : xt.bytes()); }
};

// y (M, N) written. `saved` may be nullptr (no backward); x must outlive it unless the input is
// cached in FP8 (saved->x == nullptr afterwards).
void linear_forward(Backend& be, const float* x, int64_t M, int64_t K, const float* W, int64_t N, const LinearFp8& fp8,
                    float* y, LinearSaved* saved);

// One layer per group (the experts of a MoE layer): group g is linear_forward(x, M, K, W, N, *fp8,
// y, saved) of its own, with their FP8 GEMMs in one Backend::grouped_gemm_fp8_forward call
// (kernels/grouped_gemm.h).
struct LinearGroup {
  const float* x = nullptr;
  int64_t M = 0;
  const float* W = nullptr;
  const LinearFp8* fp8 = nullptr;
  float* y = nullptr;
  LinearSaved* saved = nullptr;  // may be nullptr
  // x already quantized (the experts' rows, quantized once before their dispatch): blockwise, in
  // the layer's 1 x T tiles; per-tensor recipes, one E4M3 scale for the tensor. The forward GEMM
  // reads it as it is, x is not read (may be nullptr); the weight gradient reads it too
  // (per-tensor) or its T x 1 copy re-tiled from it (blockwise). The layer's own input scaling (a
  // delayed-scaling x history) is not used.
  const QuantView* xq = nullptr;
  // x quantized already by linear_quantize_input into *saved (an FP8 layer's): read from there, x
  // is not read (the caller may have freed it).
  bool x_quantized = false;
};
void linear_forward_grouped(Backend& be, int64_t K, int64_t N, const std::vector<LinearGroup>& groups);
// The FP8 copies of an FP8 group's input that linear_forward_grouped would make of l.x (the same
// bits), made now into *l.saved (required); then the group, with x_quantized set, reads them and
// the caller may free x first (ffn_forward_grouped: each expert's SwiGLU output quantized as it is
// made, so that no grouped call holds every expert's FP32 output at once).
void linear_quantize_input(Backend& be, int64_t K, const LinearGroup& l);

// dx (M, K) written (may be nullptr), dW (N, K) accumulated (now, or by wgrad_later's step:
// linear_backward_grouped).
struct LaterWork;
void linear_backward(Backend& be, const LinearSaved& saved, const float* W, const float* dy, const LinearFp8& fp8,
                     float* dx, float* dW, LaterWork* wgrad_later = nullptr);

// linear_backward of each group, their dgrad GEMMs in one Backend::grouped_gemm_fp8_dgrad call and
// their wgrad GEMMs in one grouped_gemm_fp8_wgrad call. Every group's layer has the same K and N.
struct LinearGradQuant {  // quantize_output_grad's copies of a gradient
  QTensor q, t;
};
struct LinearGradGroup {
  const LinearSaved* saved = nullptr;
  const float* W = nullptr;
  const float* dy = nullptr;
  const LinearFp8* fp8 = nullptr;
  float* dx = nullptr;  // may be nullptr
  float* dW = nullptr;
  // dy already quantized (dispatched so): blockwise in 1 x T tiles, per-tensor recipes one scale in
  // the layer's gradient format. dgrad reads it as it is, dy is not read (may be nullptr); wgrad
  // reads it too (per-tensor) or its T x 1 copy re-tiled from it (blockwise).
  const QuantView* dyq = nullptr;
  // The caller's tensor holding dy, handed over: an FP8 layer frees it once dy is quantized, so that
  // a grouped call does not hold every group's FP32 gradient through its GEMMs (nullptr: kept).
  Tensor* dy_owned = nullptr;
  // dy's FP8 copies made ahead by quantize_output_grad and handed over (dy is not read; may be
  // nullptr): the same bits as quantizing here, for a caller that frees each group's FP32 dy as
  // soon as it has its copies, before the next group's dy exists.
  LinearGradQuant* dy_ahead = nullptr;
};
// Work a backward leaves for later: the weight-gradient GEMMs, run behind the expert exchange of
// the experts' input gradients (model/moe.cpp), or (detached) by a later pipeline op: the
// zero-bubble split of a backward into its input part (B) and its weight part (W). run() does the
// steps in the order they were left and frees what they held.
struct LaterWork {
  // false: the steps read the caller's state (saved inputs, gradients), which it keeps until they
  // have run; true: each step owns copies of what it reads (the FP8 inputs and gradients, or the
  // FP32 ones of an FP32 layer), made when it is left, and the caller's state may go.
  bool detached = false;
  std::vector<std::function<void()>> steps;
  void run() {
    for (auto& step : steps) step();
    steps.clear();
  }
};
// wgrad_later: the wgrad GEMMs (with dy's FP8 copies they read, made here) left to it, the same
// GEMMs on the same operands (the same bits); what the groups point at (saved, dy, dyq) the caller
// keeps until it runs, unless it is detached.
void linear_backward_grouped(Backend& be, const std::vector<LinearGradGroup>& groups, LaterWork* wgrad_later = nullptr);
// The output gradient's FP8 copies that linear_backward_grouped makes of l.dy (an FP8 layer's):
// blockwise its 1 x T tiles (dgrad; only where l.dx is wanted) and its T x 1 tiles (wgrad), from
// one read; a per-tensor recipe its one copy in the gradient format (delayed scaling's amax
// recorded, as there).
void quantize_output_grad(Backend& be, const LinearGradGroup& l, LinearGradQuant* out);

// The GEMMs outside the linear layers (the MoE router, the head, eh_proj), by train.hp_gemm: fp32:
// sgemm; bf16 (DeepSeek-V3's): x, dy and W rounded to BF16 (W's copy made for the call), FP32
// accumulation and outputs (Backend::gemm_bf16). x (M, K), W (N, K), y and dy (M, N).
// y = x W^T.
void hp_forward(Backend& be, GemmDtype t, const float* x, int64_t M, int64_t K, const float* W, int64_t N, float* y);
// dx = dy W + beta_dx dx (dx may be nullptr: none), dW += dy^T x (now, or by wgrad_later's step,
// which must be detached: it keeps the BF16 copies of dy and x the GEMM reads, or FP32 copies).
void hp_backward(Backend& be, GemmDtype t, const float* dy, int64_t M, int64_t N, const float* x, int64_t K,
                 const float* W, float* dx, float beta_dx, float* dW, LaterWork* wgrad_later = nullptr);

// x (rows, cols) in a blockwise recipe's 1 x T tiles (E4M3, its scale options): the operand a
// layer's forward GEMM reads as it is (LinearGroup::xq); quantizations counted in `counts` (may be
// nullptr).
QTensor quantize_1xT(Backend& be, const float* x, int64_t rows, int64_t cols, const Fp8Config& c, uint64_t* counts);
// The FP8 format of a recipe's gradients: E5M2 under fp8.format hybrid, else E4M3.
Fp8Dtype grad_dtype(const Fp8Config& c);
// Per-tensor current scaling of x into *out (allocated: a per-tensor QTensor of its shape and
// dtype): *scale (1 value) from x's amax, reduced by `reduce` where given (the tensor-parallel
// group, or the expert exchange's), with c's margin and power-of-two rule; or, where *scale holds
// one already (a recomputation), that one. counts may be nullptr (not counted).
void quantize_current(Backend& be, const float* x, const Fp8Config& c, const AmaxReduce& reduce, uint64_t* counts,
                      Tensor* scale, QTensor* out);

// train.recompute selective: the input of a kept layer that its forward dropped (W2's, the SwiGLU
// output), made again in backward as x: *out gets `from`'s shapes and FP8 weight and x as the
// forward kept it (x itself for an FP32 layer, which must then outlive *out; else its FP8 copy,
// quantized with the forward's scale). fp8: the layer's context of the backward.
void linear_reinput(Backend& be, const LinearSaved& from, const float* x, const LinearFp8& fp8, LinearSaved* out);

// train.activations bf16's kept tensors (model/context.h): t's FP32 values, BF16 exactly after a
// rounding point, replaced by their BF16 copy (half the bytes, nothing lost); and the FP32 values
// of a kept tensor, its own (FP32) or its BF16 copy widened into *tmp.
void stash_bf16(Backend& be, Tensor* t);
const float* unstash(Backend& be, const Tensor& t, Tensor* tmp);

// Delayed-scaling state in device memory from its host form and back (checkpoints, tests).
DelayedScaling delayed_to_host(Backend& be, const DelayedState& s);
DelayedState delayed_from_host(Backend& be, const DelayedScaling& s);

}  // namespace fp8moe
