// Causal grouped-query attention with softmax in FP32 (on the CPU: FP32 exponentials from
// kernels/cpu/vmath.h, row sums in double): query head
// h reads kv head h / (H / KVH). The value head size hdv may differ from the query/key head size
// hd (DeepSeek-V3's multi-head latent attention: hd = qk_nope + qk_rope = 192, hdv = 128); the
// scores are scaled by 1/sqrt(hd) either way.
//   q: (B*T, H, hd); k: (B*T, KVH, hd); v: (B*T, KVH, hdv); out: (B*T, H, hdv);
//   lse: (B, H, T) log-sum-exp of each score row, saved so that backward recomputes the
//   probabilities instead of storing (T, T) per head.
// CPU here; CUDA in kernels/cuda/attention.cu (one warp per row, online softmax: the reference
// that the fused kernel, kernels/cuda/attention_cudnn.h, is checked against).
#pragma once

#include <cstdint>

namespace fp8moe::cpu {

void attention_forward(const float* q, const float* k, const float* v, int64_t B, int64_t T, int64_t H, int64_t KVH,
                       int64_t hd, int64_t hdv, float* out, float* lse);
// dout: (B*T, H, hdv); dq: (B*T, H, hd), dk: (B*T, KVH, hd), dv: (B*T, KVH, hdv), all written.
void attention_backward(const float* q, const float* k, const float* v, const float* out, const float* lse,
                        const float* dout, int64_t B, int64_t T, int64_t H, int64_t KVH, int64_t hd, int64_t hdv,
                        float* dq, float* dk, float* dv);

// The same on BF16 operands (train.activations bf16), as a fused flash-attention kernel computes
// them (cuDNN's SDPA on the GPU, kernels/cuda/attention_cudnn.h): q, k and v in BF16; the scores
// from BF16 products with FP32 sums (kernels/gemm_fp8.h gemm_bf16), the softmax as above; the
// probabilities rounded to BF16 before they weight the values. The backward rounds dout to BF16
// (a fused kernel's input), takes sum_j P_ij dP_ij as the rounded dout's row times out's, and
// rounds dS = P (dP - that) and P to BF16 for the GEMMs of dq, dk and dv; sums in FP32 throughout.
void attention_forward_bf16(const uint16_t* q, const uint16_t* k, const uint16_t* v, int64_t B, int64_t T, int64_t H,
                            int64_t KVH, int64_t hd, int64_t hdv, float* out, float* lse);
void attention_backward_bf16(const uint16_t* q, const uint16_t* k, const uint16_t* v, const float* out,
                             const float* lse, const float* dout, int64_t B, int64_t T, int64_t H, int64_t KVH,
                             int64_t hd, int64_t hdv, float* dq, float* dk, float* dv);

}  // namespace fp8moe::cpu
