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

// kernels/grouped_gemm.h's definitions, on this backend's gemm_fp8.
void Backend::grouped_gemm_fp8_forward(const std::vector<QuantView>& X, const std::vector<QuantView>& W,
                                       const std::vector<float*>& Y, int64_t ld) {
  check_grouped_operands(GroupedGemm::forward, X, W, Y);
  for (size_t g = 0; g < X.size(); ++g) gemm_fp8(GemmRole::fprop, X[g], false, W[g], true, 1.0f, 0.0f, Y[g], ld);
}

void Backend::grouped_gemm_fp8_dgrad(const std::vector<QuantView>& dY, const std::vector<QuantView>& W,
                                     const std::vector<float*>& dX, int64_t ld) {
  check_grouped_operands(GroupedGemm::dgrad, dY, W, dX);
  for (size_t g = 0; g < dY.size(); ++g) gemm_fp8(GemmRole::dgrad, dY[g], false, W[g], false, 1.0f, 0.0f, dX[g], ld);
}

void Backend::grouped_gemm_fp8_wgrad(const std::vector<QuantView>& dY, const std::vector<QuantView>& X,
                                     const std::vector<float*>& dW, int64_t ld) {
  check_grouped_operands(GroupedGemm::wgrad, dY, X, dW);
  for (size_t g = 0; g < dY.size(); ++g) gemm_fp8(GemmRole::wgrad, dY[g], true, X[g], false, 1.0f, 1.0f, dW[g], ld);
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
