// The experts' FP8 GEMMs in one launch: a grouped GEMM with DeepSeek-V3's block scaling (1 x 128
// activation tiles, 128 x 128 weight blocks, FP32 promotion of the partial sums every 128 of K) on
// CUTLASS 4.2's Hopper warp-specialized ptr-array kernel (its example 68). For every group g:
//   D_g (M_g, N) = alpha A_g (M_g, K) . B_g (N, K)^T + beta D_g
// The groups' row ranges come from device memory (the routing's offsets): the host needs only their
// sum, so no host synchronisation is needed for them. Operands in kernels/quantize.h's layouts:
//   A            (rows, K) E4M3 row-major: every group's rows back to back, group g at offsets[g]
//   a_scale_inv  (rows, K / 128) row-major: one per row per 128 of K (Tiling::rows_1xT, tile 128)
//   B            groups x (N, K) E4M3 row-major, group g at B + g * b_stride bytes
//   b_scale_inv  groups x (N / 128, K / 128) row-major (Tiling::blocks_TxT, tile 128), group g at
//                b_scale_inv + g * b_scale_stride
//   D            (rows, N) FP32 row-major
// N and K multiples of 128; a group may have no rows. NOT YET RUN ON A GPU: its cases
// (CudaOps.GroupedGemm*) and benchmark (bench_gemm_cuda) run in scripts/device-check.sh.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string>

namespace fp8moe::cuda {

struct GroupedGemmFp8 {
  int64_t groups = 0, rows = 0, N = 0, K = 0;  // rows: the sum of the groups' rows
  const int64_t* offsets = nullptr;            // device, groups + 1, offsets[0] = 0, offsets[groups] = rows
  const uint8_t* A = nullptr;
  const float* a_scale_inv = nullptr;
  const uint8_t* B = nullptr;
  int64_t b_stride = 0;
  const float* b_scale_inv = nullptr;
  int64_t b_scale_stride = 0;
  float* D = nullptr;
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
