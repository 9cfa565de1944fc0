#include "parallel/mpi_communicator.h"

#include <algorithm>
#include <climits>
#include <vector>

#include "kernels/check.h"
#include "parallel/mpi_session.h"
#include "parallel/trace.h"
#include "parallel/watchdog.h"


namespace fp8moe {
namespace {

// MPI counts are int: long buffers go in pieces of at most 2^30 elements, fn(offset, count).
template <class Fn>
void in_chunks(int64_t n, Fn&& fn) {
  constexpr int64_t kChunk = int64_t(1) << 30;
  for (int64_t off = 0; off < n; off += kChunk) fn(off, int(std::min(kChunk, n - off)));
}

}  // namespace

MpiCommunicator::MpiCommunicator(MPI_Comm comm, const char* name) : comm_(comm), name_(name) {
  MPI_CHECK(MPI_Comm_rank(comm, &rank_));
  MPI_CHECK(MPI_Comm_size(comm, &size_));
}

int64_t ring_allreduce_bytes(int p, int64_t bytes) { return p > 1 ? 2 * (p - 1) * bytes / p : 0; }

// Counts the textbook bytes, then reduces in MPI-sized pieces.
template <class T>
void MpiCommunicator::allreduce(T* data, int64_t n, MPI_Datatype type, MPI_Op op) {
  const WatchScope watch("allreduce", name_);
  bytes_sent_ += ring_allreduce_bytes(size_, n * int64_t(sizeof(T)));
  in_chunks(n, [&](int64_t off, int count) { MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, data + off, count, type, op, comm_)); });
}

void MpiCommunicator::allreduce_sum(float* d, int64_t n) { allreduce(d, n, MPI_FLOAT, MPI_SUM); }
void MpiCommunicator::allreduce_sum(double* d, int64_t n) { allreduce(d, n, MPI_DOUBLE, MPI_SUM); }
void MpiCommunicator::allreduce_sum(int64_t* d, int64_t n) { allreduce(d, n, MPI_INT64_T, MPI_SUM); }
void MpiCommunicator::allreduce_sum(uint64_t* d, int64_t n) { allreduce(d, n, MPI_UINT64_T, MPI_SUM); }
void MpiCommunicator::allreduce_max(float* d, int64_t n) { allreduce(d, n, MPI_FLOAT, MPI_MAX); }
void MpiCommunicator::allreduce_max(double* d, int64_t n) { allreduce(d, n, MPI_DOUBLE, MPI_MAX); }
void MpiCommunicator::broadcast(std::string& text, int root) {
  const WatchScope watch("broadcast", name_);
  broadcast_string(comm_, text, root);
}
void MpiCommunicator::barrier() {
  const WatchScope watch("barrier", name_);
  MPI_CHECK(MPI_Barrier(comm_));
}

namespace {
int as_count(int64_t n, const char* what) {
  FP8MOE_ASSERT(n >= 0 && n <= INT_MAX, what, ": ", n, " elements: more than one MPI call takes");
  return int(n);
}
}  // namespace

void MpiCommunicator::allgather(const float* in, int64_t n, float* out) {
  const WatchScope watch("allgather", name_);
  bytes_sent_ += int64_t(size_ - 1) * n * 4;
  MPI_CHECK(MPI_Allgather(in, as_count(n, "allgather"), MPI_FLOAT, out, int(n), MPI_FLOAT, comm_));
}

void MpiCommunicator::reduce_scatter_sum(const float* in, float* out, int64_t n) {
  const WatchScope watch("reduce_scatter", name_);
  bytes_sent_ += int64_t(size_ - 1) * n * 4;
  MPI_CHECK(MPI_Reduce_scatter_block(in, out, as_count(n, "reduce_scatter"), MPI_FLOAT, MPI_SUM, comm_));
}

// The blocks' MPI counts, and the bytes counted.
std::vector<int> MpiCommunicator::scatter_counts(const int64_t* counts) {
  std::vector<int> c(static_cast<size_t>(size_));
  int64_t total = 0;
  for (int j = 0; j < size_; ++j) c[size_t(j)] = as_count(counts[j], "reduce_scatterv"), total += counts[j];
  as_count(total, "reduce_scatterv total");
  bytes_sent_ += size_ > 1 ? (total - counts[rank_]) * 4 : 0;  // a ring passes on every block but its own
  return c;
}

