// The NCCL communicator against the MPI one on the same inputs: every collective and the
// point-to-point pattern of 1F1B (each stage sends, then receives from the other, which would
// deadlock if sends were posted alone). Integer-valued floats, so sums are exact in any order.
// Needs a GPU per rank on each node; SKIPPED otherwise (NCCL refuses two ranks on one GPU), so on
// a one-GPU machine only the 1-rank run executes.
#include <gtest/gtest.h>
#include <mpi.h>

#include <memory>
#include <numeric>
#include <vector>

#include "kernels/backend_info.h"
#include "kernels/device.h"
#include "parallel/mpi_communicator.h"
#include "parallel/mpi_session.h"

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
    ASSERT_TRUE(set_compute_device(ComputeDevice::cuda, place.local_rank, &why)) << why;
    nccl = make_group_communicator(MPI_COMM_WORLD, true, "world");
    mpi = make_group_communicator(MPI_COMM_WORLD, false, "world");
  }
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
    auto a = values(r, n), b = a;
    nccl->allreduce_sum(a.data(), n), mpi->allreduce_sum(b.data(), n);
    EXPECT_EQ(a, b) << "allreduce_sum " << n;
    a = values(r, n), b = a;
    nccl->allreduce_max(a.data(), n), mpi->allreduce_max(b.data(), n);
    EXPECT_EQ(a, b) << "allreduce_max " << n;
    std::vector<double> da(static_cast<size_t>(n), r + 0.5), db = da;
    nccl->allreduce_sum(da.data(), n), mpi->allreduce_sum(db.data(), n);
    EXPECT_EQ(da, db);
    const auto in = values(r, n);
    std::vector<float> ga(static_cast<size_t>(n * p)), gb(ga.size());
    nccl->allgather(in.data(), n, ga.data()), mpi->allgather(in.data(), n, gb.data());
    EXPECT_EQ(ga, gb) << "allgather " << n;
    const auto big = values(r, n * p);
    std::vector<float> ra(static_cast<size_t>(n)), rb(ra.size());
    nccl->reduce_scatter_sum(big.data(), ra.data(), n), mpi->reduce_scatter_sum(big.data(), rb.data(), n);
    EXPECT_EQ(ra, rb) << "reduce_scatter " << n;
  }
  // Uneven blocks, one of them empty.
  std::vector<int64_t> counts(static_cast<size_t>(p));
  for (int j = 0; j < p; ++j) counts[j] = j == 1 ? 0 : 100 + 37 * j;
  const int64_t total = std::accumulate(counts.begin(), counts.end(), int64_t(0));
  const auto all = values(r, total);
  std::vector<float> sa(static_cast<size_t>(counts[r])), sb(sa.size());
  nccl->reduce_scatterv_sum(all.data(), sa.data(), counts.data());
  mpi->reduce_scatterv_sum(all.data(), sb.data(), counts.data());
  EXPECT_EQ(sa, sb);
  const auto mine = values(r, counts[r]);
  std::vector<float> va(static_cast<size_t>(total)), vb(va.size());
  nccl->allgatherv(mine.data(), va.data(), counts.data());
  mpi->allgatherv(mine.data(), vb.data(), counts.data());
  EXPECT_EQ(va, vb);
  // All-to-all(v): rank r sends (r + j) % 3 * 10 values to rank j.
  std::vector<int64_t> send_n(static_cast<size_t>(p)), recv_n(static_cast<size_t>(p));
  for (int j = 0; j < p; ++j) send_n[j] = (r + j) % 3 * 10, recv_n[j] = (j + r) % 3 * 10;
  const auto send = values(r, std::accumulate(send_n.begin(), send_n.end(), int64_t(0)));
  std::vector<float> aa(static_cast<size_t>(std::accumulate(recv_n.begin(), recv_n.end(), int64_t(0)))), ab(aa.size());
  nccl->alltoallv(send.data(), send_n.data(), aa.data(), recv_n.data());
  mpi->alltoallv(send.data(), send_n.data(), ab.data(), recv_n.data());
  EXPECT_EQ(aa, ab);
  std::vector<int64_t> ia(static_cast<size_t>(2 * p)), ib(ia.size()), isend(static_cast<size_t>(2 * p));
  std::iota(isend.begin(), isend.end(), int64_t(r) * 1000);
  nccl->alltoall(isend.data(), ia.data(), 2), mpi->alltoall(isend.data(), ib.data(), 2);
  EXPECT_EQ(ia, ib);
  EXPECT_EQ(nccl->bytes_sent(), mpi->bytes_sent()) << "the same textbook byte counts";
}

TEST_F(Nccl, PipelineSendThenReceiveDoesNotDeadlock) {
  const int r = nccl->rank(), p = nccl->size();
  // Pairs (0, 1), (2, 3), ...: both send 4 MiB first (isend), then receive the other's: 1F1B's
  // steady state between two stages. One rank (or the odd one out) sends to itself.
  const int peer = (r ^ 1) < p ? r ^ 1 : r;
  const int64_t n = int64_t(1) << 20;
  const auto out = values(r, n);
  std::vector<float> in(static_cast<size_t>(n));
  for (int round = 0; round < 3; ++round) {
    nccl->isend(out.data(), n, peer, round);
    nccl->recv(in.data(), n, peer, round);
    EXPECT_EQ(in, values(peer, n)) << "round " << round;
  }
  nccl->wait_sends();
}

}  // namespace
}  // namespace fp8moe
