// What only the CUDA backend (kernels/cuda/backend.h) has: its caching arena, ops and transfers
// queued without host synchronisation, and the cuBLASLt library. SKIPPED with the reason where no
// device is visible or CUDA is not built in (backend_cases.h). The memory and transfer contract of
// the host backends is tests/kernels/test_backend.cpp's; every op's comparison with the CPU is in
// its own test_<op>.cpp.
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "kernels/backend.h"
#include "tests/kernels/backend_cases.h"
#if FP8MOE_HAVE_CUDA
#include <cublasLt.h>

#include "kernels/check.h"
#endif

namespace fp8moe::test {
namespace {

TEST_F(CudaOps, CublasLtHandleCanBeCreated) {
#if FP8MOE_HAVE_CUDA
  cublasLtHandle_t handle = nullptr;
  CUBLAS_CHECK(cublasLtCreate(&handle));
  EXPECT_NE(handle, nullptr);
  CUBLAS_CHECK(cublasLtDestroy(handle));
#endif
}

TEST_F(CudaOps, ArenaCachesAndCountsPeak) {
  Backend& be = gpu();
  be.reset_peak();
  const MemoryStats before = be.memory_stats();
  void* a = be.allocate(3 << 20);
  const MemoryStats held = be.memory_stats();
  EXPECT_EQ(held.in_use - before.in_use, 4 << 20) << "3 MiB rounds up to 4 MiB (2 MiB granules)";
  be.release(a);
  void* b = be.allocate(3 << 20);
  EXPECT_EQ(a, b) << "a freed block of the same size is reused";
  EXPECT_EQ(be.memory_stats().reserved, held.reserved) << "no new cudaMalloc";
  be.release(b);
  EXPECT_GE(be.memory_stats().peak - before.in_use, 4 << 20);
  EXPECT_EQ(be.memory_stats().in_use, before.in_use);
  void* small = be.allocate(1);
  EXPECT_EQ(be.memory_stats().in_use - before.in_use, 512) << "small blocks round to 512 bytes";
  EXPECT_EQ(reinterpret_cast<uintptr_t>(small) % 256, 0u) << "256-byte aligned";
  be.release(small);
  EXPECT_EQ(be.allocate(0), nullptr);
  EXPECT_GE(before.reserved, before.in_use);
}

TEST_F(CudaOps, OpsQueueWithoutHostSynchronisation) {
  // Pinned transfers and ops only queue work; the host waits in sync() alone (counted). An upload
  // from pageable memory goes through the backend's 64 MiB pinned bounce buffer without a wait,
  // until the buffer fills: then the host waits once for the copies queued from it.
  Backend& be = gpu();
  EXPECT_EQ(be.describe().rfind("cuda: ", 0), 0u) << be.describe();
  const int64_t n = (1 << 20) + 1;
  HostBuffer<float> h(be, n);
  for (int64_t i = 0; i < n; ++i) h[i] = float(i % 1000) * 0.25f;
  const TransferCounts start = be.transfers();
  Tensor a(be, DType::f32, {n}), b(be, DType::f32, {n}), sum(be, DType::f32, {n}), amax(be, DType::f32, {1});
  be.upload(a.raw(), h.data(), size_t(n) * 4);
  be.copy(b.raw(), a.raw(), size_t(n) * 4);
  be.add(a.f32(), b.f32(), sum.f32(), n);
  be.amax(sum.f32(), n, amax.f32());
  be.copy(sum.f32() + 1, sum.f32(), size_t(n - 1) * 4);  // overlapping: as memmove
  HostBuffer<float> r(be, n);
  be.download(r.data(), sum.f32(), size_t(n) * 4);
  TransferCounts d = be.transfers() - start;
  EXPECT_EQ(d.host_syncs, 0);
  EXPECT_EQ(d.h2d_bytes, n * 4);
  EXPECT_EQ(d.d2h_bytes, n * 4);
  be.sync();
  EXPECT_EQ((be.transfers() - start).host_syncs, 1);
  EXPECT_EQ(r[0], 2 * h[0]);
  for (int64_t i = 1; i < n; ++i) ASSERT_EQ(r[i], 2 * h[i - 1]) << i;
  const std::vector<float> pageable(static_cast<size_t>(n), 1.0f);
  be.upload(a.raw(), pageable.data(), size_t(n) * 4);
  EXPECT_EQ((be.transfers() - start).host_syncs, 1) << "a 4 MiB pageable upload fits the bounce buffer";
  // 80 MiB from pageable memory: the 64 MiB buffer fills once, so one wait, and the data arrive.
  const int64_t big = int64_t(20) << 20;
  const std::vector<float> large(static_cast<size_t>(big), 3.0f);
  Tensor t(be, DType::f32, {big});
  be.upload(t.raw(), large.data(), size_t(big) * 4);
  EXPECT_EQ((be.transfers() - start).host_syncs, 2) << "one wait for the full bounce buffer";
  const std::vector<float> back = to_host<float>(be, t.f32() + big - 4, 4);
  EXPECT_EQ(back, std::vector<float>(4, 3.0f));
}

}  // namespace
}  // namespace fp8moe::test
