// The communicator interface over NCCL on one CUDA backend's device memory (built with the CUDA
// backend only). One NCCL communicator per group: rank 0 of the MPI communicator creates the
// unique id and broadcasts it over MPI.
//
// Every collective runs in place on the caller's device pointers (memory of the backend the
// communicator was made for), with no staging: the communication stream waits for the work queued
// so far on the compute stream (an event), the NCCL call(s) are queued on the communication
// stream, and the compute stream then waits for them (another event) before the call returns.
// Nothing waits on the host: the host sees the results through Backend::download and sync().
// NOTE: the compute stream waits for every blocking collective right away, so that the arena's
// stream-ordered reuse on the compute stream stays safe: a buffer the caller releases after the
// call is reused only by compute work that runs after the collective is done
// (kernels/cuda/arena.h). The posted collectives (ireduce_scatterv_sum, iallreduce_sum: the
// gradient reduction behind the backward; ialltoallv: the expert exchange behind the shared
// expert's and the experts' weight-gradient GEMMs) run on a stream of their own, after the compute work
// queued before the post, and the compute stream waits for each at its wait(): the caller keeps
// its buffers until then (parallel/communicator.h). They have their own stream so that the
// blocking collectives of the backward (the expert all-to-all, tensor parallelism's all-reduces),
// which the compute stream waits for, do not wait for them too. A call of this communicator issued
// while a post is pending (delayed scaling's amax all-reduce over the replicas) runs after the
// posted ones (its stream waits for theirs), so its NCCL operations keep the order they were
// issued in on every rank. Compiled; not run on a GPU.
//
// The byte counters count the payload as the MPI implementation does. Errors go through
// NCCL_CHECK / CUDA_CHECK (rank, host). Every call is marked for the watchdog (WatchScope), which
// aborts the live NCCL communicators before it ends a hung job (parallel/watchdog.h); since the
// calls only queue work, a hang inside NCCL shows in the host synchronisation that waits for it.
#pragma once

#include <mpi.h>
#include <nccl.h>

#include <vector>

#include "kernels/cuda/backend.h"
#include "kernels/tensor.h"
#include "parallel/communicator.h"

namespace fp8moe {

class NcclCommunicator final : public Communicator {
 public:
  // Collective over `comm` (not owned; used for the id broadcast and for broadcast(string)), on
  // the device of `be`, which must outlive this communicator. `name` (static) names the group in
  // the watchdog's report.
  NcclCommunicator(MPI_Comm comm, CudaBackend& be, const char* name);
  ~NcclCommunicator() override;
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  void allreduce_sum(float* data, int64_t n) override;
  void allreduce_sum(double* data, int64_t n) override;
  void allreduce_sum(int64_t* data, int64_t n) override;
  void allreduce_sum(uint64_t* data, int64_t n) override;
  void allreduce_max(float* data, int64_t n) override;
  void allreduce_max(double* data, int64_t n) override;
  // Text over MPI (host memory).
  void broadcast(std::string& text, int root) override;
  // Every rank has reached it and every operation queued before it has run: an NCCL all-reduce
  // of one value, then a (counted) host synchronisation of the backend.
  void barrier() override;
  void allgather(const float* in, int64_t n, float* out) override;
  void reduce_scatter_sum(const float* in, float* out, int64_t n) override;
  void reduce_scatterv_sum(const float* in, float* out, const int64_t* counts) override;
  // In place when in == out + this rank's displacement.
  void allgatherv(const float* in, float* out, const int64_t* counts) override;
  // send, recv: device memory (n values per rank); counts of alltoallv: host memory.
  void alltoall(const int64_t* send, int64_t* recv, int64_t n) override;
  void alltoallv(const float* send, const int64_t* send_counts, float* recv, const int64_t* recv_counts) override;
  void send(const float* data, int64_t n, int peer, int tag) override;
  void recv(float* data, int64_t n, int peer, int tag) override;
  // Deferred (see nccl_communicator.cpp): `data` must stay unchanged until wait_sends().
  void isend(const float* data, int64_t n, int peer, int tag) override;
  void wait_sends() override;
  int64_t ireduce_scatterv_sum(const float* in, float* out, const int64_t* counts) override;
  int64_t iallreduce_sum(float* data, int64_t n) override;
  int64_t ialltoallv(const float* send, const int64_t* send_counts, float* recv, const int64_t* recv_counts) override;
  void wait(int64_t ticket) override;
  bool overlaps() const override { return true; }

  ncclComm_t nccl() const { return nccl_; }

 private:
  template <class T>
  void allreduce(T* data, int64_t n, ncclDataType_t type, ncclRedOp_t op);
  struct PendingSend {
    const float* data;  // the caller's device memory, unchanged until wait_sends
    int64_t n;
    int peer;
    bool posted;  // ncclSend queued (in a recv's group or by wait_sends)
  };
  void post_pending_sends();  // inside an NCCL group
  // The posted collectives' stream (made at the first post): waits for the compute stream's work
  // so far; returns it.
  cudaStream_t post_stream();
  void comm_after_compute();  // the communication stream after the compute stream's work and the posts
  bool queued_reduce_scatterv(const float* in, float* out, const int64_t* counts, cudaStream_t s);
  // alltoallv's grouped sends and receives on `s` (its bytes counted).
  void queued_alltoallv(const float* send, const int64_t* send_counts, float* recv, const int64_t* recv_counts,
                        cudaStream_t s);
  int64_t posted(const char* what);  // records the post's completion event, returns its ticket
  struct Posted {
    int64_t ticket;
    const char* what;
    cudaEvent_t done;
  };
  cudaStream_t post_stream_ = nullptr;
  std::vector<Posted> posted_;
  MPI_Comm comm_;
  CudaBackend& be_;
  const char* name_;
  ncclComm_t nccl_ = nullptr;
  int rank_ = 0, size_ = 1;
  Tensor barrier_value_;  // one float of device memory for barrier()
  std::vector<PendingSend> pending_;
};

}  // namespace fp8moe
