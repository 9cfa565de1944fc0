// The optimizer's kernels on the GPU (kernels/adamw.h).
//
// Against kernels/cpu/adamw.cpp:
//   bitwise  adamw (kernels/adamw.h's adamw_elem with the IEEE intrinsics; BF16 moments through
//            kernels/fp8.h's bf16_encode / bf16_decode) and sum (serial, in order)
//   close    sum_squares: the same chunks of 2^14 elements, added in chunk order, and the same
//            element (the FP32 product g * unscale squared in double), but each chunk's sum is a
//            block tree here and 16 lanes in a fixed order on the CPU (kernels/cpu/vmath.h)
#include "kernels/cuda/adamw.h"
#include "kernels/cuda/block_reduce.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/serial_sum.cuh"

namespace fp8moe::cuda {
namespace {

__global__ void adamw_kernel(AdamWStep h, float* __restrict__ w, const float* __restrict__ g, float* __restrict__ m,
                             float* __restrict__ v, uint16_t* __restrict__ m16, uint16_t* __restrict__ v16, int64_t n) {
  FP8MOE_GRID_STRIDE(j, n) {
    float mj = m16 ? bf16_decode(m16[j]) : m[j];
    float vj = v16 ? bf16_decode(v16[j]) : v[j];
    adamw_elem(h, &w[j], &mj, &vj, g[j]);
    if (m16) {
      m16[j] = bf16_encode(mj), v16[j] = bf16_encode(vj);
    } else {
      m[j] = mj, v[j] = vj;
    }
  }
}

// One block per chunk of kSumSquaresChunk elements.
__global__ void sum_squares_kernel(const float* __restrict__ g, int64_t n, float unscale,
                                   double* __restrict__ partial) {
  const int64_t c0 = blockIdx.x * kSumSquaresChunk;
  const int64_t c1 = c0 + kSumSquaresChunk < n ? c0 + kSumSquaresChunk : n;
  double s = 0;
  for (int64_t j = c0 + threadIdx.x; j < c1; j += blockDim.x) {
    const double x = mul_rn(g[j], unscale);  // NOTE: rounded to FP32 first, as the CPU
    s = __dadd_rn(s, __dmul_rn(x, x));
  }
  s = block_reduce(s, SumOp{}, 0.0);
  if (threadIdx.x == 0) partial[blockIdx.x] = s;
}

}  // namespace

void adamw(const AdamWStep& h, float* w, const float* g, float* m, float* v, uint16_t* m16, uint16_t* v16, int64_t n,
           cudaStream_t stream) {
  if (n == 0) return;
  FP8MOE_ASSERT((m16 && v16 && !m && !v) || (m && v && !m16 && !v16), "adamw: FP32 moments (m, v) or BF16 (m16, v16)");
  adamw_kernel<<<grid_for(n), kBlockThreads, 0, stream>>>(h, w, g, m, v, m16, v16, n);
  check_launch();
}

void sum_squares(const float* g, int64_t n, float unscale, double* out, double* partial, cudaStream_t stream) {
  if (n == 0) {
    CUDA_CHECK(cudaMemsetAsync(out, 0, sizeof(double), stream));
    return;
  }
  const int64_t chunks = sum_squares_partials(n);
  sum_squares_kernel<<<grid_of(chunks, "sum_squares"), kBlockThreads, 0, stream>>>(g, n, unscale, partial);
  check_launch();
  serial_sum_kernel<<<1, 1, 0, stream>>>(partial, chunks, out);
  check_launch();
}

void sum(const double* x, int64_t n, double* out, cudaStream_t stream) {
  serial_sum_kernel<<<1, 1, 0, stream>>>(x, n, out);  // n == 0 writes 0
  check_launch();
}

}  // namespace fp8moe::cuda
