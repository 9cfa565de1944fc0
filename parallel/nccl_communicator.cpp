#include "parallel/nccl_communicator.h"

#include <mutex>
#include <numeric>
#include <set>

#include "kernels/check.h"
#include "parallel/watchdog.h"

namespace fp8moe {
namespace {

// Host -> device (compute stream), then the comm stream waits for it.
template <class T>
cuda::Buffer<T> stage_in(const T* host, int64_t n) {
  cuda::Buffer<T> b = cuda::to_device(host, n);
  cuda::comm_waits_for_compute();
  return b;
}
// The comm stream's work done, then device -> host.
template <class T>
void stage_out(const cuda::Buffer<T>& b, T* host, int64_t n) {
  cuda::compute_waits_for_comm();
  cuda::to_host(b, host, n);
}

}  // namespace

namespace {

// The live NCCL communicators, which the watchdog aborts before it ends the job: a rank blocked in
// an NCCL operation does not return to MPI_Abort's signal otherwise.
std::mutex g_live_mu;
std::set<ncclComm_t> g_live;

void abort_live_comms() {
  std::lock_guard<std::mutex> lock(g_live_mu);
  for (ncclComm_t c : g_live) ncclCommAbort(c);
  g_live.clear();
}

}  // namespace

NcclCommunicator::NcclCommunicator(MPI_Comm comm, const char* name) : comm_(comm), name_(name) {
  MPI_CHECK(MPI_Comm_rank(comm, &rank_));
  MPI_CHECK(MPI_Comm_size(comm, &size_));
  cuda::context();  // the device must be chosen first
  ncclUniqueId id;
  if (rank_ == 0) NCCL_CHECK(ncclGetUniqueId(&id));
  MPI_CHECK(MPI_Bcast(&id, sizeof id, MPI_BYTE, 0, comm));
  NCCL_CHECK(ncclCommInitRank(&nccl_, size_, id, rank_));
  static std::once_flag hooked;
  std::call_once(hooked, [] { watch_on_abort(abort_live_comms); });
  std::lock_guard<std::mutex> lock(g_live_mu);
  g_live.insert(nccl_);
}

NcclCommunicator::~NcclCommunicator() {
  if (nccl_) {
    wait_sends();
    {
      std::lock_guard<std::mutex> lock(g_live_mu);
      g_live.erase(nccl_);
    }
    ncclCommDestroy(nccl_);
  }
}

template <class T>
void NcclCommunicator::allreduce(T* data, int64_t n, ncclDataType_t type, ncclRedOp_t op) {
  const WatchScope watch("allreduce", name_);
  if (n == 0) return;
  cuda::Buffer<T> d = stage_in(data, n);
  NCCL_CHECK(ncclAllReduce(d.get(), d.get(), size_t(n), type, op, nccl_, cuda::context().comm));
  stage_out(d, data, n);
  bytes_sent_ += ring_allreduce_bytes(size_, n * int64_t(sizeof(T)));
}

void NcclCommunicator::allreduce_sum(float* d, int64_t n) { allreduce(d, n, ncclFloat32, ncclSum); }
void NcclCommunicator::allreduce_sum(double* d, int64_t n) { allreduce(d, n, ncclFloat64, ncclSum); }
void NcclCommunicator::allreduce_sum(int64_t* d, int64_t n) { allreduce(d, n, ncclInt64, ncclSum); }
void NcclCommunicator::allreduce_sum(uint64_t* d, int64_t n) { allreduce(d, n, ncclUint64, ncclSum); }
void NcclCommunicator::allreduce_max(float* d, int64_t n) { allreduce(d, n, ncclFloat32, ncclMax); }
void NcclCommunicator::allreduce_max(double* d, int64_t n) { allreduce(d, n, ncclFloat64, ncclMax); }

void NcclCommunicator::broadcast(std::string& text, int root) {
  const WatchScope watch("broadcast", name_);
  // Text (configs, error messages) is small and host-side: MPI carries it.
  int64_t len = int64_t(text.size());
  MPI_CHECK(MPI_Bcast(&len, 1, MPI_INT64_T, root, comm_));
  text.resize(size_t(len));
  if (len) MPI_CHECK(MPI_Bcast(text.data(), int(len), MPI_CHAR, root, comm_));
}

void NcclCommunicator::barrier() {
  const WatchScope watch("barrier", name_);
  float one = 1.0f;
  allreduce(&one, 1, ncclFloat32, ncclSum);
}

void NcclCommunicator::allgather(const float* in, int64_t n, float* out) {
  const WatchScope watch("allgather", name_);
  if (n == 0) return;
  cuda::Buffer<float> din = stage_in(in, n), dout(n * size_);
  NCCL_CHECK(ncclAllGather(din.get(), dout.get(), size_t(n), ncclFloat32, nccl_, cuda::context().comm));
  stage_out(dout, out, n * size_);
  bytes_sent_ += (size_ - 1) * n * 4;
}

void NcclCommunicator::reduce_scatter_sum(const float* in, float* out, int64_t n) {
  const WatchScope watch("reduce_scatter", name_);
  if (n == 0) return;
  cuda::Buffer<float> din = stage_in(in, n * size_), dout(n);
  NCCL_CHECK(ncclReduceScatter(din.get(), dout.get(), size_t(n), ncclFloat32, ncclSum, nccl_, cuda::context().comm));
  stage_out(dout, out, n);
  bytes_sent_ += (size_ - 1) * n * 4;
}

// Uneven blocks: NCCL has no v-collectives; grouped reductions to each owner / broadcasts from it.
void NcclCommunicator::reduce_scatterv_sum(const float* in, float* out, const int64_t* counts) {
  const WatchScope watch("reduce_scatterv", name_);
  const int64_t total = std::accumulate(counts, counts + size_, int64_t(0));
  if (total == 0) return;
  cuda::Buffer<float> din = stage_in(in, total), dout(counts[rank_]);
  cudaStream_t s = cuda::context().comm;
  NCCL_CHECK(ncclGroupStart());
  int64_t off = 0;
  for (int r = 0; r < size_; ++r) {
    if (counts[r] > 0)
      NCCL_CHECK(ncclReduce(din.get() + off, r == rank_ ? dout.get() : nullptr, size_t(counts[r]), ncclFloat32, ncclSum,
                            r, nccl_, s));
    off += counts[r];
  }
  NCCL_CHECK(ncclGroupEnd());
  stage_out(dout, out, counts[rank_]);
  bytes_sent_ += size_ > 1 ? (total - counts[rank_]) * 4 : 0;
}

void NcclCommunicator::allgatherv(const float* in, float* out, const int64_t* counts) {
  const WatchScope watch("allgatherv", name_);
  const int64_t total = std::accumulate(counts, counts + size_, int64_t(0));
  if (total == 0) return;
  cuda::Buffer<float> dout(total);
  int64_t mine = 0;
  for (int r = 0; r < rank_; ++r) mine += counts[r];
  if (counts[rank_] > 0) cuda::upload(dout.get() + mine, in, size_t(counts[rank_]) * 4);
  cuda::comm_waits_for_compute();
  cudaStream_t s = cuda::context().comm;
  NCCL_CHECK(ncclGroupStart());
  int64_t off = 0;
  for (int r = 0; r < size_; ++r) {
    if (counts[r] > 0) NCCL_CHECK(ncclBroadcast(dout.get() + off, dout.get() + off, size_t(counts[r]), ncclFloat32, r, nccl_, s));
    off += counts[r];
  }
  NCCL_CHECK(ncclGroupEnd());
  stage_out(dout, out, total);
  bytes_sent_ += size_ > 1 ? (total - counts[rank_]) * 4 : 0;  // as MpiCommunicator: the textbook ring
}

void NcclCommunicator::alltoall(const int64_t* send, int64_t* recv, int64_t n) {
  const WatchScope watch("alltoall", name_);
  if (n == 0) return;
  cuda::Buffer<int64_t> ds = stage_in(send, n * size_), dr(n * size_);
  cudaStream_t s = cuda::context().comm;
  NCCL_CHECK(ncclGroupStart());
  for (int r = 0; r < size_; ++r) {
    NCCL_CHECK(ncclSend(ds.get() + r * n, size_t(n), ncclInt64, r, nccl_, s));
    NCCL_CHECK(ncclRecv(dr.get() + r * n, size_t(n), ncclInt64, r, nccl_, s));
  }
  NCCL_CHECK(ncclGroupEnd());
  stage_out(dr, recv, n * size_);
  bytes_sent_ += (size_ - 1) * n * 8;
}

void NcclCommunicator::alltoallv(const float* send, const int64_t* send_counts, float* recv,
                                 const int64_t* recv_counts) {
  const WatchScope watch("alltoallv", name_);
  const int64_t ns = std::accumulate(send_counts, send_counts + size_, int64_t(0));
  const int64_t nr = std::accumulate(recv_counts, recv_counts + size_, int64_t(0));
  cuda::Buffer<float> ds = stage_in(send, ns), dr(nr);
  cudaStream_t s = cuda::context().comm;
  NCCL_CHECK(ncclGroupStart());
  int64_t so = 0, ro = 0;
  for (int r = 0; r < size_; ++r) {
    if (send_counts[r] > 0) NCCL_CHECK(ncclSend(ds.get() + so, size_t(send_counts[r]), ncclFloat32, r, nccl_, s));
    if (recv_counts[r] > 0) NCCL_CHECK(ncclRecv(dr.get() + ro, size_t(recv_counts[r]), ncclFloat32, r, nccl_, s));
    if (r != rank_) bytes_sent_ += send_counts[r] * 4;
    so += send_counts[r], ro += recv_counts[r];
  }
  NCCL_CHECK(ncclGroupEnd());
  stage_out(dr, recv, nr);
}

void NcclCommunicator::send(const float* data, int64_t n, int peer, int tag) {
  const WatchScope watch("send", name_);
  isend(data, n, peer, tag);
  wait_sends();
}

// NOTE: NCCL runs a communicator's operations in order on its stream and a send blocks until the
// peer's matching receive runs, so an isend posted at once followed by a recv would deadlock the
// 1F1B pattern (stage s: send act, recv grad; stage s + 1: send grad, recv act). isend therefore
// only stages its payload; the sends are posted in one NCCL group with the next recv, or by
// wait_sends, so that each pair of ranks' sends and receives can progress together.
void NcclCommunicator::post_pending_sends() {
  for (PendingSend& p : pending_)
    if (!p.posted) {
      NCCL_CHECK(ncclSend(p.data.get(), size_t(p.n), ncclFloat32, p.peer, nccl_, cuda::context().comm));
      p.posted = true;
    }
}

void NcclCommunicator::recv(float* data, int64_t n, int peer, int /*tag: NCCL matches in call order*/) {
  const WatchScope watch("recv", name_);
  if (n == 0) return;
  cuda::Buffer<float> d(n);
  cuda::comm_waits_for_compute();
  NCCL_CHECK(ncclGroupStart());
  post_pending_sends();
  NCCL_CHECK(ncclRecv(d.get(), size_t(n), ncclFloat32, peer, nccl_, cuda::context().comm));
  NCCL_CHECK(ncclGroupEnd());
  stage_out(d, data, n);
}

void NcclCommunicator::isend(const float* data, int64_t n, int peer, int /*tag*/) {
  if (n == 0) return;
  pending_.push_back(PendingSend{stage_in(data, n), n, peer, false});
  bytes_sent_ += n * 4;
}

void NcclCommunicator::wait_sends() {
  const WatchScope watch("wait for sends", name_);
  if (pending_.empty()) return;
  NCCL_CHECK(ncclGroupStart());
  post_pending_sends();
  NCCL_CHECK(ncclGroupEnd());
  CUDA_CHECK(cudaStreamSynchronize(cuda::context().comm));
  pending_.clear();
}

}  // namespace fp8moe
