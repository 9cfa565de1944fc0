// CUDA quantization: the same element code as the CPU (kernels/fp8.h, compute_scale in
// kernels/quantize.h), so results are bit-identical to kernels/cpu/quantize.cpp.
// All pointers are device pointers; sizes may be 0.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/quantize.h"

namespace fp8moe::cuda {

// *amax_out = max |x| (NaN if any x is NaN; 0 for n == 0), x: (n).
void amax(const float* x, int64_t n, float* amax_out, cudaStream_t stream);

// Current scaling on the device: *scale = compute_scale(*amax, ...), no copy to the host.
void scale_from_amax(const float* amax, Fp8Dtype dtype, const ScaleOptions& opt, float* scale, cudaStream_t stream);

// Delayed scaling on the device, as quantize_delayed after its quantization: writes *amax into
// history[step % len] (step = amax values recorded before this one) and updates *scale from the
// history's max or newest entry, keeping it when that amax is 0 or not finite.
void delayed_update(float* history, int64_t history_len, int64_t step, const float* amax,
                    DelayedScaling::Compute compute, Fp8Dtype dtype, const ScaleOptions& opt, float* scale,
                    cudaStream_t stream);

// q = fp8(x * *scale), x, q: (n); *scale_inv_out = 1 / *scale. counts (optional, 2 entries,
// accumulated): saturated, underflowed.
void quantize_with_scale(const float* x, int64_t n, Fp8Dtype dtype, const float* scale, uint8_t* q,
                         float* scale_inv_out, unsigned long long* counts, cudaStream_t stream);

// Blockwise: one scale per tile of the tiling (not per_tensor); x, q: (rows, cols), scale_inv in
// the layout of QuantTensor (kernels/quantize.h).
void quantize_tiled(const float* x, int64_t rows, int64_t cols, Tiling tiling, int tile, Fp8Dtype dtype,
                    const ScaleOptions& opt, uint8_t* q, float* scale_inv, unsigned long long* counts,
                    cudaStream_t stream);

// The hardware conversion (cuda_fp8.h's __nv_cvt_float_to_fp8: cvt.rn.satfinite on sm_89+), for
// checking it against kernels/fp8.h. x: (n) -> q: (n).
void convert_hw(const float* x, int64_t n, Fp8Dtype dtype, bool saturate, uint8_t* q, cudaStream_t stream);

}  // namespace fp8moe::cuda
