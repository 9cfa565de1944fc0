#include "kernels/check.h"
#include "kernels/cuda/block_reduce.cuh"  // kBlockThreads
#include "kernels/cuda/swiglu.h"
#include "kernels/swiglu.h"

namespace fp8moe::cuda {
namespace {
constexpr int kThreads = kBlockThreads;

// Grid-stride loops: any n fits a bounded grid.
__global__ void swiglu_forward_kernel(const float* __restrict__ a, const float* __restrict__ b,
                                      float* __restrict__ y, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    y[i] = swiglu_forward_elem(a[i], b[i]);
}

__global__ void swiglu_backward_kernel(const float* __restrict__ a, const float* __restrict__ b,
                                       const float* __restrict__ dy, float* __restrict__ da,
                                       float* __restrict__ db, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    swiglu_backward_elem(a[i], b[i], dy[i], &da[i], &db[i]);
}

unsigned blocks_for(int64_t n) {
  const int64_t want = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(want < 65535 ? want : 65535);
}
}  // namespace

void swiglu_forward(const float* a, const float* b, float* y, int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  swiglu_forward_kernel<<<blocks_for(n), kThreads, 0, stream>>>(a, b, y, n);
  CUDA_CHECK(cudaGetLastError());
}

void swiglu_backward(const float* a, const float* b, const float* dy, float* da, float* db, int64_t n,
                     cudaStream_t stream) {
  if (n == 0) return;
  swiglu_backward_kernel<<<blocks_for(n), kThreads, 0, stream>>>(a, b, dy, da, db, n);
  CUDA_CHECK(cudaGetLastError());
}

}  // namespace fp8moe::cuda
