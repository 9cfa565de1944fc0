// The CUDA context of this process: its device, a compute stream and a communication stream
// (ordered by events, never by host synchronisation), the cuBLASLt handle and workspace, and a
// caching arena over cudaMalloc (never managed memory) that reports peak device memory.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <utility>

namespace fp8moe::cuda {

struct Context {
  int device = -1;
  cudaStream_t compute = nullptr;  // every kernel and GEMM
  cudaStream_t comm = nullptr;     // NCCL collectives
  cublasLtHandle_t lt = nullptr;
  void* workspace = nullptr;       // cuBLASLt workspace (from the arena)
  size_t workspace_bytes = 0;
};

// Creates the context on `device` at the first call (later calls must name the same device).
Context& context(int device);
// The context created by context(device); fatal if none was.
Context& context();
bool has_context();

// The communication stream waits for the work queued so far on the compute stream, and the
// reverse: an event recorded on one and waited on by the other (no host synchronisation).
void comm_waits_for_compute();
void compute_waits_for_comm();

// Caching arena: blocks are rounded up (512 B below 1 MiB, 2 MiB above) and kept on a free list
// per rounded size after free; cudaMalloc is called only when no cached block fits, and once it
// fails the cache is released and the allocation retried before the error is fatal.
void* arena_alloc(size_t bytes);
void arena_free(void* p);
void arena_release_cache();  // cudaFree of every cached block
struct ArenaStats {
  int64_t in_use = 0, peak = 0, reserved = 0;
};
ArenaStats arena_stats();
void arena_reset_peak();

// RAII device memory of n elements of T from the arena.
template <class T>
class Buffer {
 public:
  Buffer() = default;
  explicit Buffer(int64_t n) : n_(n) { ptr_ = n > 0 ? static_cast<T*>(arena_alloc(size_t(n) * sizeof(T))) : nullptr; }
  ~Buffer() { reset(); }
  Buffer(Buffer&& o) noexcept : ptr_(std::exchange(o.ptr_, nullptr)), n_(std::exchange(o.n_, 0)) {}
  Buffer& operator=(Buffer&& o) noexcept {
    if (this != &o) reset(), ptr_ = std::exchange(o.ptr_, nullptr), n_ = std::exchange(o.n_, 0);
    return *this;
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  void reset() {
    if (ptr_) arena_free(ptr_);
    ptr_ = nullptr, n_ = 0;
  }
  T* get() const { return ptr_; }
  int64_t size() const { return n_; }

 private:
  T* ptr_ = nullptr;
  int64_t n_ = 0;
};

// Host <-> device copies on the compute stream (host memory is pageable here). Both wait for the
// stream: download() because the host reads the result next, upload() so that the host buffer may
// be reused as soon as it returns. Not for use inside a CUDA-graph capture.
void upload(void* dst, const void* src, size_t bytes);
void download(void* dst, const void* src, size_t bytes);
template <class T>
Buffer<T> to_device(const T* host, int64_t n) {
  Buffer<T> b(n);
  if (n > 0) upload(b.get(), host, size_t(n) * sizeof(T));
  return b;
}
template <class T>
void to_host(const Buffer<T>& b, T* host, int64_t n) {
  if (n > 0) download(host, b.get(), size_t(n) * sizeof(T));
}

}  // namespace fp8moe::cuda
