#include <cuda_fp8.h>

#include "kernels/check.h"
#include "kernels/cuda/block_reduce.cuh"
#include "kernels/cuda/quantize.h"

namespace fp8moe::cuda {
namespace {

constexpr int kThreads = kBlockThreads;

unsigned grid_for(int64_t n) {
  const int64_t want = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(want < 4096 ? (want > 0 ? want : 1) : 4096);
}

// Block-wide max of non-negative float bit patterns (NaN sorts above inf, as on the CPU).
__device__ uint32_t block_max(uint32_t v) { return block_reduce(v, MaxOp{}, 0u); }

__global__ void amax_kernel(const float* __restrict__ x, int64_t n, uint32_t* out) {
  uint32_t m = 0;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    m = max(m, float_bits(x[i]) & 0x7FFFFFFFu);
  m = block_max(m);
  if (threadIdx.x == 0) atomicMax(out, m);
}

template <Fp8Dtype F>
__device__ void encode_one(float v, uint8_t* q, unsigned long long* sat, unsigned long long* under) {
  const uint8_t b = fp8_encode<F, true>(v);
  *q = b;
  *sat += F == Fp8Dtype::e4m3 ? fabsf(v) > 464.0f : fabsf(v) >= 61440.0f;  // as kernels/cpu/quantize.cpp
  *under += (v != 0.0f) && ((b & 0x7F) == 0);
}

__device__ void encode_dispatch(Fp8Dtype f, float v, uint8_t* q, unsigned long long* sat, unsigned long long* under) {
  if (f == Fp8Dtype::e4m3)
    encode_one<Fp8Dtype::e4m3>(v, q, sat, under);
  else
    encode_one<Fp8Dtype::e5m2>(v, q, sat, under);
}

__global__ void quantize_scale_kernel(const float* __restrict__ x, int64_t n, Fp8Dtype f, const float* scale,
                                      uint8_t* __restrict__ q, float* scale_inv, unsigned long long* counts) {
  const float s = *scale;
  unsigned long long sat = 0, under = 0;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    encode_dispatch(f, x[i] * s, &q[i], &sat, &under);
  if (blockIdx.x == 0 && threadIdx.x == 0) *scale_inv = div_rn(1.0f, s);
  if (counts && (sat | under)) {
    atomicAdd(&counts[0], sat);
    atomicAdd(&counts[1], under);
  }
}

// One thread block per tile: (tile_h x tile_w) elements starting at (r0, c0).
__global__ void quantize_tiled_kernel(const float* __restrict__ x, int64_t rows, int64_t cols, int tile_h, int tile_w,
                                      int64_t scale_cols, Fp8Dtype f, int margin, bool pow2, uint8_t* __restrict__ q,
                                      float* scale_inv, unsigned long long* counts) {
  const int64_t tile_index = blockIdx.x;
  const int64_t ti = tile_index / scale_cols, tj = tile_index % scale_cols;
  const int64_t r0 = ti * tile_h, c0 = tj * tile_w;
  const int64_t h = min(int64_t(tile_h), rows - r0), w = min(int64_t(tile_w), cols - c0);
  uint32_t m = 0;
  for (int64_t i = threadIdx.x; i < h * w; i += blockDim.x)
    m = max(m, float_bits(x[(r0 + i / w) * cols + c0 + i % w]) & 0x7FFFFFFFu);
  m = block_max(m);
  const float s = compute_scale(bits_float(m), fp8_max(f), margin, pow2);
  if (threadIdx.x == 0) scale_inv[tile_index] = div_rn(1.0f, s);
  unsigned long long sat = 0, under = 0;
  for (int64_t i = threadIdx.x; i < h * w; i += blockDim.x) {
    const int64_t idx = (r0 + i / w) * cols + c0 + i % w;
    encode_dispatch(f, x[idx] * s, &q[idx], &sat, &under);
  }
  if (counts && (sat | under)) {
    atomicAdd(&counts[0], sat);
    atomicAdd(&counts[1], under);
  }
}

__global__ void scale_from_amax_kernel(const float* amax, float fmax, int margin, bool pow2, float* scale) {
  *scale = compute_scale(*amax, fmax, margin, pow2);
}

// One thread: record this step's amax and update the scale, as quantize_delayed on the CPU.
__global__ void delayed_update_kernel(float* history, int64_t len, int64_t step, const float* amax, bool most_recent,
                                      float fmax, int margin, bool pow2, float* scale) {
  history[step % len] = *amax;
  const int64_t filled = step + 1 < len ? step + 1 : len;
  uint32_t m = 0;
  if (most_recent) {
    m = float_bits(history[step % len]);
  } else {
    for (int64_t i = 0; i < filled; ++i) m = max(m, float_bits(history[i]));
  }
  const float h = bits_float(m);
  if (h > 0.0f && h <= 3.402823466e38f) *scale = compute_scale(h, fmax, margin, pow2);
}

__global__ void convert_hw_kernel(const float* __restrict__ x, int64_t n, __nv_fp8_interpretation_t interp,
                                  __nv_saturation_t sat, uint8_t* __restrict__ q) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    q[i] = __nv_cvt_float_to_fp8(x[i], sat, interp);
}

}  // namespace

