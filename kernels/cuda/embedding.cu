// Token embedding on the GPU (kernels/embedding.h).
//
// Against kernels/cpu/embedding.cpp: bitwise. The forward copies. The backward sorts the tokens by
// id (CUB's radix sort of (id, token) pairs: stable, so each id's tokens stay in token order), and
// a thread per (id, column) adds that id's rows in token order onto the table's: the CPU's order,
// with the IEEE add, in parallel over the distinct ids and the columns, the same bits on every run.
#include <cub/device/device_radix_sort.cuh>

#include "kernels/cuda/embedding.h"
#include "kernels/cuda/launch.cuh"
#include "kernels/elem.h"

namespace fp8moe::cuda {
namespace {

__global__ void embed_fwd_kernel(const float* __restrict__ table, const int32_t* __restrict__ ids, int64_t N,
                                 int64_t D, int64_t v0, int64_t Vl, float* __restrict__ out) {
  FP8MOE_GRID_STRIDE(e, N * D) {
    const int64_t t = int64_t(ids[e / D]) - v0;
    out[e] = t >= 0 && t < Vl ? table[t * D + e % D] : 0.0f;
  }
}

__global__ void iota_kernel(int32_t* __restrict__ v, int64_t n) {
  FP8MOE_GRID_STRIDE(i, n) v[i] = int32_t(i);
}

// Grid: column blocks x position blocks (grid-stride over the sorted positions). A thread at the
// first position of an id's run adds the run's rows, in token order, to the table's row.
__global__ void embed_bwd_runs_kernel(const float* __restrict__ dout, const int32_t* __restrict__ sorted_ids,
                                      const int32_t* __restrict__ tokens, int64_t N, int64_t D, int64_t v0,
                                      int64_t Vl, float* __restrict__ dtable) {
  const int64_t d = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (d >= D) return;
  for (int64_t i = blockIdx.y; i < N; i += gridDim.y) {
    const int32_t id = sorted_ids[i];
    if (i > 0 && sorted_ids[i - 1] == id) continue;
    const int64_t t = int64_t(id) - v0;
    if (t < 0 || t >= Vl) continue;
    float acc = dtable[t * D + d];
    for (int64_t j = i; j < N && sorted_ids[j] == id; ++j) acc = add_rn(acc, dout[int64_t(tokens[j]) * D + d]);
    dtable[t * D + d] = acc;
  }
}

constexpr size_t kScratchAlign = 256;
size_t align_up(size_t n) { return (n + kScratchAlign - 1) / kScratchAlign * kScratchAlign; }
size_t sort_temp_bytes(int64_t N) {
  size_t bytes = 0;
  CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, bytes, static_cast<const int32_t*>(nullptr),
                                             static_cast<int32_t*>(nullptr), static_cast<const int32_t*>(nullptr),
                                             static_cast<int32_t*>(nullptr), N));
  return bytes;
}

}  // namespace

void embedding_forward(const float* table, const int32_t* ids, int64_t N, int64_t D, int64_t v0, int64_t Vl,
                       float* out, cudaStream_t stream) {
  if (N * D == 0) return;
  embed_fwd_kernel<<<grid_for(N * D), kBlockThreads, 0, stream>>>(table, ids, N, D, v0, Vl, out);
  check_launch();
}

size_t embedding_backward_scratch_bytes(int64_t N) {
  if (N == 0) return 0;
  return 3 * align_up(size_t(N) * sizeof(int32_t)) + align_up(sort_temp_bytes(N)) + kScratchAlign;
}

void embedding_backward(const float* dout, const int32_t* ids, int64_t N, int64_t D, int64_t v0, int64_t Vl,
                        float* dtable, void* scratch, cudaStream_t stream) {
  if (N * D == 0 || Vl == 0) return;
  FP8MOE_ASSERT(N < (int64_t(1) << 31), "embedding_backward: ", N, " tokens (token indices are int32)");
  // Carve the scratch: sorted ids, the token indices before and after the sort, CUB's temporaries.
  auto* base = reinterpret_cast<unsigned char*>(
      (reinterpret_cast<uintptr_t>(scratch) + kScratchAlign - 1) / kScratchAlign * kScratchAlign);
  const size_t ints = align_up(size_t(N) * sizeof(int32_t));
  auto* sorted_ids = reinterpret_cast<int32_t*>(base);
  auto* tokens_in = reinterpret_cast<int32_t*>(base + ints);
  auto* tokens = reinterpret_cast<int32_t*>(base + 2 * ints);
  void* temp = base + 3 * ints;
  size_t temp_bytes = sort_temp_bytes(N);
  iota_kernel<<<grid_for(N), kBlockThreads, 0, stream>>>(tokens_in, N);
  check_launch();
  CUDA_CHECK(cub::DeviceRadixSort::SortPairs(temp, temp_bytes, ids, sorted_ids, tokens_in, tokens, N, 0,
                                             int(sizeof(int32_t) * 8), stream));
  const int64_t column_blocks = (D + kBlockThreads - 1) / kBlockThreads;
  const int64_t position_blocks = N < 65535 ? N : 65535;
  FP8MOE_ASSERT(column_blocks <= (int64_t(1) << 31) - 1, "embedding_backward: ", D, " columns");
  embed_bwd_runs_kernel<<<dim3(unsigned(column_blocks), unsigned(position_blocks)), kBlockThreads, 0, stream>>>(
      dout, sorted_ids, tokens, N, D, v0, Vl, dtable);
  check_launch();
}

}  // namespace fp8moe::cuda
