// CUDA launchers for kernels/swiglu.h. Device memory, queued on `stream`; rows or cols may be 0.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace fp8moe::cuda {
// (rows, cols); a, b, da, db with row stride ld, y and dy contiguous (kernels/swiglu.h).
void swiglu_forward(const float* a, const float* b, int64_t ld, float* y, int64_t rows, int64_t cols,
                    cudaStream_t stream);
void swiglu_backward(const float* a, const float* b, int64_t ld, const float* dy, float* da, float* db, int64_t rows,
                     int64_t cols, cudaStream_t stream);
// The gated forms (kernels/swiglu.h): gate and dgate (rows); dgate's row sums a warp's tree.
void swiglu_gated_forward(const float* a, const float* b, int64_t ld, const float* gate, float* y, int64_t rows,
                          int64_t cols, cudaStream_t stream);
void swiglu_gated_backward(const float* a, const float* b, int64_t ld, const float* gate, const float* dy, float* da,
                           float* db, double* dgate, int64_t rows, int64_t cols, cudaStream_t stream);
// a, b in BF16, widened in registers (gate nullptr: ungated, dgate not written).
void swiglu_forward_bf16(const uint16_t* a, const uint16_t* b, int64_t ld, const float* gate, float* y, int64_t rows,
                         int64_t cols, cudaStream_t stream);
void swiglu_backward_bf16(const uint16_t* a, const uint16_t* b, int64_t ld, const float* gate, const float* dy,
                          float* da, float* db, double* dgate, int64_t rows, int64_t cols, cudaStream_t stream);
}  // namespace fp8moe::cuda
