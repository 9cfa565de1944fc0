// RMSNorm on the GPU (kernels/rmsnorm.h): one block per token row for y and dx; dw in two passes,
// a thread per (column, chunk of kRmsNormDwChunk tokens) for the partial sums, then a thread per
// column adding them in chunk order (parallel over tokens, and the same bits on every run).
//
// Against kernels/cpu/rmsnorm.cpp:
//   close    rstd, y, dx: the row sums (double) are a block tree here and 16 lanes in a fixed order
//            on the CPU (kernels/cpu/vmath.h's lane_sum), so
//            rstd may differ in its last bit; every other operation is the CPU's, in its order,
//            with the IEEE round-to-nearest intrinsics (y is bitwise given the same rstd)
//   bitwise  dw given the same rstd: the CPU's chunked order of addition (kernels/rmsnorm.h)
#include "kernels/cuda/block_reduce.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/rmsnorm.h"
#include "kernels/elem.h"
#include "kernels/rmsnorm.h"

namespace fp8moe::cuda {
namespace {

// T: float, or uint16_t (BF16 bits), read as kernels/fp8.h kept_value widens them.

template <class T>
__global__ void rmsnorm_fwd_kernel(const T* __restrict__ x, const float* __restrict__ w, int64_t D, float eps,
                                   float* __restrict__ y, float* __restrict__ rstd) {
  const int64_t n = blockIdx.x;
  const T* xr = x + n * D;
  double ss = 0;
  for (int64_t d = threadIdx.x; d < D; d += blockDim.x) {
    const double v = kept_value(xr[d]);
    ss = dadd_rn(ss, dmul_rn(v, v));
  }
  ss = block_reduce(ss, SumOp{}, 0.0);
  // NOTE: double division and square root are IEEE round-to-nearest on the device, as on the host.
  const float r = float(1.0 / sqrt(ss / double(D) + double(eps)));
  if (threadIdx.x == 0) rstd[n] = r;
  for (int64_t d = threadIdx.x; d < D; d += blockDim.x) y[n * D + d] = mul_rn(mul_rn(kept_value(xr[d]), r), w[d]);
}

// dx = r (w dy) - x r^3 / D * sum(w dy x), in double as the CPU.
template <class T>
__global__ void rmsnorm_bwd_dx_kernel(const T* __restrict__ x, const float* __restrict__ w,
                                      const float* __restrict__ rstd, const float* __restrict__ dy, int64_t D,
                                      float* __restrict__ dx) {
  const int64_t n = blockIdx.x;
  const T* xr = x + n * D;
  const float* g = dy + n * D;
  const double r = rstd[n];
  double dot = 0;
  for (int64_t d = threadIdx.x; d < D; d += blockDim.x)
    dot = dadd_rn(dot, dmul_rn(dmul_rn(double(w[d]), double(g[d])), double(kept_value(xr[d]))));
  dot = block_reduce(dot, SumOp{}, 0.0);
  const double c = dmul_rn(dmul_rn(dmul_rn(dot, r), r), r) / double(D);
  for (int64_t d = threadIdx.x; d < D; d += blockDim.x)
    dx[n * D + d] = float(__dsub_rn(dmul_rn(dmul_rn(r, double(w[d])), double(g[d])), dmul_rn(c, double(kept_value(xr[d])))));
}

// part[c D + d] = the chunk c's tokens in order, from 0 (grid: column blocks x chunks).
template <class T>
__global__ void rmsnorm_dw_partial_kernel(const T* __restrict__ x, const float* __restrict__ rstd,
                                          const float* __restrict__ dy, int64_t N, int64_t D,
                                          float* __restrict__ part) {
  const int64_t d = int64_t(blockIdx.x) * blockDim.x + threadIdx.x, c = blockIdx.y;
  if (d >= D) return;
  const int64_t end = (c + 1) * kRmsNormDwChunk < N ? (c + 1) * kRmsNormDwChunk : N;
  float acc = 0.0f;
  for (int64_t n = c * kRmsNormDwChunk; n < end; ++n)
    acc = add_rn(acc, mul_rn(mul_rn(dy[n * D + d], kept_value(x[n * D + d])), rstd[n]));
  part[c * D + d] = acc;
}

// dw[d] += the partials in chunk order.
__global__ void rmsnorm_dw_sum_kernel(const float* __restrict__ part, int64_t chunks, int64_t D,
                                      float* __restrict__ dw) {
  FP8MOE_GRID_STRIDE(d, D) {
    float acc = dw[d];
    for (int64_t c = 0; c < chunks; ++c) acc = add_rn(acc, part[c * D + d]);
    dw[d] = acc;
  }
}

}  // namespace

void rmsnorm_forward(const float* x, const float* w, int64_t N, int64_t D, float eps, float* y, float* rstd,
                     cudaStream_t stream) {
  if (N == 0) return;
  rmsnorm_fwd_kernel<float><<<grid_of(N, "rmsnorm_forward"), kBlockThreads, 0, stream>>>(x, w, D, eps, y, rstd);
  check_launch();
}

void rmsnorm_forward_bf16(const uint16_t* x, const float* w, int64_t N, int64_t D, float eps, float* y, float* rstd,
                          cudaStream_t stream) {
  if (N == 0) return;
  rmsnorm_fwd_kernel<uint16_t><<<grid_of(N, "rmsnorm_forward_bf16"), kBlockThreads, 0, stream>>>(x, w, D, eps, y, rstd);
  check_launch();
}

namespace {
template <class T>
void backward(const T* x, const float* w, const float* rstd, const float* dy, int64_t N, int64_t D, float* dx,
              float* dw, float* dw_partials, cudaStream_t stream) {
  if (N == 0 || D == 0) return;
  rmsnorm_bwd_dx_kernel<T><<<grid_of(N, "rmsnorm_backward"), kBlockThreads, 0, stream>>>(x, w, rstd, dy, D, dx);
  check_launch();
  const int64_t chunks = rmsnorm_dw_chunks(N), column_blocks = (D + kBlockThreads - 1) / kBlockThreads;
  FP8MOE_ASSERT(chunks <= 65535 && column_blocks <= (int64_t(1) << 31) - 1, "rmsnorm_backward: ", N, " tokens x ", D,
                " columns exceed the grid");
  rmsnorm_dw_partial_kernel<T><<<dim3(unsigned(column_blocks), unsigned(chunks)), kBlockThreads, 0, stream>>>(
      x, rstd, dy, N, D, dw_partials);
  check_launch();
  rmsnorm_dw_sum_kernel<<<grid_for(D), kBlockThreads, 0, stream>>>(dw_partials, chunks, D, dw);
  check_launch();
}
}  // namespace

void rmsnorm_backward(const float* x, const float* w, const float* rstd, const float* dy, int64_t N, int64_t D,
                      float* dx, float* dw, float* dw_partials, cudaStream_t stream) {
  backward(x, w, rstd, dy, N, D, dx, dw, dw_partials, stream);
}

void rmsnorm_backward_bf16(const uint16_t* x, const float* w, const float* rstd, const float* dy, int64_t N, int64_t D,
                           float* dx, float* dw, float* dw_partials, cudaStream_t stream) {
  backward(x, w, rstd, dy, N, D, dx, dw, dw_partials, stream);
}

}  // namespace fp8moe::cuda
