#include "kernels/cuda/context.h"

#include <map>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "kernels/check.h"

namespace fp8moe::cuda {
namespace {

struct Arena {
  std::mutex mu;
  std::map<size_t, std::vector<void*>> free_blocks;  // rounded size -> cached blocks
  std::unordered_map<void*, size_t> live;             // handed-out block -> rounded size
  ArenaStats stats;
};
Arena& arena() {
  static Arena* a = new Arena;  // NOTE: leaked on purpose: freed blocks may be returned during static destruction
  return *a;
}

size_t round_size(size_t bytes) {
  constexpr size_t kSmall = 512, kLarge = size_t(2) << 20;
  return bytes < (size_t(1) << 20) ? (bytes + kSmall - 1) / kSmall * kSmall : (bytes + kLarge - 1) / kLarge * kLarge;
}

Context* g_ctx = nullptr;
cudaEvent_t g_compute_done = nullptr, g_comm_done = nullptr;

}  // namespace

Context& context(int device) {
  if (g_ctx) {
    FP8MOE_ASSERT(g_ctx->device == device, "the CUDA context is on device ", g_ctx->device, ", asked for ", device);
    return *g_ctx;
  }
  CUDA_CHECK(cudaSetDevice(device));
  auto* c = new Context;
  c->device = device;
  CUDA_CHECK(cudaStreamCreateWithFlags(&c->compute, cudaStreamNonBlocking));
  CUDA_CHECK(cudaStreamCreateWithFlags(&c->comm, cudaStreamNonBlocking));
  CUDA_CHECK(cudaEventCreateWithFlags(&g_compute_done, cudaEventDisableTiming));
  CUDA_CHECK(cudaEventCreateWithFlags(&g_comm_done, cudaEventDisableTiming));
  CUBLAS_CHECK(cublasLtCreate(&c->lt));
  c->workspace_bytes = size_t(32) << 20;  // as Transformer Engine gives cuBLASLt on Hopper
  g_ctx = c;
  c->workspace = arena_alloc(c->workspace_bytes);
  return *c;
}

Context& context() {
  FP8MOE_ASSERT(g_ctx, "no CUDA context: runtime.device is not cuda in this process");
  return *g_ctx;
}

bool has_context() { return g_ctx != nullptr; }

void comm_waits_for_compute() {
  Context& c = context();
  CUDA_CHECK(cudaEventRecord(g_compute_done, c.compute));
  CUDA_CHECK(cudaStreamWaitEvent(c.comm, g_compute_done, 0));
}

void compute_waits_for_comm() {
  Context& c = context();
  CUDA_CHECK(cudaEventRecord(g_comm_done, c.comm));
  CUDA_CHECK(cudaStreamWaitEvent(c.compute, g_comm_done, 0));
}

void* arena_alloc(size_t bytes) {
  if (bytes == 0) return nullptr;
  Arena& a = arena();
  const size_t size = round_size(bytes);
  std::lock_guard<std::mutex> lock(a.mu);
  void* p = nullptr;
  auto it = a.free_blocks.find(size);
  if (it != a.free_blocks.end() && !it->second.empty()) {
    p = it->second.back();
    it->second.pop_back();
  } else {
    cudaError_t err = cudaMalloc(&p, size);
    if (err == cudaErrorMemoryAllocation) {  // give the cache back and try once more
      (void)cudaGetLastError();
      for (auto& [sz, blocks] : a.free_blocks)
        for (void* b : blocks) {
          CUDA_CHECK(cudaFree(b));
          a.stats.reserved -= int64_t(sz);
        }
      a.free_blocks.clear();
      err = cudaMalloc(&p, size);
    }
    if (err != cudaSuccess)
      fatal_error(__FILE__, __LINE__,
                  detail::concat("cudaMalloc of ", size, " bytes failed (", a.stats.in_use, " in use, ",
                                 a.stats.reserved, " reserved, peak ", a.stats.peak, "): ", cudaGetErrorString(err)));
    a.stats.reserved += int64_t(size);
  }
  a.live[p] = size;
  a.stats.in_use += int64_t(size);
  if (a.stats.in_use > a.stats.peak) a.stats.peak = a.stats.in_use;
  return p;
}

void arena_free(void* p) {
  if (!p) return;
  Arena& a = arena();
  std::lock_guard<std::mutex> lock(a.mu);
  auto it = a.live.find(p);
  FP8MOE_ASSERT(it != a.live.end(), "arena_free of a pointer the arena did not hand out");
  // NOTE: the block is reused by later work on the compute stream only; all our kernels run there,
  // so stream order makes the reuse safe without a synchronisation.
  a.free_blocks[it->second].push_back(p);
  a.stats.in_use -= int64_t(it->second);
  a.live.erase(it);
}

void arena_release_cache() {
  Arena& a = arena();
  std::lock_guard<std::mutex> lock(a.mu);
  if (g_ctx) CUDA_CHECK(cudaStreamSynchronize(g_ctx->compute));
  for (auto& [sz, blocks] : a.free_blocks)
    for (void* b : blocks) {
      CUDA_CHECK(cudaFree(b));
      a.stats.reserved -= int64_t(sz);
    }
  a.free_blocks.clear();
}

ArenaStats arena_stats() {
  Arena& a = arena();
  std::lock_guard<std::mutex> lock(a.mu);
  return a.stats;
}

void arena_reset_peak() {
  Arena& a = arena();
  std::lock_guard<std::mutex> lock(a.mu);
  a.stats.peak = a.stats.in_use;
}

void upload(void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return;
  cudaStream_t s = context().compute;
  CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, s));
  // NOTE: from pageable memory the async copy "might be synchronous with respect to host" (CUDA's
  // API synchronization behavior): nothing documented says the source has been read when it
  // returns, so wait, and the caller may reuse its buffer at once.
  CUDA_CHECK(cudaStreamSynchronize(s));
}

void download(void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return;
  cudaStream_t s = context().compute;
  CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, s));
  CUDA_CHECK(cudaStreamSynchronize(s));
}

}  // namespace fp8moe::cuda
