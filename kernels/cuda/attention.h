// CUDA launchers for kernels/attention.h (causal GQA, FP32). Device memory, queued on `stream`;
// B, T or H may be 0. head_dim at most kAttentionMaxHeadDim.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace fp8moe::cuda {

inline constexpr int64_t kAttentionMaxHeadDim = 256;

// q, out: (B*T, H, hd); k, v: (B*T, KVH, hd); lse: (B, H, T).
void attention_forward(const float* q, const float* k, const float* v, int64_t B, int64_t T, int64_t H, int64_t KVH,
                       int64_t hd, float* out, float* lse, cudaStream_t stream);
// dq: (B*T, H, hd), dk, dv: (B*T, KVH, hd), all written. delta: (B, H, T) scratch (dO . O per row),
// which the caller provides and keeps until the launches have run.
void attention_backward(const float* q, const float* k, const float* v, const float* out, const float* lse,
                        const float* dout, int64_t B, int64_t T, int64_t H, int64_t KVH, int64_t hd, float* dq,
                        float* dk, float* dv, float* delta, cudaStream_t stream);

}  // namespace fp8moe::cuda
