// The shared backends and helpers of tests/kernels/backend_cases.h, and the one instantiation of
// the DeviceOps cases of every tests/kernels/test_<op>.cpp.
#include "tests/kernels/backend_cases.h"

#include <map>
#include <memory>

#include "kernels/backend_info.h"
#if FP8MOE_HAVE_CUDA
#include "kernels/cuda/gemm_fp8.h"
#endif

namespace fp8moe::test {
namespace {

std::map<DeviceKind, std::unique_ptr<Backend>>& backends() {
  static std::map<DeviceKind, std::unique_ptr<Backend>> b;
  return b;
}

}  // namespace

Backend& backend_of(DeviceKind kind) {
  std::unique_ptr<Backend>& b = backends()[kind];
  // The CUDA cases check fp8moe's own kernels: attention is the reference kernel there (cuDNN's
  // fused attention has its own cases, CudaOps.FusedAttention*).
  BackendOptions options;
  options.attention = AttentionKernel::reference;
  if (!b) b = make_backend(kind, 0, options);
  return *b;
}

void release_backends() { backends().clear(); }

std::string cuda_unavailable_reason() {
  std::string why;
  return cuda_device_count(&why) > 0 ? std::string() : why;
}

std::string cuda_fp8_gemm_unsupported(bool blockwise) {
#if FP8MOE_HAVE_CUDA
  return cuda::fp8_unsupported_reason(blockwise);
#else
  (void)blockwise;
  return "this build has no CUDA backend";
#endif
}

QTensor up(Backend& be, const QuantTensor& q) {
  QTensor t(be, q.rows, q.cols, q.dtype, q.tiling, q.tile);
  to_device(be, q.data, t.data.data<uint8_t>());
  to_device(be, q.scale_inv, t.scale_inv.f32());
  return t;
}

namespace {
void poison(Backend& be, Tensor& t) {
  if (t.empty()) return;
  const std::vector<uint8_t> ff(t.bytes(), 0xFF);
  be.upload(t.raw(), ff.data(), ff.size());
}
}  // namespace

Tensor poisoned(Backend& be, DType dtype, int64_t n) {
  Tensor t(be, dtype, {n});
  poison(be, t);
  return t;
}

QTensor poisoned(Backend& be, int64_t rows, int64_t cols, Fp8Dtype dtype, Tiling tiling, int tile) {
  QTensor q(be, rows, cols, dtype, tiling, tile);
  poison(be, q.data);
  poison(be, q.scale_inv);
  return q;
}

std::vector<float> poisoned_f32(int64_t n) { return std::vector<float>(size_t(n), bits_float(0xFFFFFFFFu)); }
std::vector<double> poisoned_f64(int64_t n) {
  double d;
  const uint64_t ff = ~uint64_t(0);
  std::memcpy(&d, &ff, 8);
  return std::vector<double>(size_t(n), d);
}

double max_abs(const std::vector<float>& v) {
  double m = 0;
  for (float x : v) m = std::max(m, double(std::abs(x)));
  return m;
}

// emulated first: it runs everywhere; cuda is SKIPPED where no device is visible.
INSTANTIATE_TEST_SUITE_P(, DeviceOps, testing::Values(DeviceKind::emulated, DeviceKind::cuda),
                         [](const testing::TestParamInfo<DeviceKind>& i) { return std::string(to_string(i.param)); });

}  // namespace fp8moe::test
