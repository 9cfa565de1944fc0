// CUDA launchers for kernels/quantize.h's cores (cpu::quantize_scaled, ...): the same element code
// (kernels/fp8.h, compute_scale), so that results are bit-identical to kernels/cpu/quantize.cpp.
// Device memory, queued on `stream`; sizes may be 0. Scales and amax values stay on the device.
// counts (2 uint64_t, may be null): saturated and underflowed elements, ACCUMULATED (atomics).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/quantize.h"

namespace fp8moe::cuda {

// x: (n) -> out: (1) = max |x| (NaN if any x is NaN; 0 for n == 0).
void amax(const float* x, int64_t n, float* out, cudaStream_t stream);
// amax: (1) -> scale: (1) = compute_scale(*amax, fp8_max(dtype), opt.margin, opt.power_of_two).
void scale_from_amax(const float* amax, Fp8Dtype dtype, const ScaleOptions& opt, float* scale, cudaStream_t stream);
// x: (out.rows, out.cols), scale: (1) -> out.data = fp8(x * *scale), out.scale_inv[0] = 1 / *scale (written
// also when out is empty). out per-tensor. amax (1, may be null): max |x| as amax() gives it, from the same read.
void quantize_scaled(const float* x, const float* scale, const QuantView& out, uint64_t* counts, float* amax,
                     cudaStream_t stream);
// x: (out.rows, out.cols) -> out.data and one scale per tile of out.tiling (not per_tensor) from
// the tile's own amax.
void quantize_tiled(const float* x, const ScaleOptions& opt, const QuantView& out, uint64_t* counts,
                    cudaStream_t stream);
// Once per device context, before any launch below (the backend's set-up): quantize_tiled_pair's
// kernel stages more than 48 KiB of shared memory, which is opt-in.
void prepare_quantize_kernels();
// rows_out (1 x T) and cols_out (T x 1) of one x, each bit-identical to quantize_tiled's, from one
// read of x: a block per T x T region, staged in shared memory (T <= 128; otherwise the two
// quantize_tiled launches). Same T for both.
void quantize_tiled_pair(const float* x, const ScaleOptions& opt, const QuantView& rows_out, uint64_t* rows_counts,
                         const QuantView& cols_out, uint64_t* cols_counts, cudaStream_t stream);
// cpu::delayed_update: history: (len) gets *amax (1) at steps % len, and *scale (1) the compute_scale of
// the history's max or newest entry unless that is 0 or not finite.
void delayed_update(float* history, int64_t len, int64_t steps, const float* amax, DelayedScalingCompute compute,
                    Fp8Dtype dtype, const ScaleOptions& opt, float* scale, cudaStream_t stream);
// q: (q.rows, q.cols) -> out: (q.rows, q.cols) = decode(q) * scale_inv.
void dequantize(const QuantView& q, float* out, cudaStream_t stream);

// The hardware conversion (cuda_fp8.h's __nv_cvt_float_to_fp8: cvt.rn.satfinite on sm_89+), for
// checking it against kernels/fp8.h. x: (n) -> q: (n).
void convert_hw(const float* x, int64_t n, Fp8Dtype dtype, bool saturate, uint8_t* q, cudaStream_t stream);

}  // namespace fp8moe::cuda
