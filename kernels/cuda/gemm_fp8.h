// GEMMs on the GPU through cuBLASLt: FP8 (E4M3 x E4M3, E5M2 x E4M3 for `hybrid` gradients) with
// FP32 accumulation, per-tensor scales through the A/B scale pointers, and DeepSeek-V3 block
// scaling through CUBLASLT_MATMUL_DESC_{A,B}_SCALE_MODE (VEC128_32F for 1x128 activation and
// gradient tiles, BLK128x128_32F for weight blocks); FP32 and BF16 GEMMs beside them. All pointers
// are device memory; every call is queued on `stream`, never allocates and never synchronises.
//
// cuBLASLt's FP8 kernels on Hopper take only the TN layout (both operands K-contiguous): an operand
// whose reduction runs along its rows (the dgrad weight, both wgrad operands) is transposed on the
// device first (exact: FP8 bytes are moved, not re-rounded), and operands are zero-padded to the
// alignment the kernels need (K to 16, or 128 with block scaling; the outer dims to 16). An operand
// that is already K-contiguous and aligned is read in place. Fast accumulation (no split
// accumulator) is for the per-tensor forward GEMM only, as Transformer Engine does; block-scaled
// GEMMs promote to FP32 per 128-wide K block and never use it. Where the device or the library
// cannot run what is asked, the call fails with a clear error; it never falls back to another
// precision.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "kernels/quantize.h"
#include "kernels/tn_layout.h"

namespace fp8moe::cuda {

// What every cuBLASLt call needs: the backend's handle and workspace (used by one stream at a
// time: the backend's compute stream) and the device they belong to.
struct LtContext {
  cublasLtHandle_t handle = nullptr;
  void* workspace = nullptr;  // 256-byte aligned
  size_t workspace_bytes = 0;
  int device = 0;
};

// An FP8 operand in cuBLASLt's TN form (kernels/tn_layout.h): row-major (outer, K) bytes, leading
// dimension K, with the scales of its mode.
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
void gemm_fp8_tn(const LtContext& lt, const Fp8Operand& A, const Fp8Operand& B, float alpha, float beta, void* D,
                 int64_t ldd, OutType out, bool fast_accum, cudaStream_t stream);

// The kernels/gemm_fp8.h contract on QuantView operands in device memory, in two steps: the plan
// (host arithmetic on the shapes, tilings and pointers: which operands must be packed, and the
// scratch that takes), then gemm_fp8 with that scratch, which the caller takes from its arena.
// Tiled operands need tile 128 (cuBLASLt's blocks) with 1 x 128 tiles along K.
struct Fp8GemmPlan {
  struct Side {
    bool k_along_rows = false;  // the operand's reduction runs along its rows: transposed when packed
    ScaleMode mode = ScaleMode::per_tensor;
    int64_t outer = 0, outer_p = 0;
    bool pack_data = false;        // else the operand's bytes are read in place
    int64_t data_bytes = 0;        // packed bytes (outer_p x K_p) when pack_data
    bool pack_scales = false;      // else the operand's scale_inv is read in place (per-tensor)
    int64_t scale_count = 0;       // packed scales when pack_scales
  };
  int64_t M = 0, N = 0, K = 0, M_p = 0, N_p = 0, K_p = 0;
  Side a, b;
  bool empty = true;           // M or N is 0: nothing to compute
  bool k_empty = false;        // K is 0: C = beta C, no operand packed (no scratch)
  bool direct_out = false;     // cuBLASLt writes C itself
  int64_t out_count = 0;       // else the floats (M_p x N_p) of the padded output
};
Fp8GemmPlan plan_gemm_fp8(const QuantView& A, bool trans_a, const QuantView& B, bool trans_b, const float* C,
                          int64_t ldc);
// Scratch of a plan: a_data (a.data_bytes), a_scale (a.scale_count), likewise for b, and d
// (out_count floats); null where the plan needs none. 256-byte aligned (arena blocks).
struct Fp8GemmScratch {
  uint8_t* a_data = nullptr;
  float* a_scale = nullptr;
  uint8_t* b_data = nullptr;
  float* b_scale = nullptr;
  float* d = nullptr;
};
// C (M, N) = alpha op(A) op(B) + beta C, row-major with leading dimension ldc (only the M x N block
// is written). A: (M, K) as stored, or (K, M) when the plan's trans_a; B: (K, N), or (N, K) when
// trans_b (QuantViews with their scales, kernels/quantize.h).
void gemm_fp8(const LtContext& lt, const Fp8GemmPlan& plan, const QuantView& A, const QuantView& B, float alpha,
              float beta, float* C, int64_t ldc, const Fp8GemmScratch& scratch, bool fast_accum, cudaStream_t stream);

// FP32 GEMM (no TF32), row-major: C = alpha op(A) op(B) + beta C; K may be 0 (C = beta C).
// A: (M, K), or (K, M) when trans_a, leading dimension lda; B: (K, N), or (N, K) when trans_b,
// leading dimension ldb; C: (M, N), leading dimension ldc (only that block is written).
void sgemm(const LtContext& lt, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
           const float* A, int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc,
           cudaStream_t stream);
// The same on BF16 operands (bf16 bits, uint16_t), FP32 accumulation, FP32 C: cuBLASLt's BF16
// GEMM (CUBLAS_COMPUTE_32F). K may be 0 (C = beta C).
void gemm_bf16(const LtContext& lt, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
               const uint16_t* A, int64_t lda, const uint16_t* B, int64_t ldb, float beta, float* C, int64_t ldc,
               cudaStream_t stream);
// BF16 GEMM with FP32 accumulation and BF16 output, TN: D (M, N) = A (M, K) . B (N, K)^T (the
// benchmark's baseline), all row-major and dense. Pointers to bf16 bits (uint16_t). K >= 1.
void gemm_bf16_tn(const LtContext& lt, const uint16_t* A, const uint16_t* B, uint16_t* D, int64_t M, int64_t N,
                  int64_t K, cudaStream_t stream);

// Why the current device cannot run FP8 (empty when it can): compute capability below 8.9, or,
// for block scaling, other than 9.0 or a cuBLASLt older than 12.9.
std::string fp8_unsupported_reason(bool block_scaling);

}  // namespace fp8moe::cuda
