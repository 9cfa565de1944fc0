// The communicator interface (docs/ARCHITECTURE.md): the collectives model/ and io/ use, over one
// group of ranks. A communicator works on one kind of memory, all of its pointers: host memory
// (MPI, parallel/mpi_communicator.h) or a backend's memory (parallel/device_communicator.h: NCCL
// on a GPU's, or MPI staged through pinned host memory). Model and optimizer code receive the
// communicators they need; nothing reads a global. Every call is collective over the group: all
// members call it in the same order. No MPI here: model/ includes this header.
#pragma once

#include <cstdint>
#include <string>

namespace fp8moe {

// Textbook bytes that leave one rank: a ring allreduce of B bytes sends 2 (p - 1) / p x B.
int64_t ring_allreduce_bytes(int p, int64_t bytes);

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

  // out (size() x n) = every rank's n values, in rank order.
  virtual void allgather(const float* in, int64_t n, float* out) = 0;
  // out (n) = the sum over ranks of block rank() (n values) of in (size() x n).
  virtual void reduce_scatter_sum(const float* in, float* out, int64_t n) = 0;
  // Uneven blocks: counts[j] values of rank j's block. reduce_scatterv: out (counts[rank()]) = the
  // sum over ranks of block rank() of in (all blocks, in rank order; out does not overlap in).
  // allgatherv: out (all blocks) = every rank's block, in rank order; in holds this rank's
  // counts[rank()] values, and may be that block of out itself (in place).
  virtual void reduce_scatterv_sum(const float* in, float* out, const int64_t* counts) = 0;
  virtual void allgatherv(const float* in, float* out, const int64_t* counts) = 0;
  // recv (size() x n) = the n values every rank sent to this one: block j of send goes to rank j.
  virtual void alltoall(const int64_t* send, int64_t* recv, int64_t n) = 0;
  // Variable all-to-all of floats: send_counts[j] values (consecutive in send) go to rank j;
  // recv_counts[j] values from rank j land consecutively in recv, in rank order.
  virtual void alltoallv(const float* send, const int64_t* send_counts, float* recv, const int64_t* recv_counts) = 0;
  // Point to point (the pipeline): blocking send of n values to `peer`, and the matching receive.
  virtual void send(const float* data, int64_t n, int peer, int tag) = 0;
  virtual void recv(float* data, int64_t n, int peer, int tag) = 0;
  // Non-blocking send (the pipeline: a stage never waits for its neighbour to take an activation);
  // `data` must stay unchanged until wait_sends() returns, or until send_complete says so.
  virtual void isend(const float* data, int64_t n, int peer, int tag) = 0;
  virtual void wait_sends() = 0;
  // Of the isends since the last wait_sends(), numbered from 0 in order: whether send k is complete,
  // so that its data may change or go (the pipeline frees a micro-batch's state as its messages
  // leave, not once a step); a test that lets the transport progress. A transport that cannot tell
  // says false until wait_sends().
  virtual bool send_complete(int64_t k) {
    (void)k;
    return false;
  }

  // Non-blocking collectives (the gradients' reduction behind the backward, optim.overlap_grad_reduce):
  // a post returns a ticket and wait(ticket) returns once the result is in place. Between the two
  // the input is not changed and the output not read; every member posts the same calls in the same
  // order and may wait in any order. The MPI communicators (and the emulated device's own) return
  // at once; NCCL queues the collective on a stream of its own and its wait makes the compute
  // stream wait (the host never does); the staged transport, by default, runs the collective in
  // line at the post (nothing overlaps: overlaps() false). progress() lets posted collectives move
  // while the caller computes (MPI progresses them only inside its calls).
  virtual int64_t ireduce_scatterv_sum(const float* in, float* out, const int64_t* counts) {
    reduce_scatterv_sum(in, out, counts);
    return 0;
  }
  virtual int64_t iallreduce_sum(float* data, int64_t n) {
    allreduce_sum(data, n);
    return 0;
  }
  // alltoallv, posted (the expert exchange behind the shared expert's and the experts' weight-
  // gradient work: model/moe.h). The counts are read at the post only.
  virtual int64_t ialltoallv(const float* send, const int64_t* send_counts, float* recv, const int64_t* recv_counts) {
    alltoallv(send, send_counts, recv, recv_counts);
    return 0;
  }
  virtual void wait(int64_t /*ticket*/) {}
  virtual void progress() {}
  virtual bool overlaps() const { return false; }

  // Bytes this rank has handed to the network through this communicator (payload that leaves the
  // rank: for collectives, by the algorithm's textbook count; see README "Communication").
  int64_t bytes_sent() const { return bytes_sent_; }
  void reset_bytes_sent() { bytes_sent_ = 0; }

 protected:
  int64_t bytes_sent_ = 0;
};

}  // namespace fp8moe
