// The MPI communicator's collectives with exactly predictable inputs (as nccl-tests checks): rank r
// contributes values that are small integers, so every sum is exact in any order, and the expected
// result is written in closed form, never computed by a collective. Also each call's byte count
// against the textbook ring formulas of README "Communication". Run at 1, 2, 3 and 4 ranks.
#include <gtest/gtest.h>
#include <mpi.h>

#include <numeric>
#include <vector>

#include "parallel/mpi_communicator.h"

namespace fp8moe {
namespace {

class Comm : public testing::Test {
 protected:
  Comm() : c(MPI_COMM_WORLD), r(c.rank()), p(c.size()) {}
  MpiCommunicator c;
  const int r, p;
  // Uneven blocks: rank j holds 3 + 5 j values, except rank 1, which holds none.
  std::vector<int64_t> uneven() const {
    std::vector<int64_t> counts(static_cast<size_t>(p));
    for (int j = 0; j < p; ++j) counts[size_t(j)] = j == 1 ? 0 : 3 + 5 * j;
    return counts;
  }
};

TEST_F(Comm, AllreduceSumAndMax) {
  const int64_t n = 1000;
  std::vector<float> f(n);
  std::vector<double> d(n);
  std::vector<int64_t> i64(n);
  for (int64_t i = 0; i < n; ++i) f[i] = float(r * 1000 + i), d[i] = r + 0.5 * double(i), i64[i] = int64_t(r) << 40 | i;
  c.reset_bytes_sent();
  c.allreduce_sum(f.data(), n);
  EXPECT_EQ(c.bytes_sent(), p == 1 ? 0 : 2 * (p - 1) * n * 4 / p);
  c.allreduce_sum(d.data(), n);
  c.allreduce_sum(i64.data(), n);
  const int64_t ranks_sum = int64_t(p) * (p - 1) / 2;
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_EQ(f[i], float(1000 * ranks_sum + p * i)) << i;
    ASSERT_EQ(d[i], double(ranks_sum) + p * 0.5 * double(i)) << i;
    ASSERT_EQ(i64[i], (ranks_sum << 40) + p * i) << i;
  }
  std::vector<float> m(n);
  for (int64_t i = 0; i < n; ++i) m[i] = float((r + i) % p) - float(i);  // max over ranks: p - 1 - i
  c.allreduce_max(m.data(), n);
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(m[i], float(p - 1) - float(i)) << i;
}

TEST_F(Comm, AllgatherAndReduceScatterEvenBlocks) {
  const int64_t n = 17;
  std::vector<float> in(n), out(size_t(n * p));
  for (int64_t i = 0; i < n; ++i) in[i] = float(100 * r + i);
  c.reset_bytes_sent();
  c.allgather(in.data(), n, out.data());
  EXPECT_EQ(c.bytes_sent(), (p - 1) * n * 4);
  for (int q = 0; q < p; ++q)
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(out[size_t(q * n + i)], float(100 * q + i));
  // Block b of rank q's input: q + 10 b + i; rank r gets the sum over q of block r.
  std::vector<float> all(size_t(n * p)), mine(n);
  for (int b = 0; b < p; ++b)
    for (int64_t i = 0; i < n; ++i) all[size_t(b * n + i)] = float(r + 10 * b + i);
  c.reset_bytes_sent();
  c.reduce_scatter_sum(all.data(), mine.data(), n);
  EXPECT_EQ(c.bytes_sent(), (p - 1) * n * 4);
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(mine[i], float(p * (p - 1) / 2 + p * (10 * r + i))) << i;
}

TEST_F(Comm, ReduceScattervAndAllgathervUnevenBlocks) {
  const std::vector<int64_t> counts = uneven();
  const int64_t total = std::accumulate(counts.begin(), counts.end(), int64_t(0));
  std::vector<int64_t> offset(size_t(p), 0);
  for (int j = 1; j < p; ++j) offset[size_t(j)] = offset[size_t(j - 1)] + counts[size_t(j - 1)];
  // Element g of the full vector on rank q: q + 10 g. Rank r's result: sum over q, at g = offset_r + i.
  std::vector<float> all(static_cast<size_t>(total)), mine(size_t(counts[size_t(r)]) + 1, -7.0f);
  for (int64_t g = 0; g < total; ++g) all[size_t(g)] = float(r + 10 * g);
  c.reset_bytes_sent();
  c.reduce_scatterv_sum(all.data(), mine.data(), counts.data());
  EXPECT_EQ(c.bytes_sent(), p == 1 ? 0 : (total - counts[size_t(r)]) * 4);
  for (int64_t i = 0; i < counts[size_t(r)]; ++i)
    ASSERT_EQ(mine[size_t(i)], float(p * (p - 1) / 2 + p * 10 * (offset[size_t(r)] + i))) << i;
  EXPECT_EQ(mine.back(), -7.0f);  // nothing written past this rank's block
  // allgatherv: rank q's block is 1000 q + i.
  std::vector<float> block(size_t(counts[size_t(r)])), gathered(size_t(total) + 1, -7.0f);
  for (int64_t i = 0; i < counts[size_t(r)]; ++i) block[size_t(i)] = float(1000 * r + i);
  c.reset_bytes_sent();
  c.allgatherv(block.data(), gathered.data(), counts.data());
  EXPECT_EQ(c.bytes_sent(), p == 1 ? 0 : (total - counts[size_t(r)]) * 4);
  for (int q = 0; q < p; ++q)
    for (int64_t i = 0; i < counts[size_t(q)]; ++i)
      ASSERT_EQ(gathered[size_t(offset[size_t(q)] + i)], float(1000 * q + i)) << "rank " << q << " element " << i;
  EXPECT_EQ(gathered.back(), -7.0f);
}

TEST_F(Comm, AlltoallAndAlltoallv) {
  // alltoall: rank r sends 100 r + 10 j + k (k < 2) to rank j.
  std::vector<int64_t> send(size_t(2 * p)), recv(size_t(2 * p));
  for (int j = 0; j < p; ++j)
    for (int k = 0; k < 2; ++k) send[size_t(2 * j + k)] = 100 * r + 10 * j + k;
  c.alltoall(send.data(), recv.data(), 2);
  for (int q = 0; q < p; ++q)
    for (int k = 0; k < 2; ++k) ASSERT_EQ(recv[size_t(2 * q + k)], 100 * q + 10 * r + k);
  // alltoallv: rank r sends (r + j) % 3 values to rank j (some none), value 1000 r + 10 j + k.
  auto count = [](int from, int to) { return int64_t((from + to) % 3); };
  std::vector<int64_t> sc(static_cast<size_t>(p)), rc(static_cast<size_t>(p));
  std::vector<float> sv, rv;
  for (int j = 0; j < p; ++j) {
    sc[size_t(j)] = count(r, j), rc[size_t(j)] = count(j, r);
    for (int64_t k = 0; k < sc[size_t(j)]; ++k) sv.push_back(float(1000 * r + 10 * j + k));
  }
  rv.assign(size_t(std::accumulate(rc.begin(), rc.end(), int64_t(0))), -1.0f);
  c.reset_bytes_sent();
  c.alltoallv(sv.data(), sc.data(), rv.data(), rc.data());
  EXPECT_EQ(c.bytes_sent(), 4 * (std::accumulate(sc.begin(), sc.end(), int64_t(0)) - sc[size_t(r)]));
  size_t at = 0;
  for (int q = 0; q < p; ++q)
    for (int64_t k = 0; k < count(q, r); ++k) ASSERT_EQ(rv[at++], float(1000 * q + 10 * r + k)) << "from " << q;
}

TEST_F(Comm, PostedAlltoallvsCompleteInAnyWaitOrder) {
  // Two exchanges posted before either is waited for (the expert exchange behind compute), waited
  // for in the reverse order: rank r sends (r + j + e) % 3 values to rank j in exchange e, value
  // 1000 r + 100 e + 10 j + k. The counts are read at the post only: overwritten before the wait.
  auto count = [](int from, int to, int e) { return int64_t((from + to + e) % 3); };
  std::vector<int64_t> sc[2], rc[2];
  std::vector<float> sv[2], rv[2];
  int64_t tickets[2] = {0, 0}, sent = 0;
  c.reset_bytes_sent();
  for (int e = 0; e < 2; ++e) {
    for (int j = 0; j < p; ++j) {
      sc[e].push_back(count(r, j, e)), rc[e].push_back(count(j, r, e));
      for (int64_t k = 0; k < sc[e].back(); ++k) sv[e].push_back(float(1000 * r + 100 * e + 10 * j + k));
      if (j != r) sent += 4 * sc[e].back();
    }
    rv[e].assign(size_t(std::accumulate(rc[e].begin(), rc[e].end(), int64_t(0))), -1.0f);
    tickets[e] = c.ialltoallv(sv[e].data(), sc[e].data(), rv[e].data(), rc[e].data());
    std::fill(sc[e].begin(), sc[e].end(), -5), std::fill(rc[e].begin(), rc[e].end(), -5);
  }
  EXPECT_EQ(c.bytes_sent(), sent) << "counted at the post";
  c.progress();
  for (int e = 1; e >= 0; --e) {
    c.wait(tickets[e]);
    size_t at = 0;
    for (int q = 0; q < p; ++q)
      for (int64_t k = 0; k < count(q, r, e); ++k)
        ASSERT_EQ(rv[e][at++], float(1000 * q + 100 * e + 10 * r + k)) << "exchange " << e << " from " << q;
    EXPECT_EQ(at, rv[e].size());
  }
}

TEST_F(Comm, PointToPointRing) {
  // Each rank sends its 5 values to the next and receives the previous one's (isend first: no
  // rank blocks in a send; on 1 rank, to itself).
  std::vector<float> out(5), in(5);
  for (int i = 0; i < 5; ++i) out[size_t(i)] = float(10 * r + i);
  c.reset_bytes_sent();
  c.isend(out.data(), 5, (r + 1) % p, 3);
  c.recv(in.data(), 5, (r + p - 1) % p, 3);
  c.wait_sends();
  EXPECT_EQ(c.bytes_sent(), 20);
  for (int i = 0; i < 5; ++i) ASSERT_EQ(in[size_t(i)], float(10 * ((r + p - 1) % p) + i));
}

}  // namespace
}  // namespace fp8moe
