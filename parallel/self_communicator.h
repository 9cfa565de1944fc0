// A group of one rank: this process alone (as MPI_COMM_SELF), on a backend's memory. Sums and
// maxima leave the data as it is, gathers and scatters copy this rank's block (Backend::copy),
// and there is no peer to send to. For the pieces of a run that take communicators where one
// process works alone (plan's probe models, app/trainer.h).
#pragma once

#include "kernels/backend.h"
#include "parallel/communicator.h"

namespace fp8moe {

class SelfCommunicator final : public Communicator {
 public:
  explicit SelfCommunicator(Backend& be) : be_(be) {}
  int rank() const override { return 0; }
  int size() const override { return 1; }
  void allreduce_sum(float*, int64_t) override {}
  void allreduce_sum(double*, int64_t) override {}
  void allreduce_sum(int64_t*, int64_t) override {}
  void allreduce_sum(uint64_t*, int64_t) override {}
  void allreduce_max(float*, int64_t) override {}
  void allreduce_max(double*, int64_t) override {}
  void broadcast(std::string&, int) override {}
  void barrier() override {}
  void allgather(const float* in, int64_t n, float* out) override { copy(out, in, n); }
  void reduce_scatter_sum(const float* in, float* out, int64_t n) override { copy(out, in, n); }
  void reduce_scatterv_sum(const float* in, float* out, const int64_t* counts) override { copy(out, in, counts[0]); }
  void allgatherv(const float* in, float* out, const int64_t* counts) override { copy(out, in, counts[0]); }
  void alltoall(const int64_t* send, int64_t* recv, int64_t n) override;
  void alltoallv(const float* send, const int64_t* send_counts, float* recv, const int64_t*) override {
    copy(recv, send, send_counts[0]);
  }
  void send(const float*, int64_t, int peer, int) override { no_peer(peer); }
  void recv(float*, int64_t, int peer, int) override { no_peer(peer); }
  void isend(const float*, int64_t, int peer, int) override { no_peer(peer); }
  void wait_sends() override {}

 private:
  void copy(float* out, const float* in, int64_t n);
  [[noreturn]] static void no_peer(int peer);
  Backend& be_;
};

}  // namespace fp8moe
