// GEMMs on the GPU through cuBLASLt: FP8 (E4M3 x E4M3, E5M2 x E4M3 for `hybrid` gradients) with
// FP32 accumulation, per-tensor scales through the A/B scale pointers, and DeepSeek-V3 block
// scaling through CUBLASLT_MATMUL_DESC_{A,B}_SCALE_MODE (VEC128_32F for 1x128 activation and
// gradient tiles, BLK128x128_32F for weight blocks); FP32 and BF16 GEMMs beside them.
//
// cuBLASLt's FP8 kernels on Hopper take only the TN layout (both operands K-contiguous): an operand
// whose reduction runs along its rows (the dgrad weight, both wgrad operands) is transposed on the
// device first (exact: FP8 bytes are moved, not re-rounded), and operands are zero-padded to the
// alignment the kernels need (K to 16, or 128 with block scaling; the outer dims to 16). Fast
// accumulation (no split accumulator) is used for the per-tensor forward GEMM only, as Transformer
// Engine does; block-scaled GEMMs promote to FP32 per 128-wide K block and never use it.
// Where the device or the library cannot run what is asked, the call fails with a clear error; it
// never falls back to another precision.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include "kernels/quantize.h"
#include "kernels/tn_layout.h"

namespace fp8moe::cuda {

// An FP8 operand in cuBLASLt's TN form (kernels/tn_layout.h): row-major (outer, K) bytes, leading
// dimension K, with the scales of its mode, all in device memory.
struct Fp8Operand {
  const uint8_t* data = nullptr;
  int64_t outer = 0, K = 0;
  Fp8Dtype dtype = Fp8Dtype::e4m3;
  ScaleMode mode = ScaleMode::per_tensor;
  const float* scale = nullptr;
};

enum class OutType { f32, bf16 };

// D (M, N), row-major with leading dimension ldd, = alpha * A (M, K) . B (N, K)^T + beta * D.
// A.outer = M, B.outer = N, A.K == B.K; dims as cuBLASLt needs them (see the padding above;
// gemm_fp8 below pads for you). fast_accum: the forward's setting (false for dgrad and wgrad).
void gemm_fp8_tn(const Fp8Operand& A, const Fp8Operand& B, float alpha, float beta, void* D, int64_t ldd,
                 OutType out, bool fast_accum, cudaStream_t stream);

// The kernels/gemm_fp8.h contract on the GPU, from host QuantTensors to a host C: uploads,
// transposes and pads the operands, converts the scales to cuBLASLt's layouts and runs
// gemm_fp8_tn on the context's compute stream. Tiled operands need tile 128 (cuBLASLt's blocks).
void gemm_fp8(const QuantTensor& A, bool trans_a, const QuantTensor& B, bool trans_b, float alpha, float beta,
              float* C, int64_t ldc, bool fast_accum);

// FP32 GEMM (no TF32), row-major, device pointers: C = alpha op(A) op(B) + beta C.
void sgemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
           const float* B, int64_t ldb, float beta, float* C, int64_t ldc, cudaStream_t stream);
// BF16 GEMM with FP32 accumulation and BF16 output, TN: D (M, N) = A (M, K) . B (N, K)^T (the
// benchmark's baseline). Pointers to bf16 bits (uint16_t).
void gemm_bf16_tn(const uint16_t* A, const uint16_t* B, uint16_t* D, int64_t M, int64_t N, int64_t K,
                  cudaStream_t stream);

// Why this device cannot run FP8 (empty when it can): compute capability below 8.9, or, for block
// scaling, below 9.0 or a cuBLASLt older than 12.9.
std::string fp8_unsupported_reason(bool block_scaling);

}  // namespace fp8moe::cuda