void MpiCommunicator::reduce_scatterv_sum(const float* in, float* out, const int64_t* counts) {
  const WatchScope watch("reduce_scatterv", name_);
  const std::vector<int> c = scatter_counts(counts);
  MPI_CHECK(MPI_Reduce_scatter(in, out, c.data(), MPI_FLOAT, MPI_SUM, comm_));
}

void MpiCommunicator::allgatherv(const float* in, float* out, const int64_t* counts) {
  const WatchScope watch("allgatherv", name_);
  std::vector<int> c(static_cast<size_t>(size_)), d(static_cast<size_t>(size_));
  int64_t total = 0;
  for (int j = 0; j < size_; ++j) c[size_t(j)] = as_count(counts[j], "allgatherv"), d[size_t(j)] = as_count(total, "allgatherv"), total += counts[j];
  bytes_sent_ += size_ > 1 ? (total - counts[rank_]) * 4 : 0;
  // In place when this rank's block already sits where it belongs in out (the ZeRO weight gather).
  const void* send = in == out + d[size_t(rank_)] ? MPI_IN_PLACE : in;
  MPI_CHECK(MPI_Allgatherv(send, c[size_t(rank_)], MPI_FLOAT, out, c.data(), d.data(), MPI_FLOAT, comm_));
}

void MpiCommunicator::alltoall(const int64_t* send, int64_t* recv, int64_t n) {
  const WatchScope watch("alltoall", name_);
  bytes_sent_ += int64_t(size_ - 1) * n * 8;
  MPI_CHECK(MPI_Alltoall(send, as_count(n, "alltoall"), MPI_INT64_T, recv, int(n), MPI_INT64_T, comm_));
}

std::vector<int> MpiCommunicator::alltoallv_counts(const int64_t* send_counts, const int64_t* recv_counts) {
  const auto p = static_cast<size_t>(size_);
  std::vector<int> c(4 * p);  // [sc | sd | rc | rd]
  int64_t so = 0, ro = 0;
  for (size_t j = 0; j < p; ++j) {
    c[j] = as_count(send_counts[j], "alltoallv"), c[2 * p + j] = as_count(recv_counts[j], "alltoallv");
    c[p + j] = as_count(so, "alltoallv offset"), c[3 * p + j] = as_count(ro, "alltoallv offset");
    so += send_counts[j], ro += recv_counts[j];
    if (int(j) != rank_) bytes_sent_ += send_counts[j] * 4;
  }
  return c;
}

void MpiCommunicator::alltoallv(const float* send, const int64_t* send_counts, float* recv, const int64_t* recv_counts) {
  const WatchScope watch("alltoallv", name_);
  const std::vector<int> c = alltoallv_counts(send_counts, recv_counts);
  const int* v = c.data();
  const size_t p = static_cast<size_t>(size_);
  MPI_CHECK(MPI_Alltoallv(send, v, v + p, MPI_FLOAT, recv, v + 2 * p, v + 3 * p, MPI_FLOAT, comm_));
}

void MpiCommunicator::send(const float* data, int64_t n, int peer, int tag) {
  const WatchScope watch("send", name_);
  bytes_sent_ += n * 4;
  MPI_CHECK(MPI_Send(data, as_count(n, "send"), MPI_FLOAT, peer, tag, comm_));
}

void MpiCommunicator::recv(float* data, int64_t n, int peer, int tag) {
  const WatchScope watch("recv", name_);
  MPI_CHECK(MPI_Recv(data, as_count(n, "recv"), MPI_FLOAT, peer, tag, comm_, MPI_STATUS_IGNORE));
}

}  // namespace fp8moe

