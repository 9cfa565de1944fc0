// The CUDA backend (kernels/backend.h) of one GPU: its compute stream (every kernel, GEMM and
// transfer) and communication stream (NCCL), ordered by events and never by host synchronisation;
// the cuBLASLt handle and workspace; a caching arena over cudaMalloc that reports peak device
// memory; pinned host memory (cudaMallocHost) for transfers. The ops are the launchers of
// kernels/cuda/<op>.cu on the compute stream.
//
// NOTE: one CudaBackend per process and device: it makes its device current (cudaSetDevice) when
// it is created, and every call assumes that device is current.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <memory>

#include "kernels/backend.h"

namespace fp8moe {

class CudaBackend;

// Creates the backend of CUDA device `ordinal` (fatal when it cannot be used).
std::unique_ptr<Backend> make_cuda_backend(int ordinal, const BackendOptions& options = {});

// The CUDA backend behind a Backend (fatal when be is not one).
CudaBackend& cuda_backend(Backend& be);

class CudaBackend : public Backend {
 public:
  using Backend::Backend;
  virtual int device() const = 0;
  virtual cudaStream_t compute_stream() const = 0;
  virtual cudaStream_t comm_stream() const = 0;
  // The communication stream waits for the work queued so far on the compute stream, and the
  // reverse: an event recorded on one and waited on by the other.
  virtual void comm_waits_for_compute() = 0;
  virtual void compute_waits_for_comm() = 0;
};

}  // namespace fp8moe
