// A block's attention sublayer on its normed input h1 (N, D), forward and backward, one class per
// kind (model.attention), each with its own weights (resolved once, at construction) and its own
// saved state:
//   GQA  q = RoPE(h1 Wq^T), k = RoPE(h1 Wk^T), v = h1 Wv^T (n_kv_heads shared by the query heads)
//   MLA  DeepSeek-V3's multi-head latent attention: queries through the latent
//        cq = RMSNorm(h1 Wq_a^T) when q_lora_rank > 0 (else h1 Wq^T), keys and values from the
//        latent ckv = RMSNorm([h1 Wkv_a^T]_kv_lora) and one rotary key shared by the heads
//   o = Attention(q, k, v) Wo^T
// Tensor parallelism splits the heads: q, k, v (and MLA's up-projections) are column-parallel, wo
// row-parallel. The forward writes this rank's partial sum of o (the block sums it over the group);
// the backward writes dh1 complete (summed over the group). A new kind is a new class here and a
// line in make_attention.
#pragma once

#include <cstdint>
#include <memory>

#include "model/context.h"
#include "model/linear.h"

namespace fp8moe {

// What an attention forward keeps for its backward.
struct AttentionSaved {
  virtual ~AttentionSaved() = default;
  int64_t B = 0, T = 0;
  virtual int64_t bytes() const = 0;  // activation bytes held (its FP8 copies included)
  // Whether a linear layer reading h1 needs it in FP32 for its backward (else they keep it in FP8
  // and the block frees h1).
  virtual bool needs_h1() const = 0;
};

class Attention {
 public:
  virtual ~Attention() = default;
  // o (B*T, D) written: this rank's partial sum over its heads. h1 must outlive the saved state
  // while needs_h1().
  virtual std::unique_ptr<AttentionSaved> forward(const float* h1, int64_t B, int64_t T, float* o,
                                                  const Pass& pass) = 0;
  // dh1 (B*T, D) written, summed over tensor parallelism; weight gradients accumulated, or left to
  // `weights` (detached; may be nullptr: now).
  virtual void backward(const AttentionSaved& saved, const float* dout, float* dh1, LaterWork* weights) = 0;
};

// Block `layer`'s attention of the configured kind (its parameters named block_prefix + "attn.").
std::unique_ptr<Attention> make_attention(const ModelContext& ctx, int layer);

}  // namespace fp8moe