void amax(const float* x, int64_t n, float* amax_out, cudaStream_t stream) {
  CUDA_CHECK(cudaMemsetAsync(amax_out, 0, sizeof(float), stream));
  if (n == 0) return;
  amax_kernel<<<grid_for(n), kThreads, 0, stream>>>(x, n, reinterpret_cast<uint32_t*>(amax_out));
  CUDA_CHECK(cudaGetLastError());
}

void quantize_with_scale(const float* x, int64_t n, Fp8Dtype dtype, const float* scale, uint8_t* q,
                         float* scale_inv_out, unsigned long long* counts, cudaStream_t stream) {
  quantize_scale_kernel<<<grid_for(n), kThreads, 0, stream>>>(x, n, dtype, scale, q, scale_inv_out, counts);
  CUDA_CHECK(cudaGetLastError());
}

void quantize_tiled(const float* x, int64_t rows, int64_t cols, Tiling tiling, int tile, Fp8Dtype dtype,
                    const ScaleOptions& opt, uint8_t* q, float* scale_inv, unsigned long long* counts,
                    cudaStream_t stream) {
  FP8MOE_ASSERT(tiling != Tiling::per_tensor && tile >= 1, "cuda::quantize_tiled: tiling ", to_string(tiling));
  if (rows == 0 || cols == 0) return;
  const int tile_h = tiling == Tiling::rows_1xT ? 1 : tile;
  const int tile_w = tiling == Tiling::cols_Tx1 ? 1 : tile;
  const int64_t sr = (rows + tile_h - 1) / tile_h, sc = (cols + tile_w - 1) / tile_w;
  FP8MOE_ASSERT(sr * sc < (int64_t(1) << 31), "too many tiles for one launch: ", sr * sc);
  quantize_tiled_kernel<<<unsigned(sr * sc), kThreads, 0, stream>>>(x, rows, cols, tile_h, tile_w, sc, dtype, opt.margin,
                                                                    opt.power_of_two, q, scale_inv, counts);
  CUDA_CHECK(cudaGetLastError());
}

void scale_from_amax(const float* amax, Fp8Dtype dtype, const ScaleOptions& opt, float* scale, cudaStream_t stream) {
  scale_from_amax_kernel<<<1, 1, 0, stream>>>(amax, fp8_max(dtype), opt.margin, opt.power_of_two, scale);
  CUDA_CHECK(cudaGetLastError());
}

void delayed_update(float* history, int64_t history_len, int64_t step, const float* amax,
                    DelayedScaling::Compute compute, Fp8Dtype dtype, const ScaleOptions& opt, float* scale,
                    cudaStream_t stream) {
  FP8MOE_ASSERT(history_len >= 1, "delayed scaling with an empty amax history");
  delayed_update_kernel<<<1, 1, 0, stream>>>(history, history_len, step, amax,
                                             compute == DelayedScaling::Compute::most_recent, fp8_max(dtype),
                                             opt.margin, opt.power_of_two, scale);
  CUDA_CHECK(cudaGetLastError());
}

void convert_hw(const float* x, int64_t n, Fp8Dtype dtype, bool saturate, uint8_t* q, cudaStream_t stream) {
  if (n == 0) return;
  convert_hw_kernel<<<grid_for(n), kThreads, 0, stream>>>(x, n, dtype == Fp8Dtype::e4m3 ? __NV_E4M3 : __NV_E5M2,
                                                          saturate ? __NV_SATFINITE : __NV_NOSAT, q);
  CUDA_CHECK(cudaGetLastError());
}

}  // namespace fp8moe::cuda
