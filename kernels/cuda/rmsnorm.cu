// RMSNorm on the GPU (kernels/rmsnorm.h): one block per token row for y and dx, one thread per
// column for dw.
//
// Against kernels/cpu/rmsnorm.cpp:
//   close    rstd, y, dx: the row sums (double) are a block tree here and serial on the CPU, so
//            rstd may differ in its last bit; every other operation is the CPU's, in its order,
//            with the IEEE round-to-nearest intrinsics (y is bitwise given the same rstd)
//   bitwise  dw given the same rstd: one thread per column adds the tokens in order, as the CPU
#include "kernels/cuda/block_reduce.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/rmsnorm.h"
#include "kernels/elem.h"

namespace fp8moe::cuda {
namespace {

__global__ void rmsnorm_fwd_kernel(const float* __restrict__ x, const float* __restrict__ w, int64_t D, float eps,
                                   float* __restrict__ y, float* __restrict__ rstd) {
  const int64_t n = blockIdx.x;
  const float* xr = x + n * D;
  double ss = 0;
  for (int64_t d = threadIdx.x; d < D; d += blockDim.x) ss = dadd_rn(ss, dmul_rn(double(xr[d]), double(xr[d])));
  ss = block_reduce(ss, SumOp{}, 0.0);
  // NOTE: double division and square root are IEEE round-to-nearest on the device, as on the host.
  const float r = float(1.0 / sqrt(ss / double(D) + double(eps)));
  if (threadIdx.x == 0) rstd[n] = r;
  for (int64_t d = threadIdx.x; d < D; d += blockDim.x) y[n * D + d] = mul_rn(mul_rn(xr[d], r), w[d]);
}

// dx = r (w dy) - x r^3 / D * sum(w dy x), in double as the CPU.
__global__ void rmsnorm_bwd_dx_kernel(const float* __restrict__ x, const float* __restrict__ w,
                                      const float* __restrict__ rstd, const float* __restrict__ dy, int64_t D,
                                      float* __restrict__ dx) {
  const int64_t n = blockIdx.x;
  const float *xr = x + n * D, *g = dy + n * D;
  const double r = rstd[n];
  double dot = 0;
  for (int64_t d = threadIdx.x; d < D; d += blockDim.x)
    dot = dadd_rn(dot, dmul_rn(dmul_rn(double(w[d]), double(g[d])), double(xr[d])));
  dot = block_reduce(dot, SumOp{}, 0.0);
  const double c = dmul_rn(dmul_rn(dmul_rn(dot, r), r), r) / double(D);
  for (int64_t d = threadIdx.x; d < D; d += blockDim.x)
    dx[n * D + d] = float(__dsub_rn(dmul_rn(dmul_rn(r, double(w[d])), double(g[d])), dmul_rn(c, double(xr[d]))));
}

// One thread per column, tokens in order: the CPU's operation order exactly.
__global__ void rmsnorm_bwd_dw_kernel(const float* __restrict__ x, const float* __restrict__ rstd,
                                      const float* __restrict__ dy, int64_t N, int64_t D, float* __restrict__ dw) {
  FP8MOE_GRID_STRIDE(d, D) {
    float acc = dw[d];
    for (int64_t n = 0; n < N; ++n) acc = add_rn(acc, mul_rn(mul_rn(dy[n * D + d], x[n * D + d]), rstd[n]));
    dw[d] = acc;
  }
}

}  // namespace

void rmsnorm_forward(const float* x, const float* w, int64_t N, int64_t D, float eps, float* y, float* rstd,
                     cudaStream_t stream) {
  if (N == 0) return;
  rmsnorm_fwd_kernel<<<grid_of(N, "rmsnorm_forward"), kBlockThreads, 0, stream>>>(x, w, D, eps, y, rstd);
  check_launch();
}

void rmsnorm_backward(const float* x, const float* w, const float* rstd, const float* dy, int64_t N, int64_t D,
                      float* dx, float* dw, cudaStream_t stream) {
  if (N == 0 || D == 0) return;
  rmsnorm_bwd_dx_kernel<<<grid_of(N, "rmsnorm_backward"), kBlockThreads, 0, stream>>>(x, w, rstd, dy, D, dx);
  check_launch();
  rmsnorm_bwd_dw_kernel<<<grid_for(D), kBlockThreads, 0, stream>>>(x, rstd, dy, N, D, dw);
  check_launch();
}

}  // namespace fp8moe::cuda
