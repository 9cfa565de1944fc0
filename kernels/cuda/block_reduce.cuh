// Warp- and block-wide reductions for the CUDA kernels (one copy for every kernels/cuda/<op>.cu),
// and the launch constants they assume. block_reduce must be called by every thread of a block of
// exactly kBlockThreads (it synchronises); all threads get the result. warp_reduce must be called
// by all 32 lanes of a warp; all get the result. The trees are fixed, so a kernel gives the same
// bits on every run (but not the bits of a serial CPU loop: the order differs).
#pragma once

#include <cstdint>

namespace fp8moe::cuda {

// The one block size of the elementwise and reduction kernels.
constexpr int kBlockThreads = 256;
constexpr int kWarpThreads = 32;
constexpr int kWarpsPerBlock = kBlockThreads / kWarpThreads;
constexpr unsigned kFullWarp = 0xFFFFFFFFu;
// block_reduce keeps one partial per warp and folds them in the first warp.
static_assert(kBlockThreads % kWarpThreads == 0 && kWarpsPerBlock <= kWarpThreads,
              "block_reduce needs whole warps, at most 32 of them");

// op(a, b) combines two values (butterfly: every lane ends with the same value).
template <class T, class Op>
__device__ T warp_reduce(T v, Op op) {
  for (int o = kWarpThreads / 2; o > 0; o /= 2) v = op(v, __shfl_xor_sync(kFullWarp, v, o));
  return v;
}

// identity is op's neutral element (the value of the inactive partial slots).
template <class T, class Op>
__device__ T block_reduce(T v, Op op, T identity) {
  __shared__ T part[kWarpsPerBlock];
  v = warp_reduce(v, op);
  if ((threadIdx.x % kWarpThreads) == 0) part[threadIdx.x / kWarpThreads] = v;
  __syncthreads();
  if (threadIdx.x < kWarpThreads) {
    v = threadIdx.x < kWarpsPerBlock ? part[threadIdx.x] : identity;
    v = warp_reduce(v, op);
    if (threadIdx.x == 0) part[0] = v;
  }
  __syncthreads();
  const T out = part[0];
  __syncthreads();
  return out;
}

// NOTE: the sums use the IEEE round-to-nearest intrinsics, so that nvcc cannot contract a
// caller's product into the addition (a fused multiply-add rounds once, the CPU twice).
struct SumOp {
  __device__ float operator()(float a, float b) const { return __fadd_rn(a, b); }
  __device__ double operator()(double a, double b) const { return __dadd_rn(a, b); }
};
// fmaxf drops NaN; the FP8 amax uses bit patterns (uint32_t), where NaN sorts above infinity.
struct MaxOp {
  __device__ uint32_t operator()(uint32_t a, uint32_t b) const { return a > b ? a : b; }
  __device__ float operator()(float a, float b) const { return fmaxf(a, b); }
};

}  // namespace fp8moe::cuda
