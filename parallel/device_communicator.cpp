#include "parallel/device_communicator.h"

#include <numeric>
#include <vector>

#include "kernels/check.h"
#include "parallel/mpi_communicator.h"

#ifdef FP8MOE_HAVE_CUDA
#include "kernels/cuda/backend.h"
#include "parallel/nccl_communicator.h"
#endif

namespace fp8moe {
namespace {

// The emulated device's collectives: MPI on the memory behind the tags.
class EmulatedCommunicator final : public Communicator {
 public:
  EmulatedCommunicator(MPI_Comm comm, Backend& be, const char* name) : mpi_(comm, name), be_(be) {
    FP8MOE_ASSERT(be.kind() == DeviceKind::emulated, "EmulatedCommunicator on a ", to_string(be.kind()), " backend");
  }
  int rank() const override { return mpi_.rank(); }
  int size() const override { return mpi_.size(); }
  void allreduce_sum(float* d, int64_t n) override { counted([&] { mpi_.allreduce_sum(h(d), n); }); }
  void allreduce_sum(double* d, int64_t n) override { counted([&] { mpi_.allreduce_sum(h(d), n); }); }
  void allreduce_sum(int64_t* d, int64_t n) override { counted([&] { mpi_.allreduce_sum(h(d), n); }); }
  void allreduce_sum(uint64_t* d, int64_t n) override { counted([&] { mpi_.allreduce_sum(h(d), n); }); }
  void allreduce_max(float* d, int64_t n) override { counted([&] { mpi_.allreduce_max(h(d), n); }); }
  void allreduce_max(double* d, int64_t n) override { counted([&] { mpi_.allreduce_max(h(d), n); }); }
  void broadcast(std::string& text, int root) override { mpi_.broadcast(text, root); }
  void barrier() override { mpi_.barrier(); }
  void allgather(const float* in, int64_t n, float* out) override {
    counted([&] { mpi_.allgather(h(in), n, h(out)); });
  }
  void reduce_scatter_sum(const float* in, float* out, int64_t n) override {
    counted([&] { mpi_.reduce_scatter_sum(h(in), h(out), n); });
  }
  void reduce_scatterv_sum(const float* in, float* out, const int64_t* counts) override {
    counted([&] { mpi_.reduce_scatterv_sum(h(in), h(out), counts); });
  }
  void allgatherv(const float* in, float* out, const int64_t* counts) override {
    counted([&] { mpi_.allgatherv(h(in), h(out), counts); });
  }
  void alltoall(const int64_t* send, int64_t* recv, int64_t n) override {
    counted([&] { mpi_.alltoall(h(send), h(recv), n); });
  }
  void alltoallv(const float* send, const int64_t* sc, float* recv, const int64_t* rc) override {
    counted([&] { mpi_.alltoallv(h(send), sc, h(recv), rc); });
  }
  void send(const float* d, int64_t n, int peer, int tag) override { counted([&] { mpi_.send(h(d), n, peer, tag); }); }
  void recv(float* d, int64_t n, int peer, int tag) override { counted([&] { mpi_.recv(h(d), n, peer, tag); }); }
  void isend(const float* d, int64_t n, int peer, int tag) override { counted([&] { mpi_.isend(h(d), n, peer, tag); }); }
  void wait_sends() override { mpi_.wait_sends(); }
  bool send_complete(int64_t k) override { return mpi_.send_complete(k); }
  // Non-blocking as MPI is: the emulated device's ops have run by the time they return, so the
  // memory behind the tags holds what a post reads.
  int64_t ireduce_scatterv_sum(const float* in, float* out, const int64_t* counts) override {
    int64_t t = 0;
    counted([&] { t = mpi_.ireduce_scatterv_sum(h(in), h(out), counts); });
    return t;
  }
  int64_t iallreduce_sum(float* d, int64_t n) override {
    int64_t t = 0;
    counted([&] { t = mpi_.iallreduce_sum(h(d), n); });
    return t;
  }
  int64_t ialltoallv(const float* send, const int64_t* sc, float* recv, const int64_t* rc) override {
    int64_t t = 0;
    counted([&] { t = mpi_.ialltoallv(h(send), sc, h(recv), rc); });
    return t;
  }
  void wait(int64_t ticket) override { mpi_.wait(ticket); }
  void progress() override { mpi_.progress(); }
  bool overlaps() const override { return true; }

