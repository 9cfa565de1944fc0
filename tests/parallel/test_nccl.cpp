// The NCCL communicator on a CUDA backend's device memory against the MPI one on host memory, on
// the same inputs: every collective (allgatherv also in place), the barrier, and the
// point-to-point pattern of 1F1B (each stage sends, then receives from the other, which would
// deadlock if sends were posted alone). Integer-valued floats, so sums are exact in any order.
// Needs a GPU per rank on each node; SKIPPED otherwise (NCCL refuses two ranks on one GPU), so on
// a one-GPU machine only the 1-rank run executes, and without a GPU the run exits 77.
#include <gtest/gtest.h>
#include <mpi.h>

#include <memory>
#include <numeric>
#include <vector>

#include "kernels/backend.h"
#include "kernels/backend_info.h"
#include "kernels/cuda/backend.h"
#include "kernels/tensor.h"
#include "parallel/mpi_communicator.h"
#include "parallel/mpi_session.h"
#include "parallel/nccl_communicator.h"

namespace fp8moe {
namespace {

class Nccl : public testing::Test {
 protected:
  void SetUp() override {
    // As fp8moe train chooses: GPU local_rank % visible, NCCL only with a GPU of its own per rank.
    const NodePlace place = node_place(MPI_COMM_WORLD);
    std::string why;
    const int gpus = cuda_device_count(&why);
    if (!distinct_gpus_per_node(MPI_COMM_WORLD, gpus > 0 ? place.local_rank % gpus : -1))
      GTEST_SKIP() << "NCCL needs a GPU of its own per rank: "
                   << (gpus == 0 ? why : std::to_string(gpus) + " GPUs for " + std::to_string(place.local_size) + " ranks on a node");
    be = make_cuda_backend(place.local_rank % gpus);
    nccl = std::make_unique<NcclCommunicator>(MPI_COMM_WORLD, cuda_backend(*be), "world");
    mpi = std::make_unique<MpiCommunicator>(MPI_COMM_WORLD, "world");
  }
  // Device memory holding v, and its contents back on the host (one download and sync).
  template <class T>
  Tensor dev(const std::vector<T>& v) {
    return tensor_from(*be, v, {int64_t(v.size())});
  }
  // NOTE: declared first, destroyed last: the NCCL communicator goes before its backend.
  std::unique_ptr<Backend> be;
  std::unique_ptr<Communicator> nccl, mpi;
};

std::vector<float> values(int rank, int64_t n) {
  std::vector<float> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[i] = float((rank * 31 + i * 7) % 101) - 50.0f;
  return v;
}

TEST_F(Nccl, CollectivesMatchMpi) {
  const int r = mpi->rank(), p = mpi->size();
  ASSERT_EQ(nccl->rank(), r);
  ASSERT_EQ(nccl->size(), p);
  for (int64_t n : {int64_t(1), int64_t(1000), int64_t(1) << 20}) {
    auto b = values(r, n);
    Tensor a = dev(b);
    nccl->allreduce_sum(a.f32(), n), mpi->allreduce_sum(b.data(), n);
    EXPECT_EQ(to_host<float>(a), b) << "allreduce_sum " << n;
    b = values(r, n), a = dev(b);
    nccl->allreduce_max(a.f32(), n), mpi->allreduce_max(b.data(), n);
    EXPECT_EQ(to_host<float>(a), b) << "allreduce_max " << n;
    std::vector<double> db(static_cast<size_t>(n), r + 0.5);
    Tensor da = dev(db);
    nccl->allreduce_sum(da.data<double>(), n), mpi->allreduce_sum(db.data(), n);
    EXPECT_EQ(to_host<double>(da), db);
    std::vector<int64_t> ib(static_cast<size_t>(n), int64_t(r) - 3);
    Tensor ia = dev(ib);
    nccl->allreduce_sum(ia.data<int64_t>(), n), mpi->allreduce_sum(ib.data(), n);
    EXPECT_EQ(to_host<int64_t>(ia), ib);
    const auto in = values(r, n);
    Tensor gin = dev(in), ga(*be, DType::f32, {n * p});
    std::vector<float> gb(static_cast<size_t>(n * p));
    nccl->allgather(gin.f32(), n, ga.f32()), mpi->allgather(in.data(), n, gb.data());
    EXPECT_EQ(to_host<float>(ga), gb) << "allgather " << n;
    const auto big = values(r, n * p);
    Tensor gbig = dev(big), ra(*be, DType::f32, {n});
    std::vector<float> rb(static_cast<size_t>(n));
    nccl->reduce_scatter_sum(gbig.f32(), ra.f32(), n), mpi->reduce_scatter_sum(big.data(), rb.data(), n);
    EXPECT_EQ(to_host<float>(ra), rb) << "reduce_scatter " << n;
  }
  // Uneven blocks, one of them empty.
  std::vector<int64_t> counts(static_cast<size_t>(p));
  for (int j = 0; j < p; ++j) counts[j] = j == 1 ? 0 : 100 + 37 * j;
  const int64_t total = std::accumulate(counts.begin(), counts.end(), int64_t(0));
  const int64_t displ = std::accumulate(counts.begin(), counts.begin() + r, int64_t(0));
  const auto all = values(r, total);
  Tensor gall = dev(all), sa(*be, DType::f32, {counts[r]});
  std::vector<float> sb(static_cast<size_t>(counts[r]));
  nccl->reduce_scatterv_sum(gall.f32(), sa.f32(), counts.data());
  mpi->reduce_scatterv_sum(all.data(), sb.data(), counts.data());
  EXPECT_EQ(to_host<float>(sa), sb);
  const auto mine = values(r, counts[r]);
  Tensor gmine = dev(mine), va(*be, DType::f32, {total});
  std::vector<float> vb(static_cast<size_t>(total));
  nccl->allgatherv(gmine.f32(), va.f32(), counts.data());
  mpi->allgatherv(mine.data(), vb.data(), counts.data());
  EXPECT_EQ(to_host<float>(va), vb);
  // In place: this rank's block already where it belongs (the ZeRO weight gather); the rest garbage.
  std::vector<float> seeded(static_cast<size_t>(total), -1e30f);
  std::copy(mine.begin(), mine.end(), seeded.begin() + displ);
  Tensor vi = dev(seeded);
  nccl->allgatherv(vi.f32() + displ, vi.f32(), counts.data());
  EXPECT_EQ(to_host<float>(vi), vb) << "allgatherv in place";
  // All-to-all(v): rank r sends (r + j) % 3 * 10 values to rank j.
  std::vector<int64_t> send_n(static_cast<size_t>(p)), recv_n(static_cast<size_t>(p));
  for (int j = 0; j < p; ++j) send_n[j] = (r + j) % 3 * 10, recv_n[j] = (j + r) % 3 * 10;
  const auto send = values(r, std::accumulate(send_n.begin(), send_n.end(), int64_t(0)));
  const int64_t nrecv = std::accumulate(recv_n.begin(), recv_n.end(), int64_t(0));
  Tensor gsend = dev(send), aa(*be, DType::f32, {nrecv});
  std::vector<float> ab(static_cast<size_t>(nrecv));
  nccl->alltoallv(gsend.f32(), send_n.data(), aa.f32(), recv_n.data());
  mpi->alltoallv(send.data(), send_n.data(), ab.data(), recv_n.data());
  EXPECT_EQ(to_host<float>(aa), ab);
  {  // posted (the expert exchange behind compute): the same rows, once the compute stream waited
    Tensor posted(*be, DType::f32, {nrecv});
    const int64_t before = nccl->bytes_sent();
    const int64_t t = nccl->ialltoallv(gsend.f32(), send_n.data(), posted.f32(), recv_n.data());
    nccl->wait(t);
    EXPECT_EQ(to_host<float>(posted), ab) << "ialltoallv";
    const int64_t mpi_before = mpi->bytes_sent();
    mpi->alltoallv(send.data(), send_n.data(), ab.data(), recv_n.data());  // (both count one more exchange)
    EXPECT_EQ(nccl->bytes_sent() - before, mpi->bytes_sent() - mpi_before);
  }
  std::vector<int64_t> ib(static_cast<size_t>(2 * p)), isend(static_cast<size_t>(2 * p));
  std::iota(isend.begin(), isend.end(), int64_t(r) * 1000);
  Tensor gisend = dev(isend), ia(*be, DType::i64, {2 * p});
  nccl->alltoall(gisend.data<int64_t>(), ia.data<int64_t>(), 2), mpi->alltoall(isend.data(), ib.data(), 2);
  EXPECT_EQ(to_host<int64_t>(ia), ib);
  // The in-place allgatherv above counts like the other one: subtract it before comparing.
  const int64_t in_place_bytes = p > 1 ? (total - counts[r]) * 4 : 0;
  EXPECT_EQ(nccl->bytes_sent() - in_place_bytes, mpi->bytes_sent()) << "the same textbook byte counts";
  const int64_t syncs = be->transfers().host_syncs;
  nccl->barrier();
  EXPECT_EQ(be->transfers().host_syncs, syncs + 1) << "the barrier waits on the host, once";
}

TEST_F(Nccl, PipelineSendThenReceiveDoesNotDeadlock) {
  const int r = nccl->rank(), p = nccl->size();
  // Pairs (0, 1), (2, 3), ...: both send 4 MiB first (isend), then receive the other's: 1F1B's
  // steady state between two stages. One rank (or the odd one out) sends to itself.
  const int peer = (r ^ 1) < p ? r ^ 1 : r;
  const int64_t n = int64_t(1) << 20;
  const Tensor out = dev(values(r, n));
  Tensor in(*be, DType::f32, {n});
  for (int round = 0; round < 3; ++round) {
    nccl->isend(out.f32(), n, peer, round);
    nccl->recv(in.f32(), n, peer, round);
    EXPECT_EQ(to_host<float>(in), values(peer, n)) << "round " << round;
  }
  nccl->wait_sends();
  // A blocking send (isend + wait_sends) between the pair, lower rank first: no deadlock either.
  const Tensor one = dev(values(r + 7, 1000));
  Tensor got(*be, DType::f32, {1000});
  if (peer == r) {
    nccl->isend(one.f32(), 1000, r, 9);
    nccl->recv(got.f32(), 1000, r, 9);
    nccl->wait_sends();
  } else if (r < peer) {
    nccl->send(one.f32(), 1000, peer, 9);
    nccl->recv(got.f32(), 1000, peer, 9);
  } else {
    nccl->recv(got.f32(), 1000, peer, 9);
    nccl->send(one.f32(), 1000, peer, 9);
  }
  EXPECT_EQ(to_host<float>(got), values(peer + 7, 1000));
}

}  // namespace
}  // namespace fp8moe
