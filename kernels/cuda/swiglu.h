// CUDA launchers for kernels/swiglu.h. Device memory, queued on `stream`; n may be 0.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace fp8moe::cuda {
// a, b, y: (n)
void swiglu_forward(const float* a, const float* b, float* y, int64_t n, cudaStream_t stream);
// a, b, dy, da, db: (n)
void swiglu_backward(const float* a, const float* b, const float* dy, float* da, float* db, int64_t n,
                     cudaStream_t stream);
}  // namespace fp8moe::cuda
