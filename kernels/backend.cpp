#include "kernels/backend.h"

#include "kernels/check.h"
#include "kernels/host_backend.h"

#ifdef FP8MOE_HAVE_CUDA
#include "kernels/cuda/backend.h"
#endif

namespace fp8moe {

void Backend::upload(void* dst, const void* host, size_t bytes) {
  if (bytes == 0) return;
  counts_.h2d_bytes += int64_t(bytes);
  upload_impl(dst, host, bytes);
}

void Backend::download(void* host, const void* src, size_t bytes) {
  if (bytes == 0) return;
  counts_.d2h_bytes += int64_t(bytes);
  download_impl(host, src, bytes);
}

void Backend::check_groups(const std::vector<QuantView>& A, const std::vector<QuantView>& B,
                           const std::vector<float*>& C) {
  FP8MOE_ASSERT(A.size() == B.size() && A.size() == C.size(), "grouped_gemm_fp8: ", A.size(), " A, ", B.size(), " B, ",
                C.size(), " C");
}

void Backend::grouped_gemm_fp8(GemmRole role, const std::vector<QuantView>& A, bool trans_a,
                               const std::vector<QuantView>& B, bool trans_b, float alpha, float beta,
                               const std::vector<float*>& C, int64_t ldc) {
  check_groups(A, B, C);
  for (size_t g = 0; g < A.size(); ++g) gemm_fp8(role, A[g], trans_a, B[g], trans_b, alpha, beta, C[g], ldc);
}

void Backend::quantize_tiled_pair(const float* x, const ScaleOptions& opt, const QuantView& rows_out,
                                  uint64_t* rows_counts, const QuantView& cols_out, uint64_t* cols_counts) {
  check_tiled_pair(rows_out, cols_out);
  quantize_tiled(x, opt, rows_out, rows_counts);
  quantize_tiled(x, opt, cols_out, cols_counts);
}

void Backend::check_tiled_pair(const QuantView& rows_out, const QuantView& cols_out) {
  FP8MOE_ASSERT(rows_out.tiling == Tiling::rows_1xT && cols_out.tiling == Tiling::cols_Tx1 &&
                    rows_out.rows == cols_out.rows && rows_out.cols == cols_out.cols,
                "quantize_tiled_pair: a ", to_string(rows_out.tiling), " ", rows_out.rows, " x ", rows_out.cols,
                " and a ", to_string(cols_out.tiling), " ", cols_out.rows, " x ", cols_out.cols, " tensor");
}

void Backend::sync() {
  ++counts_.host_syncs;
  sync_impl();
}

std::unique_ptr<Backend> make_backend(DeviceKind kind, int ordinal, const BackendOptions& options) {
  if (kind != DeviceKind::cuda) {
    FP8MOE_ASSERT(options.attention != AttentionKernel::cudnn, "cuDNN's fused attention needs the CUDA backend");
    return std::make_unique<HostBackend>(kind);
  }
#ifdef FP8MOE_HAVE_CUDA
  return make_cuda_backend(ordinal, options);
#else
  (void)ordinal;
  fatal_error(__FILE__, __LINE__, "runtime.device cuda: this fp8moe was built without CUDA");
#endif
}

}  // namespace fp8moe
