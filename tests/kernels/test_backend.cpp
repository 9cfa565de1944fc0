// The backends' memory and transfer contract (kernels/backend.h, kernels/tensor.h): tensors of
// every dtype, the emulated device's refusal of host access (a dereference of its memory faults; a
// host pointer given to one of its ops is fatal), downloads visible only after sync(), and the
// counts of host synchronisations and bytes each way.
#include <gtest/gtest.h>

#include <csignal>
#include <cstdio>
#include <cstring>
#include <memory>
#include <vector>

#include "kernels/backend.h"
#include "kernels/host_backend.h"

namespace fp8moe {
namespace {

TEST(Backend, TensorsOfEveryDtypeRoundTripOnCpuAndEmulated) {
  for (DeviceKind kind : {DeviceKind::cpu, DeviceKind::emulated}) {
    const std::unique_ptr<Backend> be = make_backend(kind);
    const std::vector<float> f = {1.5f, -2.0f, 3.25f};
    const std::vector<int64_t> i = {-1, 1LL << 40};
    const std::vector<uint16_t> b = {0x3F80, 0xC000};
    EXPECT_EQ(to_host<float>(tensor_from(*be, f, {3})), f) << to_string(kind);
    EXPECT_EQ(to_host<int64_t>(tensor_from(*be, i, {2})), i) << to_string(kind);
    EXPECT_EQ(to_host<uint16_t>(tensor_from(*be, b, {1, 2})), b) << to_string(kind);
    const Tensor z = Tensor::zeros(*be, DType::f64, {4, 2});
    EXPECT_EQ(z.numel(), 8);
    EXPECT_EQ(z.bytes(), 64u);
    EXPECT_EQ(to_host<double>(z), std::vector<double>(8, 0.0));
    const Tensor empty(*be, DType::f32, {0, 5});
    EXPECT_TRUE(empty.empty());
    EXPECT_EQ(empty.raw(), nullptr);
    EXPECT_EQ(empty.view().device, kind);
  }
}

TEST(Backend, MemoryIsCountedAndReturned) {
  const std::unique_ptr<Backend> be = make_backend(DeviceKind::emulated);
  const int64_t before = be->memory_stats().in_use;
  {
    const Tensor t(*be, DType::f32, {1000});
    EXPECT_EQ(be->memory_stats().in_use, before + 4000);
    EXPECT_GE(be->memory_stats().peak, before + 4000);
  }
  EXPECT_EQ(be->memory_stats().in_use, before);
}

// The cpu kind keeps released blocks for the next request of about their size (a step frees and
// allocates the same tensors every micro-batch); the blocks it holds, live and cached, never exceed
// the most its live blocks have needed. The emulated kind frees at once.
TEST(Backend, CpuReusesReleasedBlocksWithinItsHighWater) {
  constexpr size_t kMiB = size_t(1) << 20;
  EXPECT_EQ(HostBackend::block_size(1), 256u);
  EXPECT_EQ(HostBackend::block_size(kMiB - 1), kMiB);
  EXPECT_EQ(HostBackend::block_size(kMiB + 1), kMiB + (64 << 10));
  HostBackend be(DeviceKind::cpu);
  void* a = be.allocate(4 * kMiB);
  be.release(a);
  EXPECT_EQ(be.memory_stats().in_use, 0);
  EXPECT_EQ(be.memory_stats().reserved, int64_t(4 * kMiB)) << "the released block is kept";
  void* b = be.allocate(3 * kMiB + kMiB / 2);  // wastes an eighth of the cached block: taken
  EXPECT_EQ(b, a);
  EXPECT_EQ(be.cache_stats().hits, 1);
  EXPECT_EQ(be.memory_stats().in_use, int64_t(3 * kMiB + kMiB / 2));
  be.release(b);
  // A request that would waste over a quarter of the cached block misses; the cached block goes,
  // since keeping it would hold 5 MiB where the live blocks never needed more than 4.
  void* c = be.allocate(kMiB);
  EXPECT_EQ(be.cache_stats().misses, 2);
  EXPECT_EQ(be.cache_stats().evictions, 1);
  EXPECT_EQ(be.memory_stats().reserved, int64_t(kMiB));
  // Under the high water the cache keeps blocks of several sizes.
  void* d = be.allocate(2 * kMiB);
  be.release(c);
  be.release(d);
  EXPECT_EQ(be.cache_stats().cached_bytes, int64_t(3 * kMiB));
  EXPECT_EQ(be.allocate(2 * kMiB), d);
  EXPECT_EQ(be.allocate(kMiB), c);
  EXPECT_EQ(be.cache_stats().cached_bytes, 0);
  be.release(c);
  be.release(d);

  HostBackend emu(DeviceKind::emulated);
  emu.release(emu.allocate(4 * kMiB));
  EXPECT_EQ(emu.memory_stats().reserved, 0) << "the emulated kind keeps nothing";
  EXPECT_EQ(emu.cache_stats().hits, 0);
  EXPECT_EQ(emu.cache_stats().cached_bytes, 0);
}

TEST(Backend, TransfersAndSynchronisationsAreCounted) {
  for (DeviceKind kind : {DeviceKind::cpu, DeviceKind::emulated}) {
    const std::unique_ptr<Backend> be = make_backend(kind);
    const TransferCounts c0 = be->transfers();
    Tensor t(*be, DType::f32, {256});
    const std::vector<float> v(256, 2.0f);
    be->upload(t.raw(), v.data(), 1024);
    HostBuffer<float> h(*be, 256);
    be->download(h.data(), t.raw(), 1024);
    be->sync();
    const TransferCounts d = be->transfers() - c0;
    EXPECT_EQ(d.h2d_bytes, 1024) << to_string(kind);
    EXPECT_EQ(d.d2h_bytes, 1024) << to_string(kind);
    EXPECT_EQ(d.host_syncs, 1) << to_string(kind);
    EXPECT_EQ(h[255], 2.0f);
  }
}

// On a GPU a device-to-host copy into pageable memory blocks the host until it is done: the
// emulated device counts it as the synchronisation it is, so its counts are the GPU's.
TEST(Backend, EmulatedDownloadToPageableMemoryIsASynchronisation) {
  const std::unique_ptr<Backend> be = make_backend(DeviceKind::emulated);
  const Tensor t = tensor_from(*be, std::vector<float>{7.0f}, {1});
  float pageable = 0;
  const int64_t s0 = be->transfers().host_syncs;
  be->download(&pageable, t.raw(), 4);
  EXPECT_EQ(be->transfers().host_syncs, s0 + 1);
  EXPECT_EQ(pageable, 7.0f);
}

TEST(Backend, EmulatedDownloadIsVisibleOnlyAfterSync) {
  const std::unique_ptr<Backend> be = make_backend(DeviceKind::emulated);
  const Tensor t = tensor_from(*be, std::vector<int32_t>{5, 6}, {2});
  HostBuffer<int32_t> h(*be, 2);
  h[0] = h[1] = 0;
  be->download(h.data(), t.raw(), 8);
  EXPECT_EQ(h[0], -1) << "poisoned until the synchronisation";  // 0xFFFFFFFF
  be->sync();
  EXPECT_EQ(h[0], 5);
  EXPECT_EQ(h[1], 6);
}

TEST(BackendDeathTest, EmulatedDeviceMemoryCannotBeReadOnTheHost) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  const std::unique_ptr<Backend> be = make_backend(DeviceKind::emulated);
  const Tensor t = tensor_from(*be, std::vector<float>{1.0f, 2.0f}, {2});
  const volatile float* p = t.f32();
  // A load through the tagged address is a general-protection fault: SIGSEGV.
  EXPECT_EXIT({ std::printf("%f\n", double(p[1])); }, testing::KilledBySignal(SIGSEGV), "");
  // A write too.
  float* w = const_cast<float*>(t.f32());
  EXPECT_EXIT({ w[0] = 3.0f; std::printf("%f\n", double(w[0])); }, testing::KilledBySignal(SIGSEGV), "");
  // memcpy (what a communicator or a file write would do).
  EXPECT_EXIT({ float x[2]; std::memcpy(x, t.f32(), 8); std::printf("%f\n", double(x[0])); },
              testing::KilledBySignal(SIGSEGV), "");
  // The backend's own download reads it.
  EXPECT_EQ(to_host<float>(t)[1], 2.0f);
}

TEST(BackendDeathTest, EmulatedOpsRefuseHostMemory) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  const std::unique_ptr<Backend> be = make_backend(DeviceKind::emulated);
  std::vector<float> host(4, 1.0f);
  Tensor out(*be, DType::f32, {4});
  EXPECT_DEATH(be->add(host.data(), host.data(), out.f32(), 4), "a host pointer given to an op of the emulated device");
  // And the cpu backend refuses the emulated device's memory.
  const std::unique_ptr<Backend> cpu = make_backend(DeviceKind::cpu);
  EXPECT_DEATH(cpu->add(out.f32(), out.f32(), host.data(), 4), "emulated device memory given to a cpu backend op");
}

}  // namespace
}  // namespace fp8moe
