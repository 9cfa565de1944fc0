// CUDA launchers for kernels/rmsnorm.h. All pointers are device memory; every launch is queued on
// `stream`; N or D may be 0 (nothing is written).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace fp8moe::cuda {

// x: (N, D), w: (D) -> y: (N, D), rstd: (N).
void rmsnorm_forward(const float* x, const float* w, int64_t N, int64_t D, float eps, float* y, float* rstd,
                     cudaStream_t stream);
// x, dy: (N, D), w: (D), rstd: (N) -> dx: (N, D) written, dw: (D) ACCUMULATED in the order of
// kernels/rmsnorm.h; dw_partials: scratch of rmsnorm_dw_chunks(N) x D floats.
void rmsnorm_backward(const float* x, const float* w, const float* rstd, const float* dy, int64_t N, int64_t D,
                      float* dx, float* dw, float* dw_partials, cudaStream_t stream);
// The same with x in BF16, widened in registers.
void rmsnorm_forward_bf16(const uint16_t* x, const float* w, int64_t N, int64_t D, float eps, float* y, float* rstd,
                          cudaStream_t stream);
void rmsnorm_backward_bf16(const uint16_t* x, const float* w, const float* rstd, const float* dy, int64_t N, int64_t D,
                           float* dx, float* dw, float* dw_partials, cudaStream_t stream);

}  // namespace fp8moe::cuda
