// Token embedding on the GPU (kernels/embedding.h).
//
// Against kernels/cpu/embedding.cpp: bitwise. The forward copies; the backward gives each column
// to one thread, which adds the tokens' rows in token order (repeated ids into one row): the CPU's
// order, with the IEEE add.
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

__global__ void embed_bwd_kernel(const float* __restrict__ dout, const int32_t* __restrict__ ids, int64_t N,
                                 int64_t D, int64_t v0, int64_t Vl, float* __restrict__ dtable) {
  FP8MOE_GRID_STRIDE(d, D)
    for (int64_t n = 0; n < N; ++n) {
      const int64_t t = int64_t(ids[n]) - v0;
      if (t < 0 || t >= Vl) continue;
      float* cell = &dtable[t * D + d];
      *cell = add_rn(*cell, dout[n * D + d]);
    }
}

}  // namespace

void embedding_forward(const float* table, const int32_t* ids, int64_t N, int64_t D, int64_t v0, int64_t Vl,
                       float* out, cudaStream_t stream) {
  if (N * D == 0) return;
  embed_fwd_kernel<<<grid_for(N * D), kBlockThreads, 0, stream>>>(table, ids, N, D, v0, Vl, out);
  check_launch();
}

void embedding_backward(const float* dout, const int32_t* ids, int64_t N, int64_t D, int64_t v0, int64_t Vl,
                        float* dtable, cudaStream_t stream) {
  if (N * D == 0 || Vl == 0) return;
  embed_bwd_kernel<<<grid_for(D), kBlockThreads, 0, stream>>>(dout, ids, N, D, v0, Vl, dtable);
  check_launch();
}

}  // namespace fp8moe::cuda
