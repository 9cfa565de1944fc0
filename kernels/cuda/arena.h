// The caching device-memory arena of one CudaBackend (kernels/cuda/backend.h): cudaMalloc is called
// only when no cached block fits, and blocks go back to a free list on release. Blocks are rounded
// up (512 B below 1 MiB, 2 MiB from 1 MiB on) and cached per rounded size; a request takes the
// smallest cached block at least its size that wastes at most a quarter of it (or one 2 MiB
// granule), so tensors whose size changes from step to step (the MoE's) reuse blocks. When cudaMalloc fails,
// the cache is given back to the driver and the allocation retried once; a second failure is fatal
// with the arena's figures. Never managed memory. Thread-safe.
//
// NOTE: reuse is stream-ordered on the backend's compute stream, without any host
// synchronisation: a block released while queued compute-stream work still uses it is handed out
// again only to work queued after that work, which the stream runs later. Work on any other stream
// (the NCCL communication stream) is joined back into the compute stream (an event the compute
// stream waits for, parallel/nccl_communicator.cpp) before the caller can release the blocks it
// used, so that reuse is safe for it too. Only giving memory back to the driver (release_cache)
// waits for the compute stream.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <map>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "kernels/backend.h"  // MemoryStats

namespace fp8moe::cuda {

class Arena {
 public:
  // Blocks are ordered on `stream` (the compute stream), which must outlive the arena.
  explicit Arena(cudaStream_t stream) : stream_(stream) {}
  // Waits for the stream and frees every block, cached or still handed out.
  ~Arena();
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;

  // 256-byte aligned (cudaMalloc's alignment; every rounded size is a multiple of 512); nullptr for 0.
  void* allocate(size_t bytes);
  void release(void* p);  // nullptr: nothing; a pointer not from this arena: fatal
  // Waits for the stream, then cudaFree of every cached block.
  void release_cache();
  // in_use and peak count rounded sizes; reserved is what cudaMalloc handed the arena.
  MemoryStats stats() const;
  void reset_peak();  // peak = in_use

  static size_t round_size(size_t bytes);

 private:
  void free_cached_locked();  // mu_ held; the stream already waited for

  cudaStream_t stream_;
  mutable std::mutex mu_;
  std::map<size_t, std::vector<void*>> free_;  // rounded size -> cached blocks (last released on top)
  std::unordered_map<void*, size_t> live_;      // handed-out block -> rounded size
  MemoryStats stats_;
};

}  // namespace fp8moe::cuda