namespace fp8moe {

void MpiCommunicator::isend(const float* data, int64_t n, int peer, int tag) {
  bytes_sent_ += n * 4;
  MPI_Request r;
  MPI_CHECK(MPI_Isend(data, as_count(n, "isend"), MPI_FLOAT, peer, tag, comm_, &r));
  pending_.push_back(r);
  if (trace::on()) {  // the timeline: from the post to the end of wait_sends
    pending_ids_.push_back(trace::next_id());
    trace::async_begin("send", name_, pending_ids_.back());
  }
}

void MpiCommunicator::wait_sends() {
  if (pending_.empty()) return;
  const WatchScope watch("wait for sends", name_);
  MPI_CHECK(MPI_Waitall(int(pending_.size()), pending_.data(), MPI_STATUSES_IGNORE));
  pending_.clear();
  for (int64_t id : pending_ids_)
    if (id >= 0) trace::async_end("send", name_, id);
  pending_ids_.clear();
}

// A completed request becomes MPI_REQUEST_NULL, which MPI_Test and MPI_Waitall take as complete.
bool MpiCommunicator::send_complete(int64_t k) {
  FP8MOE_ASSERT(k >= 0 && k < int64_t(pending_.size()), "send ", k, " of ", pending_.size(), " posted");
  if (pending_[size_t(k)] == MPI_REQUEST_NULL) return true;
  int done = 0;
  MPI_CHECK(MPI_Test(&pending_[size_t(k)], &done, MPI_STATUS_IGNORE));
  if (done && !pending_ids_.empty()) {
    trace::async_end("send", name_, pending_ids_[size_t(k)]);
    pending_ids_[size_t(k)] = -1;
  }
  return done != 0;
}

}  // namespace fp8moe

namespace fp8moe {

// Non-blocking collectives: the textbook bytes count at the post, as the blocking calls count them.
int64_t MpiCommunicator::post(Posted p) {
  p.ticket = trace::next_id();
  trace::async_begin(p.what, name_, p.ticket);
  posted_.push_back(std::move(p));
  return posted_.back().ticket;
}

int64_t MpiCommunicator::ireduce_scatterv_sum(const float* in, float* out, const int64_t* counts) {
  const WatchScope watch("post reduce_scatterv", name_);
  Posted p;
  p.what = "reduce_scatterv";
  p.counts = scatter_counts(counts);  // MPI reads them until the collective completes
  p.requests.resize(1);
  MPI_CHECK(MPI_Ireduce_scatter(in, out, p.counts.data(), MPI_FLOAT, MPI_SUM, comm_, p.requests.data()));
  return post(std::move(p));
}

int64_t MpiCommunicator::iallreduce_sum(float* data, int64_t n) {
  const WatchScope watch("post allreduce", name_);
  bytes_sent_ += ring_allreduce_bytes(size_, n * 4);
  Posted p;
  p.what = "allreduce";
  in_chunks(n, [&](int64_t off, int count) {
    p.requests.emplace_back();
    MPI_CHECK(MPI_Iallreduce(MPI_IN_PLACE, data + off, count, MPI_FLOAT, MPI_SUM, comm_, &p.requests.back()));
  });
  return post(std::move(p));
}

int64_t MpiCommunicator::ialltoallv(const float* send, const int64_t* send_counts, float* recv,
                                    const int64_t* recv_counts) {
  const WatchScope watch("post alltoallv", name_);
  Posted p;
  p.what = "alltoallv";
  p.counts = alltoallv_counts(send_counts, recv_counts);  // MPI reads them until the exchange completes
  p.requests.resize(1);
  const int* v = p.counts.data();
  const size_t n = static_cast<size_t>(size_);
  MPI_CHECK(MPI_Ialltoallv(send, v, v + n, MPI_FLOAT, recv, v + 2 * n, v + 3 * n, MPI_FLOAT, comm_, p.requests.data()));
  return post(std::move(p));
}

void MpiCommunicator::wait(int64_t ticket) {
  const auto it = std::find_if(posted_.begin(), posted_.end(), [&](const Posted& p) { return p.ticket == ticket; });
  FP8MOE_ASSERT(it != posted_.end(), "wait for collective ", ticket, ", which was not posted here (or waited already)");
  {
    const WatchScope watch("wait", name_);
    wait_fault_point();  // (the tests' build only: a rank frozen here)
    MPI_CHECK(MPI_Waitall(int(it->requests.size()), it->requests.data(), MPI_STATUSES_IGNORE));
  }
  trace::async_end(it->what, name_, ticket);
  posted_.erase(it);
}

void MpiCommunicator::progress() {
  for (Posted& p : posted_) {
    int done = 0;
    MPI_CHECK(MPI_Testall(int(p.requests.size()), p.requests.data(), &done, MPI_STATUSES_IGNORE));
  }
}

}  // namespace fp8moe
