#include "parallel/nccl_communicator.h"

#include <algorithm>
#include <mutex>
#include <numeric>
#include <set>

#include "kernels/check.h"
#include "parallel/trace.h"
#include "parallel/watchdog.h"

namespace fp8moe {
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

NcclCommunicator::NcclCommunicator(MPI_Comm comm, CudaBackend& be, const char* name)
    : comm_(comm), be_(be), name_(name) {
  MPI_CHECK(MPI_Comm_rank(comm, &rank_));
  MPI_CHECK(MPI_Comm_size(comm, &size_));
  CUDA_CHECK(cudaSetDevice(be.device()));  // NCCL binds the communicator to the current device
  ncclUniqueId id;
  if (rank_ == 0) NCCL_CHECK(ncclGetUniqueId(&id));
  MPI_CHECK(MPI_Bcast(&id, sizeof id, MPI_BYTE, 0, comm));
  NCCL_CHECK(ncclCommInitRank(&nccl_, size_, id, rank_));
  static std::once_flag hooked;
  std::call_once(hooked, [] { watch_on_abort(abort_live_comms); });
  {
    std::lock_guard<std::mutex> lock(g_live_mu);
    g_live.insert(nccl_);
  }
  barrier_value_ = Tensor::zeros(be, DType::f32, {1});
}

NcclCommunicator::~NcclCommunicator() {
  if (!nccl_) return;
  wait_sends();
  // NOTE: the queued operations finish before the communicator goes (no fatal check while tearing
  // down: the job may be failing already).
  (void)cudaStreamSynchronize(be_.comm_stream());
  if (post_stream_) (void)cudaStreamSynchronize(post_stream_);
  for (const Posted& p : posted_) (void)cudaEventDestroy(p.done);
  if (post_stream_) (void)cudaStreamDestroy(post_stream_);
  {
    std::lock_guard<std::mutex> lock(g_live_mu);
    g_live.erase(nccl_);
  }
  ncclCommDestroy(nccl_);
}

template <class T>
void NcclCommunicator::allreduce(T* data, int64_t n, ncclDataType_t type, ncclRedOp_t op) {
  const WatchScope watch("allreduce", name_);
  bytes_sent_ += ring_allreduce_bytes(size_, n * int64_t(sizeof(T)));
  if (n == 0) return;
  comm_after_compute();
  NCCL_CHECK(ncclAllReduce(data, data, size_t(n), type, op, nccl_, be_.comm_stream()));
  be_.compute_waits_for_comm();
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
  // NOTE: no bytes counted, as MpiCommunicator's MPI_Barrier. The value is 0 and stays 0.
  comm_after_compute();
  float* v = barrier_value_.f32();
  NCCL_CHECK(ncclAllReduce(v, v, 1, ncclFloat32, ncclSum, nccl_, be_.comm_stream()));
  be_.compute_waits_for_comm();
  be_.sync();
}

void NcclCommunicator::allgather(const float* in, int64_t n, float* out) {
  const WatchScope watch("allgather", name_);
  bytes_sent_ += int64_t(size_ - 1) * n * 4;
  if (n == 0) return;
  comm_after_compute();
  NCCL_CHECK(ncclAllGather(in, out, size_t(n), ncclFloat32, nccl_, be_.comm_stream()));
  be_.compute_waits_for_comm();
}

void NcclCommunicator::reduce_scatter_sum(const float* in, float* out, int64_t n) {
  const WatchScope watch("reduce_scatter", name_);
  bytes_sent_ += int64_t(size_ - 1) * n * 4;
  if (n == 0) return;
  comm_after_compute();
  NCCL_CHECK(ncclReduceScatter(in, out, size_t(n), ncclFloat32, ncclSum, nccl_, be_.comm_stream()));
  be_.compute_waits_for_comm();
}

// Uneven blocks: NCCL has no v-collectives; grouped reductions to each block's owner.
void NcclCommunicator::reduce_scatterv_sum(const float* in, float* out, const int64_t* counts) {
  const WatchScope watch("reduce_scatterv", name_);
  if (queued_reduce_scatterv(in, out, counts, nullptr)) be_.compute_waits_for_comm();
}

// Counts the bytes (as MpiCommunicator: the textbook ring) and queues the grouped reductions on
// `s`, or on the communication stream after the compute stream's work when s is null; false when
// there is nothing to reduce.
bool NcclCommunicator::queued_reduce_scatterv(const float* in, float* out, const int64_t* counts, cudaStream_t s) {
  const int64_t total = std::accumulate(counts, counts + size_, int64_t(0));
  bytes_sent_ += size_ > 1 ? (total - counts[rank_]) * 4 : 0;
  if (total == 0) return false;
  if (!s) comm_after_compute(), s = be_.comm_stream();
  NCCL_CHECK(ncclGroupStart());
  int64_t off = 0;
  for (int r = 0; r < size_; ++r) {
    // recvbuff matters on the root only.
    if (counts[r] > 0)
      NCCL_CHECK(
          ncclReduce(in + off, r == rank_ ? out : nullptr, size_t(counts[r]), ncclFloat32, ncclSum, r, nccl_, s));
    off += counts[r];
  }
  NCCL_CHECK(ncclGroupEnd());
  return true;
}

// Uneven blocks: grouped broadcasts from each block's owner into its place in out. The owner's
// send buffer is `in`: when in is that place already, the broadcast is in place.
void NcclCommunicator::allgatherv(const float* in, float* out, const int64_t* counts) {
  const WatchScope watch("allgatherv", name_);
  const int64_t total = std::accumulate(counts, counts + size_, int64_t(0));
  bytes_sent_ += size_ > 1 ? (total - counts[rank_]) * 4 : 0;
  if (total == 0) return;
  comm_after_compute();
  cudaStream_t s = be_.comm_stream();
  NCCL_CHECK(ncclGroupStart());
  int64_t at = 0;  // displacement of block r
  for (int r = 0; r < size_; ++r) {
    if (counts[r] > 0)
      NCCL_CHECK(ncclBroadcast(r == rank_ ? in : out + at, out + at, size_t(counts[r]), ncclFloat32, r, nccl_, s));
    at += counts[r];
  }
  NCCL_CHECK(ncclGroupEnd());
  be_.compute_waits_for_comm();
}

void NcclCommunicator::alltoall(const int64_t* send, int64_t* recv, int64_t n) {
  const WatchScope watch("alltoall", name_);
  bytes_sent_ += int64_t(size_ - 1) * n * 8;
  if (n == 0) return;
  comm_after_compute();
  cudaStream_t s = be_.comm_stream();
  NCCL_CHECK(ncclGroupStart());
  for (int r = 0; r < size_; ++r) {
    NCCL_CHECK(ncclSend(send + r * n, size_t(n), ncclInt64, r, nccl_, s));
    NCCL_CHECK(ncclRecv(recv + r * n, size_t(n), ncclInt64, r, nccl_, s));
  }
  NCCL_CHECK(ncclGroupEnd());
  be_.compute_waits_for_comm();
}

void NcclCommunicator::alltoallv(const float* send, const int64_t* send_counts, float* recv,
                                 const int64_t* recv_counts) {
  const WatchScope watch("alltoallv", name_);
  comm_after_compute();
  queued_alltoallv(send, send_counts, recv, recv_counts, be_.comm_stream());
  be_.compute_waits_for_comm();
}

void NcclCommunicator::queued_alltoallv(const float* send, const int64_t* send_counts, float* recv,
                                        const int64_t* recv_counts, cudaStream_t s) {
  NCCL_CHECK(ncclGroupStart());
  int64_t so = 0, ro = 0;
  for (int r = 0; r < size_; ++r) {
    if (send_counts[r] > 0) NCCL_CHECK(ncclSend(send + so, size_t(send_counts[r]), ncclFloat32, r, nccl_, s));
    if (recv_counts[r] > 0) NCCL_CHECK(ncclRecv(recv + ro, size_t(recv_counts[r]), ncclFloat32, r, nccl_, s));
    if (r != rank_) bytes_sent_ += send_counts[r] * 4;
    so += send_counts[r], ro += recv_counts[r];
  }
  NCCL_CHECK(ncclGroupEnd());
}

void NcclCommunicator::send(const float* data, int64_t n, int peer, int tag) {
  const WatchScope watch("send", name_);
  isend(data, n, peer, tag);
  wait_sends();
}

// NOTE: NCCL runs a communicator's operations in order on its stream and a send blocks until the
// peer's matching receive runs, so an isend posted at once followed by a recv would deadlock the
// 1F1B pattern (stage s: send act, recv grad; stage s + 1: send grad, recv act). isend therefore
// only records the caller's buffer; the sends are posted in one NCCL group with the next recv, or
// by wait_sends, so that each pair of ranks' sends and receives can progress together. The
// communication stream waits for the compute stream before they are posted (the payload is
// computed there), and the compute stream for the communication stream after: the caller may
// change or release the buffers once wait_sends() has returned.
void NcclCommunicator::post_pending_sends() {
  for (PendingSend& p : pending_)
    if (!p.posted) {
      NCCL_CHECK(ncclSend(p.data, size_t(p.n), ncclFloat32, p.peer, nccl_, be_.comm_stream()));
      p.posted = true;
    }
}

void NcclCommunicator::recv(float* data, int64_t n, int peer, int /*tag: NCCL matches in call order*/) {
  const WatchScope watch("recv", name_);
  if (n == 0) return;
  // Also orders the receive after the compute work that still reads `data`'s old contents.
  comm_after_compute();
  NCCL_CHECK(ncclGroupStart());
  post_pending_sends();
  NCCL_CHECK(ncclRecv(data, size_t(n), ncclFloat32, peer, nccl_, be_.comm_stream()));
  NCCL_CHECK(ncclGroupEnd());
  be_.compute_waits_for_comm();
}

void NcclCommunicator::isend(const float* data, int64_t n, int peer, int /*tag*/) {
  const WatchScope watch("isend", name_);
  if (n == 0) return;
  pending_.push_back(PendingSend{data, n, peer, false});
  bytes_sent_ += n * 4;
}

void NcclCommunicator::wait_sends() {
  const WatchScope watch("wait for sends", name_);
  if (pending_.empty()) return;
  comm_after_compute();
  NCCL_CHECK(ncclGroupStart());
  post_pending_sends();
  NCCL_CHECK(ncclGroupEnd());
  be_.compute_waits_for_comm();
  pending_.clear();
}

// The communication stream waits for the compute stream's work so far and, while collectives are
// posted, for those too: an NCCL communicator's operations must run in the order they were issued
// on every rank, and a blocking call issued after a post (delayed scaling's amax all-reduce over
// the replicas, during the backward) would otherwise run beside it on the other stream.
void NcclCommunicator::comm_after_compute() {
  be_.comm_waits_for_compute();
  if (posted_.empty()) return;
  cudaEvent_t posts;
  CUDA_CHECK(cudaEventCreateWithFlags(&posts, cudaEventDisableTiming));
  CUDA_CHECK(cudaEventRecord(posts, post_stream_));
  CUDA_CHECK(cudaStreamWaitEvent(be_.comm_stream(), posts, 0));
  CUDA_CHECK(cudaEventDestroy(posts));
}

// The posted collectives: their own stream, ordered after the compute work queued before the post
// by an event, and a completion event the compute stream waits for at wait().
cudaStream_t NcclCommunicator::post_stream() {
  if (!post_stream_) CUDA_CHECK(cudaStreamCreateWithFlags(&post_stream_, cudaStreamNonBlocking));
  cudaEvent_t ready;
  CUDA_CHECK(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming));
  CUDA_CHECK(cudaEventRecord(ready, be_.compute_stream()));
  CUDA_CHECK(cudaStreamWaitEvent(post_stream_, ready, 0));
  CUDA_CHECK(cudaEventDestroy(ready));  // released once the wait has run
  return post_stream_;
}

