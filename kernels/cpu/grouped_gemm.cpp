// The grouped FP8 GEMM on the CPU (kernels/grouped_gemm.h): its definition, the loop of
// kernels/gemm_fp8.h's GEMM over the groups, group by group in order (the cpu and emulated
// backends' bits are those of one gemm_fp8 call per expert).
#include "kernels/grouped_gemm.h"

#include "kernels/check.h"
#include "kernels/gemm_fp8.h"

namespace fp8moe {

const char* to_string(GroupedGemm e) {
  switch (e) {
    case GroupedGemm::forward: return "forward";
    case GroupedGemm::dgrad: return "dgrad";
    case GroupedGemm::wgrad: return "wgrad";
  }
  return "?";
}

void check_grouped_operands(GroupedGemm e, const std::vector<QuantView>& A, const std::vector<QuantView>& B,
                            const std::vector<float*>& C) {
  FP8MOE_ASSERT(A.size() == B.size() && A.size() == C.size(), "grouped FP8 GEMM ", to_string(e), ": ", A.size(),
                " A, ", B.size(), " B, ", C.size(), " C");
}

void grouped_gemm_fp8_forward(const std::vector<QuantView>& X, const std::vector<QuantView>& W,
                              const std::vector<float*>& Y, int64_t ld) {
  check_grouped_operands(GroupedGemm::forward, X, W, Y);
  for (size_t g = 0; g < X.size(); ++g) gemm_fp8(X[g], false, W[g], true, 1.0f, 0.0f, Y[g], ld);
}

void grouped_gemm_fp8_dgrad(const std::vector<QuantView>& dY, const std::vector<QuantView>& W,
                            const std::vector<float*>& dX, int64_t ld) {
  check_grouped_operands(GroupedGemm::dgrad, dY, W, dX);
  for (size_t g = 0; g < dY.size(); ++g) gemm_fp8(dY[g], false, W[g], false, 1.0f, 0.0f, dX[g], ld);
}

void grouped_gemm_fp8_wgrad(const std::vector<QuantView>& dY, const std::vector<QuantView>& X,
                            const std::vector<float*>& dW, int64_t ld) {
  check_grouped_operands(GroupedGemm::wgrad, dY, X, dW);
  for (size_t g = 0; g < dY.size(); ++g) gemm_fp8(dY[g], true, X[g], false, 1.0f, 1.0f, dW[g], ld);
}

}  // namespace fp8moe
