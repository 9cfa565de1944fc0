// The communicator interface over NCCL (built with the CUDA backend only). One NCCL communicator
// per group: rank 0 of the MPI communicator creates the unique id and broadcasts it over MPI.
//
// NOTE: the model's tensors live in host memory in this version of the CUDA backend (README
// "CUDA backend"), so each call copies its host buffer to device memory from the arena, runs the
// NCCL operation on the context's communication stream (which first waits, by an event, for the
// work queued on the compute stream), and copies the result back. The byte counters count the
// payload as the MPI implementation does. Errors go through NCCL_CHECK / CUDA_CHECK (rank, host).
#pragma once

#include <mpi.h>
#include <nccl.h>

#include <vector>

#include "kernels/cuda/context.h"
#include "parallel/communicator.h"

namespace fp8moe {

class NcclCommunicator final : public Communicator {
 public:
  // Collective over `comm` (not owned; used for the id broadcast and for broadcast(string)).
  // Needs the CUDA context (set_compute_device(cuda) first).
  // `name` (static) names the group in the watchdog's report; the watchdog aborts the NCCL
  // communicator before it ends a hung job (parallel/watchdog.h).
  NcclCommunicator(MPI_Comm comm, const char* name);
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
  void broadcast(std::string& text, int root) override;
  void barrier() override;
  void allgather(const float* in, int64_t n, float* out) override;
  void reduce_scatter_sum(const float* in, float* out, int64_t n) override;
  void reduce_scatterv_sum(const float* in, float* out, const int64_t* counts) override;
  void allgatherv(const float* in, float* out, const int64_t* counts) override;
  void alltoall(const int64_t* send, int64_t* recv, int64_t n) override;
  void alltoallv(const float* send, const int64_t* send_counts, float* recv, const int64_t* recv_counts) override;
  void send(const float* data, int64_t n, int peer, int tag) override;
  void recv(float* data, int64_t n, int peer, int tag) override;
  void isend(const float* data, int64_t n, int peer, int tag) override;
  void wait_sends() override;

  ncclComm_t nccl() const { return nccl_; }

 private:
  template <class T>
  void allreduce(T* data, int64_t n, ncclDataType_t type, ncclRedOp_t op);
  struct PendingSend {
    cuda::Buffer<float> data;  // the staged payload, kept until wait_sends
    int64_t n;
    int peer;
    bool posted;  // ncclSend issued (with a recv's group or by wait_sends)
  };
  void post_pending_sends();
  MPI_Comm comm_;
  const char* name_;
  ncclComm_t nccl_ = nullptr;
  int rank_ = 0, size_ = 1;
  std::vector<PendingSend> pending_;
};

}  // namespace fp8moe
