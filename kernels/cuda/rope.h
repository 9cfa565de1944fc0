// CUDA launcher for kernels/rope.h. Device memory, queued on `stream`; empty sizes do nothing.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace fp8moe::cuda {

// x: (B*T, heads, hd) rotated in place; cs, sn: (T, hd/2), the table of cpu::rope_table (hd even).
void rope(float* x, int64_t B, int64_t T, int64_t heads, int64_t hd, const float* cs, const float* sn,
          cudaStream_t stream);

}  // namespace fp8moe::cuda
