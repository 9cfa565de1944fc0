// Launch geometry and the launch-error check shared by the kernels/cuda/<op>.cu launchers.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/check.h"
#include "kernels/cuda/block_reduce.cuh"

namespace fp8moe::cuda {

// Grid-stride loops cap their grids here: enough blocks to fill an H200 many times over.
constexpr int64_t kMaxGridStrideBlocks = 65535;
// gridDim.x limit of one launch (one block per row, tile, token, ...).
constexpr int64_t kMaxGridX = (int64_t(1) << 31) - 1;

// Blocks of `threads` for a grid-stride loop over n elements (at least 1).
inline unsigned grid_for(int64_t n, int threads = kBlockThreads) {
  const int64_t want = (n + threads - 1) / threads;
  return static_cast<unsigned>(want < kMaxGridStrideBlocks ? (want > 0 ? want : 1) : kMaxGridStrideBlocks);
}

// One block per item (row, tile): fatal beyond the launch limit.
inline unsigned grid_of(int64_t items, const char* what) {
  FP8MOE_ASSERT(items >= 1 && items <= kMaxGridX, what, ": ", items, " blocks for one launch");
  return static_cast<unsigned>(items);
}

// Blocks of kBlockThreads holding one warp per item.
inline unsigned warps_grid(int64_t items, const char* what) {
  return grid_of((items + kWarpsPerBlock - 1) / kWarpsPerBlock, what);
}

// Every launcher ends with this: a bad configuration is reported where it was launched.
inline void check_launch() { CUDA_CHECK(cudaGetLastError()); }

}  // namespace fp8moe::cuda

#define FP8MOE_GRID_STRIDE(i, n) \
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < (n); i += int64_t(gridDim.x) * blockDim.x)
