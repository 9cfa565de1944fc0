// FP8 GEMM on the CPU: exact emulation of what an FP8 tensor core computes, with FP32 accumulation.
//
//   C (M, N) = alpha * op(A) (M, K) * op(B) (K, N) + beta * C          (row-major, ldc >= N)
//
// op(X) is X or X^T as stored. The three GEMMs of a linear layer y = x W^T, with W (N, K):
//   forward   y  (M,N) = x (M,K) . W^T     A = x  rows_1xT,              B = W  blocks_TxT, trans_b
//   dgrad     dx (M,K) = dy (M,N) . W      A = dy rows_1xT,              B = W  blocks_TxT
//   wgrad     dW (N,K) = dy^T . x          A = dy cols_Tx1, trans_a,     B = x  cols_Tx1
// (or per_tensor anywhere). Tiles of a 1xT / Tx1 operand must run along K; blocks may be used
// either way round. beta = 1 accumulates (weight gradients over micro-batches).
//
// Paths (all exact in the FP8 operands; they differ only in FP32 summation order):
//   dequant_bf16  power-of-two scales: every dequantized value q * 2^k is exact in BF16, and a
//                 BF16 x BF16 product is exact in FP32, so this is ONE BF16 GEMM with FP32
//                 accumulation (oneDNN; AMX or AVX512-BF16 hardware). NOTE: BF16 hardware flushes
//                 denormals; dequantized values are kept normal by requiring 2^-100 <= scale_inv
//                 <= 2^100, so only products below FP32's normal range (~1e-38) could differ.
//   dequant_fp32  power-of-two scales: the same dequantized operands through oneDNN's SGEMM.
//   block_scaled  any FP32 scales: raw FP8 values (exact in FP32) multiplied per K block of T
//                 (one block for per-tensor operands) through SGEMM, each partial product scaled
//                 by its (tile, block) pair of scales and accumulated in FP32, as DeepSeek-V3's
//                 promotion does. Tiled operands must then share T.
//   automatic     dequant_bf16 when the scales allow it and the CPU has BF16 hardware, else
//                 dequant_fp32 when they allow it, else block_scaled. Never unquantized operands.
// M, N or K may be 0 (an expert that received no tokens); edge tiles may be partial.
#pragma once

#include <cstdint>
#include <string>

#include "kernels/quantize.h"

namespace fp8moe {

enum class GemmPath { automatic, dequant_bf16, dequant_fp32, block_scaled };
const char* to_string(GemmPath p);

struct GemmInfo {
  GemmPath path = GemmPath::automatic;  // the path that ran
  std::string impl;                     // e.g. "oneDNN brg:avx512_core_amx_bf16" or "oneDNN sgemm"
};

void gemm_fp8(const QuantTensor& A, bool trans_a, const QuantTensor& B, bool trans_b, float alpha, float beta,
              float* C, int64_t ldc, GemmPath path = GemmPath::automatic, GemmInfo* info = nullptr);
// The same on views of host memory (the CPU backend's op).
void gemm_fp8(const QuantView& A, bool trans_a, const QuantView& B, bool trans_b, float alpha, float beta, float* C,
              int64_t ldc, GemmPath path = GemmPath::automatic, GemmInfo* info = nullptr);

// True when every scale_inv of q is a power of two in [2^-100, 2^100] (the dequant paths' condition).
bool has_exact_pow2_scales(const QuantTensor& q);
bool has_exact_pow2_scales(const QuantView& q);

// Whether this CPU runs BF16 GEMMs in hardware (oneDNN's AVX512-BF16 or AMX), and its ISA name.
bool cpu_has_bf16_gemm();
std::string cpu_isa_name();

// Plain FP32 SGEMM, C = alpha op(A) op(B) + beta C, row-major: oneDNN's dnnl_sgemm, on the calling
// thread's OpenMP team (one thread inside a parallel region). Its kernels follow the CPU's features
// (AVX-512, AVX2, ...), and for some shapes it splits K over the threads, so its bits may change
// with the CPU and the thread count; a rerun with the same threads on the same CPU repeats them.
void sgemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
           const float* B, int64_t ldb, float beta, float* C, int64_t ldc);
// The same on BF16 operands (bits), FP32 accumulation and C: oneDNN's BF16 matmul where the CPU has
// BF16 hardware (AVX-512 BF16 or AMX: each product exact, sums in FP32 in its order; a
// denormal product or sum may flush to zero, as the BF16 dot-product instructions do), else the
// operands widened to FP32 (exact) and sgemm. Strided operands (lda, ldb, ldc) are read in place.
void gemm_bf16(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const uint16_t* A,
               int64_t lda, const uint16_t* B, int64_t ldb, float beta, float* C, int64_t ldc);

}  // namespace fp8moe
