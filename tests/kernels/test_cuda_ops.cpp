// Every CUDA op against its CPU twin on fresh random inputs. Needs a visible GPU; without one every
// test reports SKIPPED with the reason (it never passes). Needs no MPI, HDF5 or yaml-cpp.
#include <cublasLt.h>
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "kernels/backend_info.h"
#include "kernels/check.h"
#include "kernels/cuda/swiglu.h"
#include "kernels/swiglu.h"

namespace fp8moe {
namespace {

class CudaOps : public testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    if (cuda_device_count(&why) == 0) GTEST_SKIP() << "no CUDA device visible: " << why;
  }
};

// A device copy of a host vector, freed at scope exit.
struct DeviceBuffer {
  explicit DeviceBuffer(const std::vector<float>& host) : n(host.size()) {
    CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&ptr), std::max<size_t>(n, 1) * sizeof(float)));
    if (n) CUDA_CHECK(cudaMemcpy(ptr, host.data(), n * sizeof(float), cudaMemcpyHostToDevice));
  }
  ~DeviceBuffer() { cudaFree(ptr); }
  std::vector<float> download() const {
    std::vector<float> h(n);
    if (n) CUDA_CHECK(cudaMemcpy(h.data(), ptr, n * sizeof(float), cudaMemcpyDeviceToHost));
    return h;
  }
  float* ptr = nullptr;
  size_t n;
};

// NOTE: the same source (kernels/swiglu.h) runs on both sides, but the device expf differs from
// glibc's by up to 2 ulp and nvcc fuses multiply-adds (1 + a * (1 - s) cancels near a = -1.28),
// so results agree to rounding relative to the size of the terms (`scale`), not bitwise.
void expect_close(const std::vector<float>& gpu, const std::vector<float>& cpu, const std::vector<float>& scale,
                  const char* what) {
  ASSERT_EQ(gpu.size(), cpu.size());
  for (size_t i = 0; i < gpu.size(); ++i)
    ASSERT_LE(std::abs(gpu[i] - cpu[i]), 1e-5f * (std::abs(cpu[i]) + scale[i])) << what << " element " << i;
}

TEST_F(CudaOps, SwigluMatchesCpu) {
  for (int64_t n : {int64_t(0), int64_t(1), int64_t(1000), int64_t(1 << 22) + 5}) {
    SCOPED_TRACE(n);
    std::mt19937_64 rng(42 + n);
    std::normal_distribution<float> normal(0.0f, 3.0f);
    std::vector<float> a(n), b(n), dy(n);
    for (int64_t i = 0; i < n; ++i) a[i] = normal(rng), b[i] = normal(rng), dy[i] = normal(rng);
    std::vector<float> y(n), da(n), db(n);
    cpu::swiglu_forward(a.data(), b.data(), y.data(), n);
    cpu::swiglu_backward(a.data(), b.data(), dy.data(), da.data(), db.data(), n);

    DeviceBuffer da_(a), db_(b), ddy(dy), dyv(y), dda(da), ddb(db);
    cuda::swiglu_forward(da_.ptr, db_.ptr, dyv.ptr, n, nullptr);
    cuda::swiglu_backward(da_.ptr, db_.ptr, ddy.ptr, dda.ptr, ddb.ptr, n, nullptr);
    CUDA_CHECK(cudaDeviceSynchronize());
    // Term sizes as in tests/kernels/test_swiglu.cpp: |a b|, |dy b| (1 + |a|), |dy a|.
    std::vector<float> sy(n), sda(n), sdb(n);
    for (int64_t i = 0; i < n; ++i)
      sy[i] = std::abs(a[i] * b[i]), sda[i] = std::abs(dy[i] * b[i]) * (1 + std::abs(a[i])), sdb[i] = std::abs(dy[i] * a[i]);
    expect_close(dyv.download(), y, sy, "y");
    expect_close(dda.download(), da, sda, "da");
    expect_close(ddb.download(), db, sdb, "db");
  }
}

TEST_F(CudaOps, CublasLtHandleCanBeCreated) {
  cublasLtHandle_t handle = nullptr;
  CUBLAS_CHECK(cublasLtCreate(&handle));
  EXPECT_NE(handle, nullptr);
  CUBLAS_CHECK(cublasLtDestroy(handle));
}

}  // namespace
}  // namespace fp8moe
