// FP8 quantization on the GPU (kernels/quantize.h).
//
// Against kernels/cpu/quantize.cpp: bitwise, every op: the same element code (kernels/fp8.h's
// fp8_encode / fp8_decode, compute_scale, div_rn), maxima of FP32 bit patterns (exact and order
// independent), and the same saturation and underflow definitions for the counters (integer
// atomics: the same totals in any order).
#include <cuda_fp8.h>

#include "kernels/cuda/block_reduce.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/quantize.h"
#include "kernels/elem.h"

namespace fp8moe::cuda {
namespace {

static_assert(sizeof(uint64_t) == sizeof(unsigned long long), "the counters are updated with 64-bit atomics");

// Block-wide max of non-negative float bit patterns (NaN sorts above inf, as on the CPU).
__device__ uint32_t block_max_bits(uint32_t v) { return block_reduce(v, MaxOp{}, 0u); }

__global__ void amax_kernel(const float* __restrict__ x, int64_t n, uint32_t* out) {
  uint32_t m = 0;
  FP8MOE_GRID_STRIDE(i, n) m = max(m, float_bits(x[i]) & 0x7FFFFFFFu);
  m = block_max_bits(m);
  if (threadIdx.x == 0) atomicMax(out, m);
}

// One element, with kernels/cpu/fp8_simd.cpp's encode_span counters: saturated beyond the value
// that still rounds to max finite (E4M3: > 464, the tie at 464 rounds down to even 448; E5M2:
// >= 61440, whose tie rounds up to infinity); underflowed when non-zero became +-0.
template <Fp8Dtype F>
__device__ void encode_one(float v, uint8_t* q, unsigned long long* sat, unsigned long long* under) {
  const uint8_t b = fp8_encode<F, true>(v);
  *q = b;
  *sat += F == Fp8Dtype::e4m3 ? fabsf(v) > 464.0f : fabsf(v) >= 61440.0f;
  *under += (v != 0.0f) && ((b & 0x7F) == 0);
}

__device__ void encode_dispatch(Fp8Dtype f, float v, uint8_t* q, unsigned long long* sat, unsigned long long* under) {
  if (f == Fp8Dtype::e4m3)
    encode_one<Fp8Dtype::e4m3>(v, q, sat, under);
  else
    encode_one<Fp8Dtype::e5m2>(v, q, sat, under);
}

__device__ void add_counts(unsigned long long* counts, unsigned long long sat, unsigned long long under) {
  if (counts && (sat | under)) {
    atomicAdd(&counts[0], sat);
    atomicAdd(&counts[1], under);
  }
}

// amax: null, or zeroed before the launch; gets max |x| (amax_kernel's, from the same loads).
__global__ void quantize_scaled_kernel(const float* __restrict__ x, int64_t n, Fp8Dtype f, const float* scale,
                                       uint8_t* __restrict__ q, float* scale_inv, unsigned long long* counts,
                                       uint32_t* amax) {
  const float s = *scale;
  unsigned long long sat = 0, under = 0;
  uint32_t m = 0;
  FP8MOE_GRID_STRIDE(i, n) {
    const float v = x[i];
    m = max(m, float_bits(v) & 0x7FFFFFFFu);
    encode_dispatch(f, mul_rn(v, s), &q[i], &sat, &under);
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) *scale_inv = div_rn(1.0f, s);
  add_counts(counts, sat, under);
  if (amax) {  // uniform over the block: every thread takes part in the reduction
    m = block_max_bits(m);
    if (threadIdx.x == 0) atomicMax(amax, m);
  }
}

// One block per tile: (tile_h x tile_w) elements starting at (r0, c0); scale_inv[tile index] in
// kernels/quantize.h's layout (row-major over the tile grid).
__global__ void quantize_tiled_kernel(const float* __restrict__ x, int64_t rows, int64_t cols, int tile_h, int tile_w,
                                      int64_t scale_cols, Fp8Dtype f, int margin, bool pow2, uint8_t* __restrict__ q,
                                      float* __restrict__ scale_inv, unsigned long long* counts) {
  const int64_t tile_index = blockIdx.x;
  const int64_t ti = tile_index / scale_cols, tj = tile_index % scale_cols;
  const int64_t r0 = ti * tile_h, c0 = tj * tile_w;
  const int64_t h = min(int64_t(tile_h), rows - r0), w = min(int64_t(tile_w), cols - c0);
  uint32_t m = 0;
  for (int64_t i = threadIdx.x; i < h * w; i += blockDim.x)
    m = max(m, float_bits(x[(r0 + i / w) * cols + c0 + i % w]) & 0x7FFFFFFFu);
  m = block_max_bits(m);
  const float s = compute_scale(bits_float(m), fp8_max(f), margin, pow2);
  if (threadIdx.x == 0) scale_inv[tile_index] = div_rn(1.0f, s);
  unsigned long long sat = 0, under = 0;
  for (int64_t i = threadIdx.x; i < h * w; i += blockDim.x) {
    const int64_t idx = (r0 + i / w) * cols + c0 + i % w;
    encode_dispatch(f, mul_rn(x[idx], s), &q[idx], &sat, &under);
  }
  add_counts(counts, sat, under);
}

// One block per T x T region at (r0, c0) (h x w where the tensor ends): the region is read once
// into shared memory (coalesced), then each of the h rows gets its 1 x T scale from its own amax
// (a warp per row) and each of the w columns its T x 1 scale (a thread per column, reading shared
// memory down the column), and both copies are encoded from the staged values.
__global__ void quantize_tiled_pair_kernel(const float* __restrict__ x, int64_t rows, int64_t cols, int tile,
                                           int64_t region_cols, Fp8Dtype f, int margin, bool pow2,
                                           uint8_t* __restrict__ qr, float* __restrict__ sr, int64_t sr_cols,
                                           unsigned long long* cr, uint8_t* __restrict__ qc, float* __restrict__ sc,
                                           unsigned long long* cc) {
  extern __shared__ float region[];  // (h, tile)
  const int64_t ti = blockIdx.x / region_cols, tj = blockIdx.x % region_cols;
  const int64_t r0 = ti * tile, c0 = tj * tile;
  const int h = int(min(int64_t(tile), rows - r0)), w = int(min(int64_t(tile), cols - c0));
  for (int i = threadIdx.x; i < h * w; i += blockDim.x) region[(i / w) * tile + i % w] = x[(r0 + i / w) * cols + c0 + i % w];
  __syncthreads();
  const float fmax = fp8_max(f);
  unsigned long long sat = 0, under = 0;
  // Rows: warp `wid` takes rows wid, wid + warps, ...; its lanes stride the row's w values.
  const int lane = threadIdx.x % kWarpThreads, wid = threadIdx.x / kWarpThreads, warps = blockDim.x / kWarpThreads;
  for (int r = wid; r < h; r += warps) {
    uint32_t m = 0;
    for (int c = lane; c < w; c += kWarpThreads) m = max(m, float_bits(region[r * tile + c]) & 0x7FFFFFFFu);
    for (int o = kWarpThreads / 2; o > 0; o /= 2) m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, o));
    const float s = compute_scale(bits_float(m), fmax, margin, pow2);
    if (lane == 0) sr[(r0 + r) * sr_cols + tj] = div_rn(1.0f, s);
    for (int c = lane; c < w; c += kWarpThreads)
      encode_dispatch(f, mul_rn(region[r * tile + c], s), &qr[(r0 + r) * cols + c0 + c], &sat, &under);
  }
  add_counts(cr, sat, under);
  sat = 0, under = 0;
  // Columns: thread c takes column c (consecutive threads read consecutive banks, write
  // consecutive bytes of each row).
  for (int c = threadIdx.x; c < w; c += blockDim.x) {
    uint32_t m = 0;
    for (int r = 0; r < h; ++r) m = max(m, float_bits(region[r * tile + c]) & 0x7FFFFFFFu);
    const float s = compute_scale(bits_float(m), fmax, margin, pow2);
    sc[ti * cols + c0 + c] = div_rn(1.0f, s);
    for (int r = 0; r < h; ++r) encode_dispatch(f, mul_rn(region[r * tile + c], s), &qc[(r0 + r) * cols + c0 + c], &sat, &under);
  }
  add_counts(cc, sat, under);
}

