// CUDA launchers for kernels/elementwise.h. Device memory, queued on `stream`; n may be 0.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace fp8moe::cuda {
// a, b, out: (n); out may be a or b.
void add(const float* a, const float* b, float* out, int64_t n, cudaStream_t stream);
}  // namespace fp8moe::cuda
