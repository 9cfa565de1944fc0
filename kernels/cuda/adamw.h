// CUDA launchers for kernels/adamw.h. Device memory, queued on `stream`; n may be 0.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/adamw.h"

namespace fp8moe::cuda {

// w, g: (n); moments FP32 m, v: (n) or BF16 bits m16, v16: (n) (the others null). g is read, never
// written.
void adamw(const AdamWStep& h, float* w, const float* g, float* m, float* v, uint16_t* m16, uint16_t* v16, int64_t n,
           cudaStream_t stream);

// Partials of sum_squares: one per chunk of kSumSquaresChunk elements.
inline constexpr int64_t kSumSquaresChunk = int64_t(1) << 14;
inline int64_t sum_squares_partials(int64_t n) { return (n + kSumSquaresChunk - 1) / kSumSquaresChunk; }
// *out (1 double) = sum of (g * unscale)^2: the product rounded to FP32, squared in double. g: (n);
// partial: sum_squares_partials(n) doubles of scratch that the caller provides and keeps until
// the launches have run.
void sum_squares(const float* g, int64_t n, float unscale, double* out, double* partial, cudaStream_t stream);

// *out = x[0] + x[1] + ... in order (one thread: meant for short vectors such as per-tensor sums).
void sum(const double* x, int64_t n, double* out, cudaStream_t stream);

}  // namespace fp8moe::cuda
