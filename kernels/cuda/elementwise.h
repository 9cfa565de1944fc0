// CUDA launchers for kernels/elementwise.h. Device memory, queued on `stream`; n may be 0.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace fp8moe::cuda {
// a, b, out: (n); out may be a or b.
void add(const float* a, const float* b, float* out, int64_t n, cudaStream_t stream);
// BF16 (bit patterns) from FP32, rounded to nearest even (kernels/fp8.h's bf16_encode), and back
// (exact): the operands of cuDNN's fused attention (kernels/cuda/attention_cudnn.h), and
// kernels/elementwise.h's BF16 conversions (Backend::to_bf16 ...).
void to_bf16(const float* x, uint16_t* y, int64_t n, cudaStream_t stream);
void from_bf16(const uint16_t* x, float* y, int64_t n, cudaStream_t stream);
// y = x rounded to BF16, as FP32 (y may be x).
void round_bf16(const float* x, float* y, int64_t n, cudaStream_t stream);
}  // namespace fp8moe::cuda