__global__ void scale_from_amax_kernel(const float* amax, float fmax, int margin, bool pow2, float* scale) {
  *scale = compute_scale(*amax, fmax, margin, pow2);
}

// One thread: cpu::delayed_update exactly (the max over the whole ring, as cpu::delayed_amax).
__global__ void delayed_update_kernel(float* history, int64_t len, int64_t steps, const float* amax, bool most_recent,
                                      float fmax, int margin, bool pow2, float* scale) {
  history[steps % len] = *amax;
  float h = 0.0f;
  if (most_recent) {
    h = history[steps % len];
  } else {
    for (int64_t i = 0; i < len; ++i) h = float_bits(history[i]) > float_bits(h) ? history[i] : h;  // NaN-propagating
  }
  if (h > 0.0f && h <= 3.402823466e38f) *scale = compute_scale(h, fmax, margin, pow2);
}

__global__ void dequantize_kernel(QuantView q, float* __restrict__ out) {
  FP8MOE_GRID_STRIDE(i, q.rows * q.cols) {
    const int64_t r = i / q.cols, c = i % q.cols;
    out[i] = mul_rn(fp8_decode(q.data[i], q.dtype), q.scale_inv[q.scale_index(r, c)]);
  }
}

__global__ void convert_hw_kernel(const float* __restrict__ x, int64_t n, __nv_fp8_interpretation_t interp,
                                  __nv_saturation_t sat, uint8_t* __restrict__ q) {
  FP8MOE_GRID_STRIDE(i, n) q[i] = __nv_cvt_float_to_fp8(x[i], sat, interp);
}