 private:
  template <class T>
  T* h(T* p) const {
    return static_cast<T*>(be_.host_address(p));
  }
  template <class Fn>
  void counted(Fn&& fn) {
    const int64_t before = mpi_.bytes_sent();
    fn();
    bytes_sent_ += mpi_.bytes_sent() - before;
  }
  MpiCommunicator mpi_;
  Backend& be_;
};

// MPI through pinned host memory: download, synchronise, MPI, upload.
class StagedCommunicator final : public Communicator {
 public:
  StagedCommunicator(MPI_Comm comm, Backend& be, const char* name) : mpi_(comm, name), be_(be) {}
  ~StagedCommunicator() override {
    wait_sends();
    if (upload_pending_) be_.sync();  // the staging memory may still be read by an upload
  }
  int rank() const override { return mpi_.rank(); }
  int size() const override { return mpi_.size(); }
  void allreduce_sum(float* d, int64_t n) override { reduce(d, n, [&](float* x) { mpi_.allreduce_sum(x, n); }); }
  void allreduce_sum(double* d, int64_t n) override { reduce(d, n, [&](double* x) { mpi_.allreduce_sum(x, n); }); }
  void allreduce_sum(int64_t* d, int64_t n) override { reduce(d, n, [&](int64_t* x) { mpi_.allreduce_sum(x, n); }); }
  void allreduce_sum(uint64_t* d, int64_t n) override { reduce(d, n, [&](uint64_t* x) { mpi_.allreduce_sum(x, n); }); }
  void allreduce_max(float* d, int64_t n) override { reduce(d, n, [&](float* x) { mpi_.allreduce_max(x, n); }); }
  void allreduce_max(double* d, int64_t n) override { reduce(d, n, [&](double* x) { mpi_.allreduce_max(x, n); }); }
  void broadcast(std::string& text, int root) override { mpi_.broadcast(text, root); }
  void barrier() override { mpi_.barrier(); }
  void allgather(const float* in, int64_t n, float* out) override {
    const int64_t P = size();
    float* s = stage_in<float>(in, n, n * (P + 1));
    counted([&] { mpi_.allgather(s, n, s + n); });
    stage_out(out, s + n, n * P);
  }
  void reduce_scatter_sum(const float* in, float* out, int64_t n) override {
    const int64_t P = size();
    float* s = stage_in<float>(in, n * P, n * (P + 1));
    counted([&] { mpi_.reduce_scatter_sum(s, s + n * P, n); });
    stage_out(out, s + n * P, n);
  }
  void reduce_scatterv_sum(const float* in, float* out, const int64_t* counts) override {
    const int64_t total = std::accumulate(counts, counts + size(), int64_t(0)), mine = counts[rank()];
    float* s = stage_in<float>(in, total, total + mine);
    counted([&] { mpi_.reduce_scatterv_sum(s, s + total, counts); });
    stage_out(out, s + total, mine);
  }
  void allgatherv(const float* in, float* out, const int64_t* counts) override {
    const int64_t total = std::accumulate(counts, counts + size(), int64_t(0));
    int64_t displ = 0;
    for (int r = 0; r < rank(); ++r) displ += counts[r];
    float* s = stage_in<float>(in, counts[rank()], total, displ);  // this rank's block where it belongs
    counted([&] { mpi_.allgatherv(s + displ, s, counts); });
    stage_out(out, s, total);
  }
  void alltoall(const int64_t* send, int64_t* recv, int64_t n) override {
    const int64_t P = size();
    int64_t* s = stage_in<int64_t>(send, n * P, 2 * n * P);
    counted([&] { mpi_.alltoall(s, s + n * P, n); });
    stage_out(recv, s + n * P, n * P);
  }
  void alltoallv(const float* send, const int64_t* sc, float* recv, const int64_t* rc) override {
    const int64_t ns = std::accumulate(sc, sc + size(), int64_t(0)), nr = std::accumulate(rc, rc + size(), int64_t(0));
    float* s = stage_in<float>(send, ns, ns + nr);
    counted([&] { mpi_.alltoallv(s, sc, s + ns, rc); });
    stage_out(recv, s + ns, nr);
  }
  void send(const float* d, int64_t n, int peer, int tag) override {
    float* s = stage_in<float>(d, n, n);
    counted([&] { mpi_.send(s, n, peer, tag); });
  }
  void recv(float* d, int64_t n, int peer, int tag) override {
    float* s = host_staging<float>(n);
    counted([&] { mpi_.recv(s, n, peer, tag); });
    stage_out(d, s, n);
  }
  // The payload is copied to a pinned buffer of its own until wait_sends(); the buffers are kept
  // and reused by later sends (a pinned allocation may synchronise the device).
  void isend(const float* d, int64_t n, int peer, int tag) override {
    if (in_flight_ == sends_.size()) sends_.emplace_back();
    HostBuffer<float>& b = sends_[in_flight_++];
    if (b.size() < n) b = HostBuffer<float>(be_, n);
    if (n > 0) be_.download(b.data(), d, size_t(n) * sizeof(float));
    be_.sync();
    upload_pending_ = false;
    counted([&] { mpi_.isend(b.data(), n, peer, tag); });
  }
  void wait_sends() override {
    mpi_.wait_sends();
    in_flight_ = 0;
  }
  // The caller's data was copied at the post (the pinned copy stays until wait_sends).
  bool send_complete(int64_t k) override { return k >= 0 && k < int64_t(in_flight_); }

