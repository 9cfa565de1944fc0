// Element-wise ops on the GPU (kernels/elementwise.h).
//
// Against kernels/cpu/elementwise.cpp: bitwise (one IEEE addition per element).
#include "kernels/cuda/elementwise.h"
#include "kernels/cuda/launch.cuh"
#include "kernels/elem.h"
#include "kernels/fp8.h"

namespace fp8moe::cuda {
namespace {

// NOTE: no __restrict__: out may alias a or b (each element is read before it is written).
__global__ void add_kernel(const float* a, const float* b, float* out, int64_t n) {
  FP8MOE_GRID_STRIDE(i, n) out[i] = add_rn(a[i], b[i]);
}

__global__ void to_bf16_kernel(const float* __restrict__ x, uint16_t* __restrict__ y, int64_t n) {
  FP8MOE_GRID_STRIDE(i, n) y[i] = bf16_encode(x[i]);
}

__global__ void from_bf16_kernel(const uint16_t* __restrict__ x, float* __restrict__ y, int64_t n) {
  FP8MOE_GRID_STRIDE(i, n) y[i] = bf16_decode(x[i]);
}

// NOTE: no __restrict__: y may be x.
__global__ void round_bf16_kernel(const float* x, float* y, int64_t n) {
  FP8MOE_GRID_STRIDE(i, n) y[i] = bf16_decode(bf16_encode(x[i]));
}

}  // namespace

void round_bf16(const float* x, float* y, int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  round_bf16_kernel<<<grid_for(n), kBlockThreads, 0, stream>>>(x, y, n);
  check_launch();
}

void to_bf16(const float* x, uint16_t* y, int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  to_bf16_kernel<<<grid_for(n), kBlockThreads, 0, stream>>>(x, y, n);
  check_launch();
}

void from_bf16(const uint16_t* x, float* y, int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  from_bf16_kernel<<<grid_for(n), kBlockThreads, 0, stream>>>(x, y, n);
  check_launch();
}

void add(const float* a, const float* b, float* out, int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  add_kernel<<<grid_for(n), kBlockThreads, 0, stream>>>(a, b, out, n);
  check_launch();
}

}  // namespace fp8moe::cuda
