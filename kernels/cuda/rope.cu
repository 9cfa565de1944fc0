// RoPE on the GPU (kernels/rope.h), one thread per rotary pair, heads head_stride apart.
//
// Against kernels/cpu/rope.cpp: bitwise. Both rotate with kernels/rope.h's rope_rotate (IEEE
// round-to-nearest intrinsics on the device) by the same FP32 table.
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/rope.h"
#include "kernels/rope.h"

namespace fp8moe::cuda {
namespace {

__global__ void rope_kernel(float* __restrict__ x, int64_t rows, int64_t T, int64_t heads, int64_t half,
                            int64_t head_stride, const float* __restrict__ cs, const float* __restrict__ sn) {
  FP8MOE_GRID_STRIDE(e, rows * heads * half) {
    const int64_t i = e % half, rh = e / half, row = rh / heads;
    const int64_t t = row % T;
    float* v = x + rh * head_stride;
    rope_rotate(&v[i], &v[i + half], cs[t * half + i], sn[t * half + i]);
  }
}

}  // namespace

void rope(float* x, int64_t B, int64_t T, int64_t heads, int64_t hd, const float* cs, const float* sn,
          int64_t head_stride, cudaStream_t stream) {
  FP8MOE_ASSERT(hd % 2 == 0, "rope needs an even head_dim, got ", hd);
  FP8MOE_ASSERT(head_stride >= hd, "rope: head stride ", head_stride, " below the rotated size ", hd);
  const int64_t n = B * T * heads * (hd / 2);
  if (n == 0) return;
  rope_kernel<<<grid_for(n), kBlockThreads, 0, stream>>>(x, B * T, T, heads, hd / 2, head_stride, cs, sn);
  check_launch();
}

}  // namespace fp8moe::cuda
