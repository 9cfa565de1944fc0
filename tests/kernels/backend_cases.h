// The backend comparison cases of the kernel tests (tests/kernels/test_<op>.cpp): each op run
// through the CPU backend and through the device backend under test from the same inputs, the
// results brought back to the host and compared.
//
//   DeviceOps  parameterized over the device backend (kernels/backend.h):
//              emulated  always: the CPU kernels on tagged memory the host cannot read (a host
//                        dereference faults, a host pointer given to an op is fatal), so every
//                        result must equal the CPU backend's BITWISE (expect_match asserts that);
//              cuda      the GPU: within each test's measured bounds; SKIPPED with the reason
//                        where no device is visible or CUDA is not built in.
//              Full names DeviceOps.<Name>/emulated and DeviceOps.<Name>/cuda (one instantiation,
//              in backend_cases.cpp).
//   CudaOps    what only the CUDA backend has (the hardware FP8 conversion, the arena, cuBLASLt):
//              SKIPPED likewise without a device.
//
// Outputs start as 0xFF bytes (poisoned(): NaN floats, -1 integers), so that a result an op did
// not write cannot pass for a written one, and every case also checks the CPU backend against the
// CPU kernel called directly on host vectors: a backend that passes a wrong pointer to a kernel, or
// forgets a result, differs from it (the emulated backend alone would agree with the CPU backend,
// both being the same HostBackend code).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "kernels/backend.h"
#include "kernels/quantize.h"
#include "kernels/tensor.h"

namespace fp8moe {
// gtest's name for a DeviceOps parameter ("emulated", "cuda"), in test listings and failures.
inline void PrintTo(DeviceKind kind, std::ostream* os) { *os << to_string(kind); }
}  // namespace fp8moe

namespace fp8moe::test {

// The backends the cases use, made once and shared by every case (the CUDA one holds streams, a
// cuBLASLt handle and an arena); release_backends() destroys them.
Backend& backend_of(DeviceKind kind);
void release_backends();
// Why this process cannot run the CUDA cases ("" when a device is visible and CUDA is built in).
std::string cuda_unavailable_reason();
// Why the CUDA device cannot run the FP8 GEMMs of this scaling ("" when it can, or without CUDA).
std::string cuda_fp8_gemm_unsupported(bool blockwise);

class DeviceOps : public testing::TestWithParam<DeviceKind> {
 protected:
  static void TearDownTestSuite() { release_backends(); }
  void SetUp() override {
    if (GetParam() == DeviceKind::cuda)
      if (const std::string why = cuda_unavailable_reason(); !why.empty()) GTEST_SKIP() << "no CUDA device: " << why;
  }
  static Backend& cpu() { return backend_of(DeviceKind::cpu); }
  Backend& dev() const { return backend_of(GetParam()); }
  // Whether the device backend must reproduce the CPU backend's bits (the emulated device).
  bool exact() const { return GetParam() == DeviceKind::emulated; }
  bool is_cpu(const Backend& be) const { return &be == &cpu(); }
  // fn(be) on the CPU backend, then on the device backend.
  template <class Fn>
  auto both(Fn&& fn) const {
    auto c = fn(cpu());
    auto g = fn(dev());
    return std::make_pair(std::move(c), std::move(g));
  }
  // The device's result against the CPU backend's: bitwise on the emulated device, else
  // |got - cpu| <= tol max|cpu| + floor (see expect_near_rel).
  template <class T>
  void expect_match(const std::vector<T>& got, const std::vector<T>& cpu_result, double tol, const char* what,
                    double floor = 0) const;
};

class CudaOps : public testing::Test {
 protected:
  static void TearDownTestSuite() { release_backends(); }
  void SetUp() override {
    if (const std::string why = cuda_unavailable_reason(); !why.empty()) GTEST_SKIP() << "no CUDA device: " << why;
  }
  static Backend& gpu() { return backend_of(DeviceKind::cuda); }
  static Backend& cpu() { return backend_of(DeviceKind::cpu); }
};

// ---- memory -------------------------------------------------------------------------------------
template <class T>
Tensor up(Backend& be, const std::vector<T>& v) {
  return tensor_from(be, v, {int64_t(v.size())});
}
template <class T>
std::vector<T> down(const Tensor& t) {
  return to_host<T>(t);
}
// An FP8 tensor quantized on the host, in a backend's memory.
QTensor up(Backend& be, const QuantTensor& q);
// n elements of dtype in be's memory, every byte 0xFF.
Tensor poisoned(Backend& be, DType dtype, int64_t n);
// An FP8 tensor's bytes and scales, every byte 0xFF.
QTensor poisoned(Backend& be, int64_t rows, int64_t cols, Fp8Dtype dtype, Tiling tiling, int tile);
// Host vectors poisoned the same way (for the direct kernel calls).
std::vector<float> poisoned_f32(int64_t n);
std::vector<double> poisoned_f64(int64_t n);

// ---- comparisons --------------------------------------------------------------------------------
// Element by element, as bit patterns (NaN payloads and the sign of zero included); reports the
// first difference.
template <class T>
void expect_bitwise(const std::vector<T>& got, const std::vector<T>& want, const char* what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i)
    ASSERT_EQ(std::memcmp(&got[i], &want[i], sizeof(T)), 0)
        << what << ": element " << i << " of " << got.size() << ": " << +got[i] << " vs " << +want[i];
}
// The tensor still holds what it was made from (an op wrote into one of its inputs otherwise).
template <class T>
void expect_unchanged(const Tensor& t, const std::vector<T>& original, const char* what) {
  expect_bitwise(down<T>(t), original, what);
}
// |got - want| <= tol max|want| + floor, element by element (floor: an absolute allowance for
// results that cancel to nothing, whose rounding is relative to their terms, not to themselves).
template <class T>
void expect_near_rel(const std::vector<T>& got, const std::vector<T>& want, double tol, const char* what,
                     double floor = 0) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double scale = 0;
  for (T v : want) scale = std::max(scale, double(std::abs(v)));
  for (size_t i = 0; i < got.size(); ++i)
    ASSERT_LE(std::abs(double(got[i]) - double(want[i])), tol * scale + floor + 1e-30)
        << what << " element " << i << " of " << got.size() << ": " << got[i] << " vs " << want[i];
}

template <class T>
void DeviceOps::expect_match(const std::vector<T>& got, const std::vector<T>& cpu_result, double tol,
                             const char* what, double floor) const {
  if (exact()) expect_bitwise(got, cpu_result, what);
  else expect_near_rel(got, cpu_result, tol, what, floor);
}

double max_abs(const std::vector<float>& v);

}  // namespace fp8moe::test
