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
#include "kernels/cuda/quantize.h"
#include "kernels/cuda/swiglu.h"
#include "kernels/fp8.h"
#include "kernels/quantize.h"
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

// Device memory for n elements of T, freed at scope exit.
template <class T>
struct Device {
  explicit Device(size_t n, const T* init = nullptr) : n(n) {
    CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&ptr), std::max<size_t>(n, 1) * sizeof(T)));
    if (init && n) CUDA_CHECK(cudaMemcpy(ptr, init, n * sizeof(T), cudaMemcpyHostToDevice));
    if (!init) CUDA_CHECK(cudaMemset(ptr, 0, std::max<size_t>(n, 1) * sizeof(T)));
  }
  ~Device() { cudaFree(ptr); }
  std::vector<T> get() const {
    std::vector<T> h(n);
    if (n) CUDA_CHECK(cudaMemcpy(h.data(), ptr, n * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
  }
  T* ptr = nullptr;
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

    Device<float> da_(a.size(), a.data()), db_(b.size(), b.data()), ddy(dy.size(), dy.data()), dyv(y.size()),
        dda(da.size()), ddb(db.size());
    cuda::swiglu_forward(da_.ptr, db_.ptr, dyv.ptr, n, nullptr);
    cuda::swiglu_backward(da_.ptr, db_.ptr, ddy.ptr, dda.ptr, ddb.ptr, n, nullptr);
    CUDA_CHECK(cudaDeviceSynchronize());
    // Term sizes as in tests/kernels/test_swiglu.cpp: |a b|, |dy b| (1 + |a|), |dy a|.
    std::vector<float> sy(n), sda(n), sdb(n);
    for (int64_t i = 0; i < n; ++i)
      sy[i] = std::abs(a[i] * b[i]), sda[i] = std::abs(dy[i] * b[i]) * (1 + std::abs(a[i])), sdb[i] = std::abs(dy[i] * a[i]);
    expect_close(dyv.get(), y, sy, "y");
    expect_close(dda.get(), da, sda, "da");
    expect_close(ddb.get(), db, sdb, "db");
  }
}

std::vector<float> scaled_normal(int64_t rows, int64_t cols, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(rows * cols));
  for (int64_t i = 0; i < rows * cols; ++i) x[i] = d(rng) * std::ldexp(1.0f, int(i % 23) - 11);
  return x;
}

TEST_F(CudaOps, AmaxAndPerTensorQuantizeMatchCpuBitwise) {
  for (Fp8Dtype f : {Fp8Dtype::e4m3, Fp8Dtype::e5m2})
    for (auto [rows, cols] : {std::pair<int64_t, int64_t>{0, 16}, {1, 1}, {333, 129}, {2048, 1024}}) {
      SCOPED_TRACE(testing::Message() << to_string(f) << " " << rows << "x" << cols);
      const std::vector<float> x = scaled_normal(rows, cols, 5 + rows);
      QuantTensor cpu;
      const float cpu_amax = quantize_current(x.data(), rows, cols, f, {}, {}, &cpu);
      Device<float> dx(x.size(), x.data()), damax(1), dscale(1), dscale_inv(1);
      Device<uint8_t> dq(x.size());
      Device<unsigned long long> dcounts(2);
      cuda::amax(dx.ptr, rows * cols, damax.ptr, nullptr);
      const float gpu_amax = damax.get()[0];
      EXPECT_EQ(float_bits(gpu_amax), float_bits(cpu_amax));
      const float scale = compute_scale(gpu_amax, fp8_max(f), 0, true);
      CUDA_CHECK(cudaMemcpy(dscale.ptr, &scale, sizeof scale, cudaMemcpyHostToDevice));
      cuda::quantize_with_scale(dx.ptr, rows * cols, f, dscale.ptr, dq.ptr, dscale_inv.ptr, dcounts.ptr, nullptr);
      EXPECT_EQ(dq.get(), cpu.data);
      EXPECT_EQ(dscale_inv.get()[0], cpu.scale_inv[0]);
      const auto counts = dcounts.get();
      EXPECT_EQ(int64_t(counts[0]), cpu.saturated);
      EXPECT_EQ(int64_t(counts[1]), cpu.underflowed);
    }
}

