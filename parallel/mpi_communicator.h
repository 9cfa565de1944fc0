// The communicator over MPI (host memory). app/, io/ and parallel/ use it; model/ sees only the
// interface (parallel/communicator.h). Communicators on device memory: parallel/device_communicator.h.
#pragma once

#include <mpi.h>

#include <memory>
#include <string>
#include <vector>

#include "parallel/communicator.h"

namespace fp8moe {

// Over an MPI communicator (not owned; it must outlive this object). Errors are fatal
// (MPI_CHECK: every rank is aborted). `name` (static: "dp", "world") names the group in the
// watchdog's report (parallel/watchdog.h); every call is watched.
class MpiCommunicator final : public Communicator {
 public:
  explicit MpiCommunicator(MPI_Comm comm, const char* name = "world");
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  MPI_Comm comm() const { return comm_; }
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
  bool send_complete(int64_t k) override;  // MPI_Test
  int64_t ireduce_scatterv_sum(const float* in, float* out, const int64_t* counts) override;
  int64_t iallreduce_sum(float* data, int64_t n) override;
  int64_t ialltoallv(const float* send, const int64_t* send_counts, float* recv, const int64_t* recv_counts) override;
  void wait(int64_t ticket) override;
  void progress() override;
  bool overlaps() const override { return true; }

 private:
  // A posted collective: its requests and the counts MPI reads until it completes.
  struct Posted {
    int64_t ticket = 0;
    const char* what = nullptr;
    std::vector<MPI_Request> requests;
    std::vector<int> counts;
  };
  int64_t post(Posted p);
  std::vector<int> scatter_counts(const int64_t* counts);  // reduce_scatterv's, and its bytes counted
  // alltoallv's counts and displacements as MPI takes them, [sc | sd | rc | rd], and its bytes counted.
  std::vector<int> alltoallv_counts(const int64_t* send_counts, const int64_t* recv_counts);
  std::vector<Posted> posted_;
  template <class T>
  void allreduce(T* data, int64_t n, MPI_Datatype type, MPI_Op op);
  std::vector<MPI_Request> pending_;
  std::vector<int64_t> pending_ids_;  // their timeline ids, while tracing
  MPI_Comm comm_;
  const char* name_;
  int rank_ = 0, size_ = 1;
};

}  // namespace fp8moe
