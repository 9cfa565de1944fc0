// The CUDA form of kernels/grouped_gemm.h: the experts' FP8 GEMMs in one launch, a grouped GEMM
// with DeepSeek-V3's block scaling (1 x 128 activation tiles, 128 x 128 weight blocks, FP32
// promotion of the partial sums every 128 of K) on CUTLASS 4.2's Hopper warp-specialized ptr-array
// kernel (its example 68), and beside it the shape check of each entry point: which calls it
// computes exactly as the loop of gemm_fp8 defines them. For every group g:
//   D_g (M_g, N) = alpha A_g (M_g, K) . B_g (N, K)^T + beta D_g
// Every argument array is in device memory, `groups` entries each (row_offsets: groups + 1, from
// 0 to rows), so that the host computes nothing from the groups' sizes and never waits. One form
// per entry point:
//   forward  A[g] (M_g, K) 1 x 128, scales a_scale[g] (M_g, K/128) row-major (Tiling::rows_1xT);
//            B[g] (N, K) 128 x 128 blocks, b_scale[g] (N/128, K/128) row-major (Tiling::blocks_TxT);
//            D[g] (M_g, N) = alpha A_g B_g^T + beta D_g
//   dgrad    as forward, but B[g] stored (K, N) (dx = dy W): its bytes are transposed into the
//            scratch (the FP8 tensor cores read K-major operands only); its block scales,
//            (K/128, N/128) row-major, are already what CUTLASS reads
//   wgrad    the weight gradient, reducing over each group's T_g = M_g tokens: A[g] = dy_g (T_g, N)
//            and B[g] = x_g (T_g, K), both in 128 x 1 tiles along the tokens (Tiling::cols_Tx1,
//            scales (ceil(T_g/128), N) and (ceil(T_g/128), K)); D[g] (N, K) = alpha dy_g^T x_g +
//            beta D_g. Both are transposed into the scratch, the tokens zero-padded to 16; max_rows
//            bounds the T_g (host). A second kernel instance: 1 x 128 scales on both operands.
// M_g may be 0 (that group's D is left as it is, whatever beta). N and K multiples of 128; pointers
// 16-byte aligned. The dgrad form transposes every group's weight on every call (a cached
// transposed copy per optimizer step would save it). NOT YET RUN ON A GPU: its
// cases (CudaOps.GroupedGemmMatchesFp64, DeviceOps.GroupedGemmMatchesTheLoop/cuda in
// tests/kernels/test_grouped_gemm.cpp) and benchmark (bench_gemm_cuda) run in
// scripts/device-check.sh.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "kernels/grouped_gemm.h"
#include "kernels/quantize.h"

namespace fp8moe::cuda {

struct GroupedGemmFp8 {
  GroupedGemm form = GroupedGemm::forward;
  int64_t groups = 0, rows = 0, N = 0, K = 0;  // rows: the sum of the groups' rows (host)
  const int64_t* row_offsets = nullptr;
  const uint8_t* const* A = nullptr;
  const float* const* a_scale = nullptr;
  const uint8_t* const* B = nullptr;
  const float* const* b_scale = nullptr;
  float* const* D = nullptr;
  int64_t max_rows = 0;  // wgrad: the largest M_g (host)
  float alpha = 1.0f, beta = 0.0f;
};

// Why this device cannot run it ("" when it can: compute capability 9.0, an sm_90a build).
std::string grouped_gemm_unsupported_reason(int device);

// The shape check: why the kernel cannot compute this call of kernels/grouped_gemm.h's entry point
// e (A = X or dY, B = W or X, C the outputs, ld their row stride) exactly as its loop of gemm_fp8
// defines it ("" when it can): E4M3 operands in the tilings above with tile 128, every weight of one
// shape, N and K multiples of 128, the outputs dense (ld = their columns) and every pointer 16-byte
// aligned. A pure function of the operands' shapes, tilings and addresses: no device needed. The
// reasons name no group and no token count, so that a caller can report each kind once.
std::string grouped_gemm_unsupported_reason(GroupedGemm e, const std::vector<QuantView>& A,
                                            const std::vector<QuantView>& B, const std::vector<float*>& C,
                                            int64_t ld);

// A call that the check accepts, as the kernel's problem (host): its groups with rows (the others
// have nothing to write, or nothing to add: left out) and their argument arrays in one block for
// one upload, args = [row offsets (groups + 1) | A | a_scale | B | b_scale | D (groups each)].
// point_at(&p, device copy of args) sets p's array pointers.
struct GroupedGemmCall {
  GroupedGemmFp8 p;
  std::vector<uint64_t> args;
};
GroupedGemmCall grouped_gemm_call(GroupedGemm e, const std::vector<QuantView>& A, const std::vector<QuantView>& B,
                                  const std::vector<float*>& C);
void point_at(GroupedGemmFp8* p, const uint64_t* device_args);

// Device scratch one call needs: the groups' argument arrays, the scales in CUTLASS's layouts and
// the kernel's workspace.
size_t grouped_gemm_fp8_scratch_bytes(const GroupedGemmFp8& p, int device);
// Queued on `stream`; scratch: at least grouped_gemm_fp8_scratch_bytes, 256-byte aligned.
void grouped_gemm_fp8(const GroupedGemmFp8& p, void* scratch, size_t scratch_bytes, int device, cudaStream_t stream);

}  // namespace fp8moe::cuda