unsigned long long* as_ull(uint64_t* p) { return reinterpret_cast<unsigned long long*>(p); }

constexpr int kMaxPairTile = 128;  // quantize_tiled_pair's largest staged region: 64 KiB

}  // namespace

void prepare_quantize_kernels() {
  CUDA_CHECK(cudaFuncSetAttribute(quantize_tiled_pair_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  int(size_t(kMaxPairTile) * kMaxPairTile * sizeof(float))));
}

void amax(const float* x, int64_t n, float* out, cudaStream_t stream) {
  CUDA_CHECK(cudaMemsetAsync(out, 0, sizeof(float), stream));  // +0: the CPU's amax of nothing
  if (n == 0) return;
  amax_kernel<<<grid_for(n), kBlockThreads, 0, stream>>>(x, n, reinterpret_cast<uint32_t*>(out));
  check_launch();
}

void scale_from_amax(const float* amax, Fp8Dtype dtype, const ScaleOptions& opt, float* scale, cudaStream_t stream) {
  scale_from_amax_kernel<<<1, 1, 0, stream>>>(amax, fp8_max(dtype), opt.margin, opt.power_of_two, scale);
  check_launch();
}

void quantize_scaled(const float* x, const float* scale, const QuantView& out, uint64_t* counts, float* amax,
                     cudaStream_t stream) {
  FP8MOE_ASSERT(out.tiling == Tiling::per_tensor, "quantize_scaled into a ", to_string(out.tiling), " tensor");
  // NOTE: launched also for an empty tensor (one block), which then only writes scale_inv[0].
  const int64_t n = out.rows * out.cols;
  if (amax) CUDA_CHECK(cudaMemsetAsync(amax, 0, sizeof(float), stream));  // +0: the CPU's amax of nothing
  quantize_scaled_kernel<<<grid_for(n), kBlockThreads, 0, stream>>>(x, n, out.dtype, scale, out.data, out.scale_inv,
                                                                    as_ull(counts), reinterpret_cast<uint32_t*>(amax));
  check_launch();
}

