// CUDA launchers for kernels/attention.h (causal GQA, FP32). Device memory, queued on `stream`;
// B, T or H may be 0. Query/key (hd) and value (hdv) head sizes at most kAttentionMaxHeadDim.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace fp8moe::cuda {

inline constexpr int64_t kAttentionMaxHeadDim = 256;

// q: (B*T, H, hd); k: (B*T, KVH, hd); v: (B*T, KVH, hdv); out: (B*T, H, hdv); lse: (B, H, T).
void attention_forward(const float* q, const float* k, const float* v, int64_t B, int64_t T, int64_t H, int64_t KVH,
                       int64_t hd, int64_t hdv, float* out, float* lse, cudaStream_t stream);
// dout: (B*T, H, hdv); dq: (B*T, H, hd), dk: (B*T, KVH, hd), dv: (B*T, KVH, hdv), all written.
// delta: (B, H, T) scratch (dO . O per row), which the caller provides and keeps until the launches
// have run.
void attention_backward(const float* q, const float* k, const float* v, const float* out, const float* lse,
                        const float* dout, int64_t B, int64_t T, int64_t H, int64_t KVH, int64_t hd, int64_t hdv,
                        float* dq, float* dk, float* dv, float* delta, cudaStream_t stream);

}  // namespace fp8moe::cuda
