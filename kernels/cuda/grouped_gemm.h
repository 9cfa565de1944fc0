// The experts' FP8 GEMMs in one launch: a grouped GEMM with DeepSeek-V3's block scaling (1 x 128
// activation tiles, 128 x 128 weight blocks, FP32 promotion of the partial sums every 128 of K) on
// CUTLASS 4.2's Hopper warp-specialized ptr-array kernel (its example 68). For every group g:
//   D_g (M_g, N) = alpha A_g (M_g, K) . B_g (N, K)^T + beta D_g
// Every argument array is in device memory, `groups` entries each (row_offsets: groups + 1, from
// 0 to rows), so that the host computes nothing from the groups' sizes and never waits:
//   row_offsets  M_g = row_offsets[g + 1] - row_offsets[g] (a group may have no rows)
//   A[g]         (M_g, K) E4M3 row-major
//   a_scale[g]   (M_g, K / 128) row-major: one per row per 128 of K (Tiling::rows_1xT, tile 128)
//   B[g]         (N, K) E4M3 row-major
//   b_scale[g]   (N / 128, K / 128) row-major (Tiling::blocks_TxT, tile 128)
//   D[g]         (M_g, N) FP32 row-major
// b_rows_are_k: B[g] is stored (K, N) instead (the weight of a dgrad, dx = dy W): its bytes are
// transposed into the scratch (the FP8 tensor cores read K-major operands only) and its scales,
// (K / 128, N / 128) row-major, are already what CUTLASS reads.
// N and K multiples of 128; pointers 16-byte aligned. NOT YET RUN ON A GPU: its case
// (CudaOps.GroupedGemmMatchesFp64) and benchmark (bench_gemm_cuda) run in scripts/device-check.sh.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string>

namespace fp8moe::cuda {

struct GroupedGemmFp8 {
  int64_t groups = 0, rows = 0, N = 0, K = 0;  // rows: the sum of the groups' rows (host)
  const int64_t* row_offsets = nullptr;
  const uint8_t* const* A = nullptr;
  const float* const* a_scale = nullptr;
  const uint8_t* const* B = nullptr;
  const float* const* b_scale = nullptr;
  float* const* D = nullptr;
  bool b_rows_are_k = false;
  float alpha = 1.0f, beta = 0.0f;
};

// Why this device cannot run it ("" when it can: compute capability 9.0, an sm_90a build).
std::string grouped_gemm_unsupported_reason(int device);
// Device scratch one call needs: the groups' argument arrays, the scales in CUTLASS's layouts and
// the kernel's workspace.
size_t grouped_gemm_fp8_scratch_bytes(const GroupedGemmFp8& p, int device);
// Queued on `stream`; scratch: at least grouped_gemm_fp8_scratch_bytes, 256-byte aligned.
void grouped_gemm_fp8(const GroupedGemmFp8& p, void* scratch, size_t scratch_bytes, int device, cudaStream_t stream);

}  // namespace fp8moe::cuda
