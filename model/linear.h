// A linear layer y = x W^T with its three GEMMs (forward, input gradient, weight gradient) in FP8
// through the configured recipe, or in FP32 when FP8 is off for it.
//   x (M, K), W (N, K), y (M, N)
//   forward  y  = x W^T           x: 1xT tiles (or per-tensor), W: TxT blocks (or per-tensor)
//   dgrad    dx = dy W            dy: 1xT tiles (E5M2 per-tensor with format hybrid)
//   wgrad    dW += dy^T x         dy, x: Tx1 tiles, quantized again from FP32 (never transposed FP8)
#pragma once

#include <map>
#include <string>
#include <vector>

#include "kernels/gemm_fp8.h"
#include "model/config.h"

namespace fp8moe {

// Delayed-scaling histories of one linear layer (checkpointed state).
struct LinearScaling {
  DelayedScaling x, w, dy;
};

// What the FP8 GEMMs of one call need beyond the operands.
struct LinearFp8 {
  const Fp8Config* cfg = nullptr;  // nullptr or recipe off: FP32 GEMMs
  LinearScaling* state = nullptr;  // delayed scaling only
  AmaxReduce reduce;               // per-tensor amax over the tensor-parallel group (empty: local)
  bool record = true;              // false: quantize, but do not advance delayed-scaling histories
  bool reuse_last_scale = false;   // with record false: the scale the last recorded pass used
                                   // (recomputation), not the one the next pass will use (evaluation)
  int64_t* saturated = nullptr;    // when set, counts elements clamped to the FP8 maximum
  int64_t* underflowed = nullptr;  // when set, counts non-zero elements that became 0 in FP8
  bool enabled() const { return cfg && cfg->recipe != Fp8Recipe::off; }
};

// What forward keeps for backward: the input and the quantized weight of this step.
struct LinearSaved {
  // (M, K) the FP32 input, NOT owned: the caller keeps it alive until backward (the layers share
  // their inputs: q, k and v read one normed x). nullptr when backward reads only xq: per-tensor
  // recipes always, blockwise with fp8.cache_activations.
  const float* x = nullptr;
  QuantTensor wq;  // the weight as the forward GEMM used it (FP8 paths)
  QuantTensor xq;  // the input as the forward GEMM used it (FP8 paths)
  int64_t M = 0, K = 0, N = 0;
  bool needs_fp32_input() const { return x != nullptr; }
  // Bytes this layer holds of its own: the FP8 input and its scales (the weight is not an activation).
  int64_t fp8_activation_bytes() const { return int64_t(xq.data.size() + xq.scale_inv.size() * sizeof(float)); }
};

// y (M, N) written. `saved` may be nullptr (no backward); x must outlive it unless the input is
// cached in FP8 (saved->x == nullptr afterwards).
void linear_forward(const float* x, int64_t M, int64_t K, const float* W, int64_t N, const LinearFp8& fp8, float* y,
                    LinearSaved* saved);

// dx (M, K) written (may be nullptr), dW (N, K) accumulated.
void linear_backward(const LinearSaved& saved, const float* W, const float* dy, const LinearFp8& fp8, float* dx,
                     float* dW);

}  // namespace fp8moe