 private:
  template <class Fn>
  void counted(Fn&& fn) {
    const int64_t before = mpi_.bytes_sent();
    fn();
    bytes_sent_ += mpi_.bytes_sent() - before;
  }
  // Pinned staging of at least `elems` T, once no upload still reads the previous contents.
  template <class T>
  T* host_staging(int64_t elems) {
    if (upload_pending_) be_.sync(), upload_pending_ = false;
    const size_t bytes = size_t(std::max<int64_t>(elems, 1)) * sizeof(T);
    if (staging_.size() < int64_t(bytes)) staging_ = HostBuffer<unsigned char>(be_, int64_t(bytes));
    return reinterpret_cast<T*>(staging_.data());
  }
  // n values of device memory into the staging memory at element `at` (of `elems` in all), after
  // the host synchronisation that makes them readable.
  template <class T>
  T* stage_in(const T* device, int64_t n, int64_t elems, int64_t at = 0) {
    T* s = host_staging<T>(elems);
    if (n > 0) be_.download(s + at, device, size_t(n) * sizeof(T));
    be_.sync();
    return s;
  }
  template <class T>
  void stage_out(T* device, const T* host, int64_t n) {
    if (n > 0) be_.upload(device, host, size_t(n) * sizeof(T)), upload_pending_ = true;
  }
  template <class T, class Fn>
  void reduce(T* d, int64_t n, Fn&& op) {
    T* s = stage_in<T>(d, n, n);
    counted([&] { op(s); });
    stage_out(d, s, n);
  }
  MpiCommunicator mpi_;
  Backend& be_;
  HostBuffer<unsigned char> staging_;
  std::vector<HostBuffer<float>> sends_;  // [0, in_flight_): payloads of sends not yet waited for
  size_t in_flight_ = 0;
  bool upload_pending_ = false;  // an upload from staging_ may not have run yet
};

}  // namespace

std::unique_ptr<Communicator> make_device_communicator(MPI_Comm comm, Backend& be, bool nccl, const char* name) {
  switch (be.kind()) {
    case DeviceKind::cpu: return std::make_unique<MpiCommunicator>(comm, name);
    case DeviceKind::emulated:
      if (nccl) return std::make_unique<EmulatedCommunicator>(comm, be, name);
      return std::make_unique<StagedCommunicator>(comm, be, name);
    default:
#ifdef FP8MOE_HAVE_CUDA
      if (nccl) return std::make_unique<NcclCommunicator>(comm, cuda_backend(be), name);
#endif
      FP8MOE_ASSERT(!nccl, "NCCL communicators need the CUDA backend (this build has none)");
      return std::make_unique<StagedCommunicator>(comm, be, name);
  }
}

}  // namespace fp8moe
