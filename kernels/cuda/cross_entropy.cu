// Cross-entropy on the GPU (kernels/cross_entropy.h): one block per row; the row losses are then
// added by one thread in row order, as the CPU adds them (deterministic, and the sum has the bits
// of a serial sum of these row losses).
//
// Against kernels/cpu/cross_entropy.cpp:
//   bitwise  ce_row_max (a max is exact; NaN-free rows), ce_partials' target logits
//   close    the row losses, their sum, se and dlogits: the device exp and log (double) differ from
//            the CPU's (SLEEF's exp, kernels/cpu/vmath.h; glibc's log) by an ulp, and each row's sum
//            of exponentials is a block tree here, 16 lanes in a fixed order there. Every other operation is the CPU's, in its order, with the IEEE intrinsics.
// NOTE: a target outside [0, V) on the tp = 1 path (the CPU asserts; the data reader already
// checks every token id) gives the row a NaN loss and a zero gradient row: visible in the loss,
// never an out-of-bounds read, and no host synchronisation to check it.
#include <cmath>

#include "kernels/cuda/block_reduce.cuh"
#include "kernels/cuda/cross_entropy.h"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/serial_sum.cuh"

namespace fp8moe::cuda {
namespace {

__device__ float block_max(float v) { return block_reduce(v, MaxOp{}, -INFINITY); }
__device__ double block_sum(double v) { return block_reduce(v, SumOp{}, 0.0); }

// sum over the row of exp(logit - m), in double (the CPU's per-element operations).
__device__ double row_sum_exp(const float* row, int64_t V, double m) {
  double s = 0;
  for (int64_t c = threadIdx.x; c < V; c += blockDim.x) s = __dadd_rn(s, exp(__dsub_rn(double(row[c]), m)));
  return block_sum(s);
}

// dlogits row = grad_scale (exp(logit - lse) - onehot(t - v0)).
__device__ void write_grad_row(const float* row, int64_t V, int64_t v0, int64_t t, double lse, float grad_scale,
                               float* drow) {
  for (int64_t c = threadIdx.x; c < V; c += blockDim.x)
    drow[c] = float(__dmul_rn(double(grad_scale), __dsub_rn(exp(__dsub_rn(double(row[c]), lse)),
                                                             c + v0 == t ? 1.0 : 0.0)));
}

__device__ void zero_row(int64_t V, float* drow) {
  for (int64_t c = threadIdx.x; c < V; c += blockDim.x) drow[c] = 0.0f;
}

__global__ void ce_kernel(const float* __restrict__ logits, const int32_t* __restrict__ targets, int64_t V,
                          int32_t ignore, float grad_scale, float* __restrict__ dlogits,
                          double* __restrict__ row_loss) {
  const int64_t n = blockIdx.x;
  const float* row = logits + n * V;
  const int32_t t = targets[n];
  float* drow = dlogits ? dlogits + n * V : nullptr;
  if (t == ignore || t < 0 || t >= V) {
    if (threadIdx.x == 0) row_loss[n] = t == ignore ? 0.0 : nan("");
    if (drow) zero_row(V, drow);
    return;
  }
  float m = -INFINITY;
  for (int64_t c = threadIdx.x; c < V; c += blockDim.x) m = fmaxf(m, row[c]);
  m = block_max(m);
  const double lse = __dadd_rn(double(m), log(row_sum_exp(row, V, double(m))));
  if (threadIdx.x == 0) row_loss[n] = __dsub_rn(lse, double(row[t]));
  if (drow) write_grad_row(row, V, 0, t, lse, grad_scale, drow);
}

__global__ void ce_row_max_kernel(const float* __restrict__ logits, int64_t Vl, float* __restrict__ mx) {
  const int64_t n = blockIdx.x;
  const float* row = logits + n * Vl;
  float m = -INFINITY;
  for (int64_t c = threadIdx.x; c < Vl; c += blockDim.x) m = fmaxf(m, row[c]);
  m = block_max(m);
  if (threadIdx.x == 0) mx[n] = m;
}

__global__ void ce_partials_kernel(const float* __restrict__ logits, const int32_t* __restrict__ targets, int64_t Vl,
                                   int64_t v0, int32_t ignore, const float* __restrict__ mx, double* __restrict__ se,
                                   double* __restrict__ tl) {
  const int64_t n = blockIdx.x;
  const float* row = logits + n * Vl;
  const double s = row_sum_exp(row, Vl, double(mx[n]));
  if (threadIdx.x == 0) {
    se[n] = s;
    const int64_t t = int64_t(targets[n]) - v0;
    tl[n] = targets[n] != ignore && t >= 0 && t < Vl ? double(row[t]) : 0.0;
  }
}

__global__ void ce_finish_kernel(const float* __restrict__ logits, const int32_t* __restrict__ targets, int64_t Vl,
                                 int64_t v0, int32_t ignore, const float* __restrict__ mx,
                                 const double* __restrict__ se, const double* __restrict__ tl, float grad_scale,
                                 float* __restrict__ dlogits, double* __restrict__ row_loss) {
  const int64_t n = blockIdx.x;
  const int32_t t = targets[n];
  float* drow = dlogits ? dlogits + n * Vl : nullptr;
  if (t == ignore) {
    if (threadIdx.x == 0) row_loss[n] = 0.0;
    if (drow) zero_row(Vl, drow);
    return;
  }
  const double lse = __dadd_rn(double(mx[n]), log(se[n]));
  if (threadIdx.x == 0) row_loss[n] = __dsub_rn(lse, tl[n]);
  if (drow) write_grad_row(logits + n * Vl, Vl, v0, t, lse, grad_scale, drow);
}

void zero_sum(double* loss_sum, cudaStream_t stream) {
  CUDA_CHECK(cudaMemsetAsync(loss_sum, 0, sizeof(double), stream));  // +0.0
}

}  // namespace

void cross_entropy(const float* logits, const int32_t* targets, int64_t N, int64_t V, int32_t ignore,
                   float grad_scale, float* dlogits, double* loss_sum, double* row_loss, cudaStream_t stream) {
  if (N == 0) return zero_sum(loss_sum, stream);
  ce_kernel<<<grid_of(N, "cross_entropy"), kBlockThreads, 0, stream>>>(logits, targets, V, ignore, grad_scale, dlogits,
                                                                       row_loss);
  check_launch();
  serial_sum_kernel<<<1, 1, 0, stream>>>(row_loss, N, loss_sum);
  check_launch();
}

void ce_row_max(const float* logits, int64_t N, int64_t Vl, float* mx, cudaStream_t stream) {
  if (N == 0) return;
  ce_row_max_kernel<<<grid_of(N, "ce_row_max"), kBlockThreads, 0, stream>>>(logits, Vl, mx);
  check_launch();
}

void ce_partials(const float* logits, const int32_t* targets, int64_t N, int64_t Vl, int64_t v0, int32_t ignore,
                 const float* mx, double* se, double* tl, cudaStream_t stream) {
  if (N == 0) return;
  ce_partials_kernel<<<grid_of(N, "ce_partials"), kBlockThreads, 0, stream>>>(logits, targets, Vl, v0, ignore, mx, se,
                                                                              tl);
  check_launch();
}

void ce_finish(const float* logits, const int32_t* targets, int64_t N, int64_t Vl, int64_t v0, int32_t ignore,
               const float* mx, const double* se, const double* tl, float grad_scale, float* dlogits,
               double* loss_sum, double* row_loss, cudaStream_t stream) {
  if (N == 0) return zero_sum(loss_sum, stream);
  ce_finish_kernel<<<grid_of(N, "ce_finish"), kBlockThreads, 0, stream>>>(logits, targets, Vl, v0, ignore, mx, se, tl,
                                                                          grad_scale, dlogits, row_loss);
  check_launch();
  serial_sum_kernel<<<1, 1, 0, stream>>>(row_loss, N, loss_sum);
  check_launch();
}

}  // namespace fp8moe::cuda
