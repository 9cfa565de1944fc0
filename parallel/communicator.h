// The communicator interface (DESIGN.md): the collectives model/ and io/ use, over one group of
// ranks. The MPI implementation works on host memory; the NCCL one (device memory) comes with
// the CUDA backend. Model and optimizer code receive the communicators they need; nothing reads
// a global. Every call is collective over the group: all members call it in the same order.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <string>

namespace fp8moe {

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual void allreduce_sum(float* data, int64_t n) = 0;
  virtual void allreduce_sum(double* data, int64_t n) = 0;
  virtual void allreduce_sum(int64_t* data, int64_t n) = 0;
  virtual void allreduce_sum(uint64_t* data, int64_t n) = 0;  // modulo 2^64
  virtual void allreduce_max(float* data, int64_t n) = 0;
  virtual void allreduce_max(double* data, int64_t n) = 0;
  virtual void broadcast(std::string& text, int root) = 0;
  virtual void barrier() = 0;
};

// Over an MPI communicator (not owned; it must outlive this object). Errors are fatal
// (MPI_CHECK: every rank is aborted).
class MpiCommunicator final : public Communicator {
 public:
  explicit MpiCommunicator(MPI_Comm comm);
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

 private:
  MPI_Comm comm_;
  int rank_ = 0, size_ = 1;
};

}  // namespace fp8moe