void quantize_tiled(const float* x, const ScaleOptions& opt, const QuantView& out, uint64_t* counts,
                    cudaStream_t stream) {
  FP8MOE_ASSERT(out.tiling != Tiling::per_tensor && out.tile >= 1, "quantize_tiled needs a tiling, got ",
                to_string(out.tiling), " with tile ", out.tile);
  if (out.rows == 0 || out.cols == 0) return;  // no tiles, no scales
  const int tile_h = out.tiling == Tiling::rows_1xT ? 1 : out.tile;
  const int tile_w = out.tiling == Tiling::cols_Tx1 ? 1 : out.tile;
  const int64_t sc = out.scale_cols();
  quantize_tiled_kernel<<<grid_of(out.scale_count(), "quantize_tiled"), kBlockThreads, 0, stream>>>(
      x, out.rows, out.cols, tile_h, tile_w, sc, out.dtype, opt.margin, opt.power_of_two, out.data, out.scale_inv,
      as_ull(counts));
  check_launch();
}

void quantize_tiled_pair(const float* x, const ScaleOptions& opt, const QuantView& rows_out, uint64_t* rows_counts,
                         const QuantView& cols_out, uint64_t* cols_counts, cudaStream_t stream) {
  const int T = rows_out.tile;
  if (T != cols_out.tile || T > kMaxPairTile || rows_out.dtype != cols_out.dtype) {
    quantize_tiled(x, opt, rows_out, rows_counts, stream);
    quantize_tiled(x, opt, cols_out, cols_counts, stream);
    return;
  }
  if (rows_out.rows == 0 || rows_out.cols == 0) return;
  const size_t smem = size_t(T) * size_t(T) * sizeof(float);  // opted in by prepare_quantize_kernels
  const int64_t region_rows = (rows_out.rows + T - 1) / T, region_cols = (rows_out.cols + T - 1) / T;
  quantize_tiled_pair_kernel<<<grid_of(region_rows * region_cols, "quantize_tiled_pair"), kBlockThreads, smem, stream>>>(
      x, rows_out.rows, rows_out.cols, T, region_cols, rows_out.dtype, opt.margin, opt.power_of_two, rows_out.data,
      rows_out.scale_inv, rows_out.scale_cols(), as_ull(rows_counts), cols_out.data, cols_out.scale_inv,
      as_ull(cols_counts));
  check_launch();
}

void delayed_update(float* history, int64_t len, int64_t steps, const float* amax, DelayedScalingCompute compute,
                    Fp8Dtype dtype, const ScaleOptions& opt, float* scale, cudaStream_t stream) {
  FP8MOE_ASSERT(len >= 1, "delayed scaling with an empty amax history");
  delayed_update_kernel<<<1, 1, 0, stream>>>(history, len, steps, amax, compute == DelayedScalingCompute::most_recent,
                                             fp8_max(dtype), opt.margin, opt.power_of_two, scale);
  check_launch();
}

void dequantize(const QuantView& q, float* out, cudaStream_t stream) {
  const int64_t n = q.rows * q.cols;
  if (n == 0) return;
  dequantize_kernel<<<grid_for(n), kBlockThreads, 0, stream>>>(q, out);
  check_launch();
}

void convert_hw(const float* x, int64_t n, Fp8Dtype dtype, bool saturate, uint8_t* q, cudaStream_t stream) {
  if (n == 0) return;
  convert_hw_kernel<<<grid_for(n), kBlockThreads, 0, stream>>>(x, n, dtype == Fp8Dtype::e4m3 ? __NV_E4M3 : __NV_E5M2,
                                                               saturate ? __NV_SATFINITE : __NV_NOSAT, q);
  check_launch();
}

}  // namespace fp8moe::cuda
