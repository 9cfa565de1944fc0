// Causal grouped-query attention with softmax in FP32 (row sums in double on the CPU): query head
// h reads kv head h / (H / KVH).
//   q, out: (B*T, H, hd); k, v: (B*T, KVH, hd); lse: (B, H, T) log-sum-exp of each score row,
//   saved so that backward recomputes the probabilities instead of storing (T, T) per head.
// CPU here; CUDA in kernels/cuda/attention.cu (one warp per row, online softmax: the reference
// that a fused kernel will be checked against).
#pragma once

#include <cstdint>

namespace fp8moe::cpu {

void attention_forward(const float* q, const float* k, const float* v, int64_t B, int64_t T, int64_t H, int64_t KVH,
                       int64_t hd, float* out, float* lse);
// dq: (B*T, H, hd), dk, dv: (B*T, KVH, hd), all written.
void attention_backward(const float* q, const float* k, const float* v, const float* out, const float* lse,
                        const float* dout, int64_t B, int64_t T, int64_t H, int64_t KVH, int64_t hd, float* dq,
                        float* dk, float* dv);

}  // namespace fp8moe::cpu
