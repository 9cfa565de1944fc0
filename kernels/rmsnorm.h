// RMSNorm: y = x / sqrt(mean(x^2) + eps) * w, over rows of D (N = tokens). FP32 values, row sums
// in double (on the CPU in kernels/cpu/vmath.h's 16-lane order). CPU here; CUDA in kernels/cuda/rmsnorm.cu; the backend op in kernels/backend.h.
#pragma once

#include <cstdint>

namespace fp8moe {

// The weight gradient's order of addition, the same on every backend (so that they agree bit for
// bit): the tokens in chunks of this many; each chunk's partial sum starts at 0 and adds its tokens
// in order; then dw plus the partials in chunk order. The chunks run in parallel.
constexpr int64_t kRmsNormDwChunk = 256;
inline int64_t rmsnorm_dw_chunks(int64_t N) { return (N + kRmsNormDwChunk - 1) / kRmsNormDwChunk; }

}  // namespace fp8moe

namespace fp8moe::cpu {

// x, y: (N, D); w: (D); rstd: (N), saved for backward.
void rmsnorm_forward(const float* x, const float* w, int64_t N, int64_t D, float eps, float* y, float* rstd);
// dx: (N, D) written; dw: (D) ACCUMULATED (micro-batches add up), in the chunked order above.
void rmsnorm_backward(const float* x, const float* w, const float* rstd, const float* dy, int64_t N, int64_t D,
                      float* dx, float* dw);
// The same with x in BF16 (each row widened as it is read): rmsnorm_forward's and
// rmsnorm_backward's bits on the widened x.
void rmsnorm_forward_bf16(const uint16_t* x, const float* w, int64_t N, int64_t D, float eps, float* y, float* rstd);
void rmsnorm_backward_bf16(const uint16_t* x, const float* w, const float* rstd, const float* dy, int64_t N, int64_t D,
                           float* dx, float* dw);

}  // namespace fp8moe::cpu
