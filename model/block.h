// One transformer block on this rank, forward and backward:
//   x_mid = x + Attention(RMSNorm(x));  out = x_mid + FFN(RMSNorm(x_mid))
// FFN is a dense SwiGLU MLP in the first `first_dense_layers` blocks and an MoE after them (the
// multi-token prediction modules' blocks too). Its parameters are resolved once, when it is built;
// a pass (model/fp8_state.h) says how its FP8 linear layers quantize.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "model/attention.h"
#include "model/context.h"
#include "model/moe.h"

namespace fp8moe {

// A SwiGLU FFN's three linear layers.
struct FfnParams {
  LinearWeight w1, w3, w2;
  FfnParams() = default;
  FfnParams(const Fp8State& fp8, const std::string& prefix);  // prefix + "w1" ...
  FfnWeights weights() const { return {w1.w, w3.w, w2.w}; }
  FfnGrads grads() const { return {w1.g, w3.g, w2.g}; }
  FfnFp8 fp8(Fp8State& state, const Pass& pass) const;
};

// One block's forward state.
struct BlockSaved {
  const float* x = nullptr;  // (N, D) block input, held by the stage run
  // Or, for a kept block's backward, the stage run's copy of it (FP32 or BF16), widened only for
  // the attention norm's backward, the last op to read it.
  const Tensor* x_kept = nullptr;
  Tensor h1, rstd1;          // attention norm output (N, D) (freed when its layers keep it in FP8), (N)
  std::unique_ptr<AttentionSaved> attn;
  Tensor x_mid;              // (N, D) after the attention residual (BF16 once kept, train.activations bf16)
  Tensor h2, rstd2;          // FFN norm output (likewise where no FP32 linear layer reads it), (N)
  FfnSaved dense;
  MoeSaved moe;
  int64_t B = 0, T = 0;
  bool kept = false;         // false: recomputed in backward

  // Activation bytes held for backward, the block input included (x_value_bytes: 4, or 2 where the
  // stage keeps it in BF16, train.activations bf16).
  int64_t bytes(int64_t D, int64_t x_value_bytes = 4) const;
  // After a training forward: `kept`, or everything dropped but B, T, the MoE routing and its gate
  // rows (the block is recomputed in backward with the forward's routing: no synchronisation or
  // gate exchange of its own).
  void finish(bool kept);
};

class Block {
 public:
  // recomputed: train.recompute drops this block's state after a training forward and runs the
  // forward again before its backward.
  Block(const ModelContext& ctx, int layer, bool recomputed);
  int layer() const { return layer_; }
  bool is_moe() const { return layer_ >= ctx_.model.first_dense_layers; }
  bool recomputed() const { return recomputed_; }
  // The pass of a training forward of this block (its state kept for the backward or not).
  Pass training() const { return Pass::training(!recomputed_); }

  // out (N, D) written; *aux (device, may be nullptr): the MoE layer's auxiliary loss. x must
  // outlive `s`. When s->moe.routing is filled (a recomputation), it is used instead of routing.
  void forward(const float* x, int64_t B, int64_t T, float* out, BlockSaved* s, const Pass& pass, double* aux);
  // dx (N, D) written (it may be dout: dout is read before dx is written); weight gradients
  // accumulated. aux_grad_scale: the aux loss's gradient weight. weights (detached; may be
  // nullptr): the linear layers' weight-gradient GEMMs left to it (the zero-bubble split), with
  // copies of what they read; the norms' and the router's weight gradients stay here.
  // Frees each part of s once it has been read: the FFN's or MoE layer's, the FFN norm's input and
  // output before the attention's backward (s is done with when this returns).
  void backward(BlockSaved& s, const float* dout, float* dx, float aux_grad_scale, LaterWork* weights = nullptr);
  // After a training forward, the state a recomputed block drops (BlockSaved::finish); before its
  // backward, that recomputation: its forward again, with the first pass's scales, FP8 weights and
  // routing, advancing no history.
  void finish(BlockSaved* s) const { s->finish(!recomputed_); }
  void recompute_if_dropped(const float* x, BlockSaved* s);

 private:
  const ModelContext& ctx_;
  int layer_;
  bool recomputed_;
  Weight attn_norm_, ffn_norm_;
  // A norm's backward of its input x (FP32), or, where x is nullptr, of the kept copy (FP32, or
  // BF16 read as it is): dx (N, D) written, the norm's weight gradient accumulated.
  void norm_backward(const float* x, const Tensor* kept, const Weight& norm, const float* rstd, const float* dy,
                     int64_t N, float* dx) const;
  std::unique_ptr<Attention> attn_;
  FfnParams dense_;                                // dense blocks
  MoeWeights moe_{};                               // MoE blocks: this rank's experts
  MoeGrads moe_grads_{};
  FfnParams shared_;
  std::vector<FfnParams> experts_;
  MoeFp8 moe_fp8(const Pass& pass) const;
};

}  // namespace fp8moe