int64_t NcclCommunicator::posted(const char* what) {
  Posted p{trace::next_id(), what, nullptr};
  CUDA_CHECK(cudaEventCreateWithFlags(&p.done, cudaEventDisableTiming));
  CUDA_CHECK(cudaEventRecord(p.done, post_stream_));
  trace::async_begin(what, name_, p.ticket);
  posted_.push_back(p);
  return p.ticket;
}

int64_t NcclCommunicator::ireduce_scatterv_sum(const float* in, float* out, const int64_t* counts) {
  const WatchScope watch("post reduce_scatterv", name_);
  queued_reduce_scatterv(in, out, counts, post_stream());
  return posted("reduce_scatterv");
}

int64_t NcclCommunicator::iallreduce_sum(float* data, int64_t n) {
  const WatchScope watch("post allreduce", name_);
  bytes_sent_ += ring_allreduce_bytes(size_, n * 4);
  cudaStream_t s = post_stream();
  if (n > 0) NCCL_CHECK(ncclAllReduce(data, data, size_t(n), ncclFloat32, ncclSum, nccl_, s));
  return posted("allreduce");
}

int64_t NcclCommunicator::ialltoallv(const float* send, const int64_t* send_counts, float* recv,
                                     const int64_t* recv_counts) {
  const WatchScope watch("post alltoallv", name_);
  queued_alltoallv(send, send_counts, recv, recv_counts, post_stream());
  return posted("alltoallv");
}

// The host does not wait: the compute stream does (what it queues next runs after the collective).
void NcclCommunicator::wait(int64_t ticket) {
  const auto it = std::find_if(posted_.begin(), posted_.end(), [&](const Posted& p) { return p.ticket == ticket; });
  FP8MOE_ASSERT(it != posted_.end(), "wait for collective ", ticket, ", which was not posted here (or waited already)");
  {
    const WatchScope watch("wait", name_);
    CUDA_CHECK(cudaStreamWaitEvent(be_.compute_stream(), it->done, 0));
  }
  trace::async_end(it->what, name_, ticket);
  CUDA_CHECK(cudaEventDestroy(it->done));  // released once the wait has run
  posted_.erase(it);
}

}  // namespace fp8moe