TEST_F(CudaOps, TiledQuantizeMatchesCpuBitwise) {
  struct Variant {
    Fp8Dtype dtype;
    ScaleOptions opt;
  };
  for (Variant v : {Variant{Fp8Dtype::e4m3, {0, true}}, Variant{Fp8Dtype::e5m2, {0, true}},
                    Variant{Fp8Dtype::e4m3, {0, false}}, Variant{Fp8Dtype::e4m3, {3, true}}})
    for (Tiling t : {Tiling::rows_1xT, Tiling::cols_Tx1, Tiling::blocks_TxT})
      for (int tile : {128, 32})
        for (auto [rows, cols] : {std::pair<int64_t, int64_t>{1, 300}, {257, 130}, {1024, 512}}) {
          SCOPED_TRACE(testing::Message() << to_string(v.dtype) << " pow2 " << v.opt.power_of_two << " margin "
                                          << v.opt.margin << " " << to_string(t) << " T" << tile << " " << rows << "x" << cols);
          std::vector<float> x = scaled_normal(rows, cols, 7 + rows + tile);
          // An all-zero first tile, a NaN, and a denormal-only region (amax near FLT_MIN: the clamp).
          for (int64_t c = 0; c < std::min<int64_t>(cols, tile); ++c) x[c] = 0.0f;
          if (rows * cols > 400) x[400] = NAN;
          if (rows > 40) {
            for (int64_t c = 0; c < cols; ++c) x[40 * cols + c] = 1e-39f * float(c % 3);
          }
          QuantTensor cpu;
          quantize_tiled(x.data(), rows, cols, t, tile, v.dtype, v.opt, &cpu);
          Device<float> dx(x.size(), x.data()), dsi(cpu.scale_inv.size());
          Device<uint8_t> dq(x.size());
          Device<unsigned long long> dcounts(2);
          cuda::quantize_tiled(dx.ptr, rows, cols, t, tile, v.dtype, v.opt, dq.ptr, dsi.ptr, dcounts.ptr, nullptr);
          EXPECT_EQ(dq.get(), cpu.data);
          const std::vector<float> gpu_si = dsi.get();
          ASSERT_EQ(gpu_si.size(), cpu.scale_inv.size());
          for (size_t i = 0; i < gpu_si.size(); ++i) ASSERT_EQ(float_bits(gpu_si[i]), float_bits(cpu.scale_inv[i])) << i;
          const auto counts = dcounts.get();
          EXPECT_EQ(int64_t(counts[0]), cpu.saturated);
          EXPECT_EQ(int64_t(counts[1]), cpu.underflowed);
        }
}

TEST_F(CudaOps, DeviceScalesMatchCpu) {
  // Current scaling and the delayed-scaling history, computed on the device, against the CPU.
  const std::vector<float> steps = {2.0f, 0.0f, 50.0f, NAN, 3.0f, 1e-30f, 7.0f};
  for (auto compute : {DelayedScaling::Compute::max, DelayedScaling::Compute::most_recent})
    for (Fp8Dtype f : {Fp8Dtype::e4m3, Fp8Dtype::e5m2}) {
      const ScaleOptions opt{1, true};
      DelayedScaling cpu = make_delayed_scaling(3);
      Device<float> history(3), damax(1), dscale(1, &cpu.scale);
      for (size_t s = 0; s < steps.size(); ++s) {
        std::vector<float> x(16, steps[s] * 0.5f);
        x[3] = steps[s];
        QuantTensor q;
        quantize_delayed(x.data(), 4, 4, f, cpu, compute, opt, {}, &q);
        CUDA_CHECK(cudaMemcpy(damax.ptr, &steps[s], sizeof(float), cudaMemcpyHostToDevice));
        cuda::delayed_update(history.ptr, 3, int64_t(s), damax.ptr, compute, f, opt, dscale.ptr, nullptr);
        EXPECT_EQ(float_bits(dscale.get()[0]), float_bits(cpu.scale)) << "step " << s;
        Device<float> current(1);
        cuda::scale_from_amax(damax.ptr, f, opt, current.ptr, nullptr);
        EXPECT_EQ(float_bits(current.get()[0]), float_bits(compute_scale(steps[s], fp8_max(f), 1, true))) << "step " << s;
      }
    }
}

TEST_F(CudaOps, HardwareConversionMatchesEncoder) {
  // cvt.rn.satfinite (sm_89+) for saturating mode; cuda_fp8.h's software path otherwise: both
  // against kernels/fp8.h on 2^24 random bit patterns and every boundary-heavy exponent.
  const int64_t n = int64_t(1) << 24;
  std::mt19937 rng(99);
  std::vector<float> x(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    uint32_t u = rng();
    if (i & 1) u = (u & 0x807FFFFFu) | ((100u + (u >> 23) % 60u) << 23);
    x[i] = bits_float(u);
  }
  Device<float> dx(x.size(), x.data());
  Device<uint8_t> dq(x.size());
  for (Fp8Dtype f : {Fp8Dtype::e4m3, Fp8Dtype::e5m2})
    for (bool sat : {true, false}) {
      cuda::convert_hw(dx.ptr, n, f, sat, dq.ptr, nullptr);
      const std::vector<uint8_t> q = dq.get();
      int64_t mismatches = 0;
      for (int64_t i = 0; i < n; ++i) mismatches += q[i] != fp8_encode(x[i], f, sat);
      EXPECT_EQ(mismatches, 0) << to_string(f) << (sat ? " satfinite" : " nosat");
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
