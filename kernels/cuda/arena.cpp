#include "kernels/cuda/arena.h"

#include <algorithm>

#include "kernels/check.h"

namespace fp8moe::cuda {

namespace {
constexpr size_t kSmallGranule = 512;                 // below kLargeFrom
constexpr size_t kLargeGranule = size_t(2) << 20;     // 2 MiB, from kLargeFrom on
constexpr size_t kLargeFrom = size_t(1) << 20;        // 1 MiB
}  // namespace

size_t Arena::round_size(size_t bytes) {
  const size_t g = bytes < kLargeFrom ? kSmallGranule : kLargeGranule;
  return (bytes + g - 1) / g * g;
}

Arena::~Arena() {
  // NOTE: no CUDA_CHECK here: a destructor that runs while the job is already failing (a sticky
  // CUDA error) must not turn that error into a second fatal report.
  (void)cudaStreamSynchronize(stream_);
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [size, blocks] : free_)
    for (void* b : blocks) (void)cudaFree(b);
  free_.clear();
  for (auto& [p, size] : live_) (void)cudaFree(p);
  live_.clear();
}

void Arena::free_cached_locked() {
  for (auto& [size, blocks] : free_)
    for (void* b : blocks) {
      CUDA_CHECK(cudaFree(b));
      stats_.reserved -= int64_t(size);
    }
  free_.clear();
}

void* Arena::allocate(size_t bytes) {
  if (bytes == 0) return nullptr;
  const size_t size = round_size(bytes);
  std::lock_guard<std::mutex> lock(mu_);
  void* p = nullptr;
  // Best fit: the smallest cached block at least this size, unless it wastes more than a quarter
  // (at least one large granule): the MoE's tensors change size with every routing, and reuse of
  // exactly one size alone would make every new expert row count a new cudaMalloc in the step.
  auto it = free_.lower_bound(size);
  while (it != free_.end() && it->second.empty()) ++it;
  if (it != free_.end() && it->first <= size + std::max(size / 4, kLargeGranule)) {
    p = it->second.back();
    it->second.pop_back();
    live_[p] = it->first;
    stats_.in_use += int64_t(it->first);
    if (stats_.in_use > stats_.peak) stats_.peak = stats_.in_use;
    return p;
  } else {
    cudaError_t err = cudaMalloc(&p, size);
    if (err == cudaErrorMemoryAllocation) {
      // Give the cache back and try once more. The cached blocks may still be read by queued
      // work (stream-ordered reuse), so the stream is finished first.
      (void)cudaGetLastError();  // clear the (non-sticky) allocation error
      // NOTE: a host wait outside Backend::sync, so not counted: an arena out of memory, never a
      // step of a run that fits. The compute stream covers the communication stream's work, which
      // every collective joins back into it (arena.h).
      CUDA_CHECK(cudaStreamSynchronize(stream_));
      free_cached_locked();
      err = cudaMalloc(&p, size);
    }
    if (err != cudaSuccess)
      fatal_error(__FILE__, __LINE__,
                  detail::concat("cudaMalloc of ", size, " bytes (", bytes, " asked) failed with ", stats_.in_use,
                                 " bytes in use, ", stats_.reserved, " reserved, peak ", stats_.peak, ": ",
                                 cudaGetErrorName(err), ": ", cudaGetErrorString(err)));
    stats_.reserved += int64_t(size);
  }
  live_[p] = size;
  stats_.in_use += int64_t(size);
  if (stats_.in_use > stats_.peak) stats_.peak = stats_.in_use;
  return p;
}

void Arena::release(void* p) {
  if (!p) return;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = live_.find(p);
  FP8MOE_ASSERT(it != live_.end(), "release of device memory this backend's arena did not hand out");
  // Stream-ordered reuse: see the NOTE in arena.h.
  free_[it->second].push_back(p);
  stats_.in_use -= int64_t(it->second);
  live_.erase(it);
}

void Arena::release_cache() {
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  std::lock_guard<std::mutex> lock(mu_);
  free_cached_locked();
}

MemoryStats Arena::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

void Arena::reset_peak() {
  std::lock_guard<std::mutex> lock(mu_);
  stats_.peak = stats_.in_use;
}

}  // namespace fp8moe::cuda
