// Element-wise ops on the GPU (kernels/elementwise.h).
//
// Against kernels/cpu/elementwise.cpp: bitwise (one IEEE addition per element).
#include "kernels/cuda/elementwise.h"
#include "kernels/cuda/launch.cuh"
#include "kernels/elem.h"

namespace fp8moe::cuda {
namespace {

// NOTE: no __restrict__: out may alias a or b (each element is read before it is written).
__global__ void add_kernel(const float* a, const float* b, float* out, int64_t n) {
  FP8MOE_GRID_STRIDE(i, n) out[i] = add_rn(a[i], b[i]);
}

}  // namespace

void add(const float* a, const float* b, float* out, int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  add_kernel<<<grid_for(n), kBlockThreads, 0, stream>>>(a, b, out, n);
  check_launch();
}

}  // namespace fp8moe::cuda
