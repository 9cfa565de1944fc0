// The experts' grouped FP8 GEMMs: one of a linear layer's three GEMMs (kernels/gemm_fp8.h) for
// every expert of a MoE layer in one call, group g (an expert) with its own weight and its own
// tokens. Three entry points, named by what they compute; the groups split M (the tokens are
// rows) or K (the tokens are the reduction), as DeepGEMM's m_grouped_..._nt / _nn and
// k_grouped_..._tn kernels do:
//
//   forward  Y_g  (M_g, N) = X_g (M_g, K) . W_g^T        grouped over M
//   dgrad    dX_g (M_g, K) = dY_g (M_g, N) . W_g         grouped over M
//   wgrad    dW_g (N, K)  += dY_g^T . X_g                grouped over K: each group's T_g tokens,
//                                                        dY_g (T_g, N), X_g (T_g, K)
//
// W_g (N, K) as stored, every group's of one shape. Each entry point IS the loop of the FP8 GEMM
// over the groups, in any order (they write disjoint outputs), with ld the row stride of every
// output (N forward, K dgrad and wgrad):
//   forward  gemm_fp8(X_g,  false, W_g, true,  1, 0, Y_g,  ld)   X rows_1xT, W blocks_TxT
//   dgrad    gemm_fp8(dY_g, false, W_g, false, 1, 0, dX_g, ld)   dY rows_1xT, W blocks_TxT
//   wgrad    gemm_fp8(dY_g, true,  X_g, false, 1, 1, dW_g, ld)   both cols_Tx1 (tiles along the tokens)
// (the tilings of the blockwise recipe; per_tensor operands anywhere for the per-tensor recipes).
// forward and dgrad write their output, wgrad adds into it (weight gradients accumulate over
// micro-batches). M_g and T_g may be 0: an expert that received no tokens.
//
// Where it is:
//   the Backend's entry points  kernels/backend.h (grouped_gemm_fp8_forward / _dgrad / _wgrad):
//                               the cpu and emulated backends in kernels/host_backend.cpp, CUDA in
//                               kernels/cuda/backend.cpp
//   CPU form                    kernels/cpu/grouped_gemm.cpp: the loop itself, on host memory
//   CUDA form                   kernels/cuda/grouped_gemm.cu (kernels/cuda/grouped_gemm.h):
//                               CUTLASS's grouped block-scaled kernel, each entry point's shape
//                               check beside it; a call it cannot take runs the loop of cuBLASLt
//                               GEMMs, counted (Backend::grouped_gemm_fallbacks) and named once
//   tests                       tests/kernels/test_grouped_gemm.cpp
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/quantize.h"

namespace fp8moe {

enum class GroupedGemm : uint8_t { forward, dgrad, wgrad };  // the entry point
const char* to_string(GroupedGemm e);                         // "forward", "dgrad", "wgrad"

// Grouped calls that ran as the loop of gemm_fp8 on a backend that has a grouped kernel (the
// CUDA backend, where CUTLASS's could not take them), per entry point.
struct GroupedGemmFallbacks {
  int64_t forward = 0, dgrad = 0, wgrad = 0;
  int64_t& operator[](GroupedGemm e) {
    return e == GroupedGemm::forward ? forward : e == GroupedGemm::dgrad ? dgrad : wgrad;
  }
  int64_t total() const { return forward + dgrad + wgrad; }
};

// One A, B and C per group (fatal otherwise): A = X or dY, B = W or X, C = the outputs.
void check_grouped_operands(GroupedGemm e, const std::vector<QuantView>& A, const std::vector<QuantView>& B,
                            const std::vector<float*>& C);

// The CPU form, on views of host memory (the host backends' op).
void grouped_gemm_fp8_forward(const std::vector<QuantView>& X, const std::vector<QuantView>& W,
                              const std::vector<float*>& Y, int64_t ld);
void grouped_gemm_fp8_dgrad(const std::vector<QuantView>& dY, const std::vector<QuantView>& W,
                            const std::vector<float*>& dX, int64_t ld);
void grouped_gemm_fp8_wgrad(const std::vector<QuantView>& dY, const std::vector<QuantView>& X,
                            const std::vector<float*>& dW, int64_t ld);

}  // namespace fp8moe
