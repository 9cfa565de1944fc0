// Block-wide reductions for the CUDA kernels (one copy: quantize.cu and ops.cu use it). Every thread
// of a block of exactly kBlockThreads must call them (they synchronise); all get the result. The
// tree is fixed, so a kernel gives the same bits on every run.
#pragma once

#include <cstdint>

namespace fp8moe::cuda {

// The one block size of the elementwise and reduction kernels (quantize.cu, ops.cu, swiglu.cu).
constexpr int kBlockThreads = 256;
// block_reduce keeps one partial per warp and folds them in the first warp.
static_assert(kBlockThreads % 32 == 0 && kBlockThreads / 32 <= 32, "block_reduce needs whole warps, at most 32 of them");

// op(a, b) combines two values; identity is its neutral element (the inactive lanes' value).
template <class T, class Op>
__device__ T block_reduce(T v, Op op, T identity) {
  __shared__ T part[kBlockThreads / 32];
  for (int o = 16; o > 0; o /= 2) v = op(v, __shfl_xor_sync(0xFFFFFFFFu, v, o));
  if ((threadIdx.x & 31) == 0) part[threadIdx.x / 32] = v;
  __syncthreads();
  if (threadIdx.x < 32) {
    v = threadIdx.x < kBlockThreads / 32 ? part[threadIdx.x] : identity;
    for (int o = 16; o > 0; o /= 2) v = op(v, __shfl_xor_sync(0xFFFFFFFFu, v, o));
    if (threadIdx.x == 0) part[0] = v;
  }
  __syncthreads();
  const T out = part[0];
  __syncthreads();
  return out;
}

struct SumOp {
  template <class T>
  __device__ T operator()(T a, T b) const { return a + b; }
};
struct MaxOp {
  __device__ uint32_t operator()(uint32_t a, uint32_t b) const { return a > b ? a : b; }
  __device__ float operator()(float a, float b) const { return fmaxf(a, b); }
};

}  // namespace fp8moe::cuda
