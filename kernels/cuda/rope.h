// CUDA launcher for kernels/rope.h. Device memory, queued on `stream`; empty sizes do nothing.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace fp8moe::cuda {

// hd elements (even) of each head of x rotated in place, head h of row r at x + (r heads + h)
// head_stride (head_stride >= hd; = hd: x is (B*T, heads, hd)); cs, sn: (T, hd/2), the table of
// cpu::rope_table.
void rope(float* x, int64_t B, int64_t T, int64_t heads, int64_t hd, const float* cs, const float* sn,
          int64_t head_stride, cudaStream_t stream);

}  // namespace fp8moe::cuda
