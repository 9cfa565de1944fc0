// SwiGLU on the GPU: the element functions of kernels/swiglu.h in grid-stride loops.
//
// Against kernels/cpu/swiglu.cpp: close. The same source runs on both sides, but the device expf
// differs from glibc's by up to 2 ulp and nvcc fuses its multiply-adds (1 + a (1 - s) cancels near
// a = -1.28), so results agree to rounding relative to the size of the terms, not bitwise.
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/swiglu.h"
#include "kernels/swiglu.h"

namespace fp8moe::cuda {
namespace {

__global__ void swiglu_forward_kernel(const float* __restrict__ a, const float* __restrict__ b,
                                      float* __restrict__ y, int64_t n) {
  FP8MOE_GRID_STRIDE(i, n) y[i] = swiglu_forward_elem(a[i], b[i]);
}

__global__ void swiglu_backward_kernel(const float* __restrict__ a, const float* __restrict__ b,
                                       const float* __restrict__ dy, float* __restrict__ da,
                                       float* __restrict__ db, int64_t n) {
  FP8MOE_GRID_STRIDE(i, n) swiglu_backward_elem(a[i], b[i], dy[i], &da[i], &db[i]);
}

}  // namespace

void swiglu_forward(const float* a, const float* b, float* y, int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  swiglu_forward_kernel<<<grid_for(n), kBlockThreads, 0, stream>>>(a, b, y, n);
  check_launch();
}

void swiglu_backward(const float* a, const float* b, const float* dy, float* da, float* db, int64_t n,
                     cudaStream_t stream) {
  if (n == 0) return;
  swiglu_backward_kernel<<<grid_for(n), kBlockThreads, 0, stream>>>(a, b, dy, da, db, n);
  check_launch();
}

}  // namespace fp8moe::cuda
