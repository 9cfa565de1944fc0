// The gradient reduction over data-parallel replicas (model/data_parallel.h) with exactly
// predictable inputs, at 1, 2 and 3 ranks, on the CPU backend and the emulated device.
//
// optim.grad_reduce bf16: rank r's gradient element i is an integer B in [128, 256) plus 1/4, 1/2
// or 3/4 (with a sign). BF16 holds 8 significant bits, so its nearest value is B, B or B + 1 (the
// tie to the even one), or B + 1: the expected sum over the ranks is the sum of those integers,
// exact in any order, written here without the code under test. An FP32 reduction keeps the
// fractions and misses it. The blocks are odd-sized (25 values over 2 or 3 replicas), so a block's
// BF16 pair padding is exercised, and ZeRO-1's chunks (cut at row boundaries) are uneven.
#include <gtest/gtest.h>
#include <mpi.h>

#include <cmath>
#include <memory>
#include <vector>

#include "model/data_parallel.h"
#include "parallel/device_communicator.h"
#include "parallel/mpi_communicator.h"

namespace fp8moe {
namespace {

ParamTable small_table() {
  ParamTable t;
  for (auto [name, rows, cols] : {std::tuple<const char*, int64_t, int64_t>{"a", 3, 5}, {"b", 7, 1}, {"c", 1, 3}}) {
    ParamSpec p;
    p.name = name, p.rows = rows, p.cols = cols;
    t.params.push_back(p);
  }
  t.reindex();
  return t;
}

// Rank r's gradient of element i of the flat segment, and its BF16 value (round to nearest, ties
// to even), both exact in a double.
double grad_value(int r, int64_t i) {
  const double B = 128 + (17 * i + 31 * r) % 128, frac = 0.25 * double(1 + (i + r) % 3);
  return (i % 5 == 0 ? -1 : 1) * (B + frac);
}
double bf16_value(int r, int64_t i) {
  const double B = 128 + (17 * i + 31 * r) % 128, frac = 0.25 * double(1 + (i + r) % 3);
  const double up = frac > 0.5 || (frac == 0.5 && std::fmod(B, 2) == 1) ? 1 : 0;
  return (i % 5 == 0 ? -1 : 1) * (B + up);
}

class GradReduce : public testing::TestWithParam<DeviceKind> {
 protected:
  void SetUp() override {
    be = make_backend(GetParam());
    comm = make_device_communicator(MPI_COMM_WORLD, *be, false, "data");
    table = small_table();
    for (const ParamSpec& p : table.params) shards.push_back({0, p.rows, 0, p.cols});
  }
  // Loads rank r's gradients, reduces them, and returns this rank's gradients and the bytes sent.
  std::vector<std::vector<float>> reduce(bool zero, ReduceDtype dtype, int64_t* bytes, std::vector<RowRange>* owned,
                                         int64_t round_values = DataParallel::kRoundValues) {
    ParamStore store(*be, table, shards, 1);
    int64_t at = 0;
    for (size_t p = 0; p < table.params.size(); ++p) {
      std::vector<float> g(size_t(table.params[p].numel()));
      for (float& x : g) x = float(grad_value(comm->rank(), at++));
      store.grad_from_host(p, g);
    }
    DataParallel dp(store, store.dense(), store.dense_members(), *comm, zero, dtype, round_values);
    comm->reset_bytes_sent();
    dp.reduce_gradients(store);
    *bytes = comm->bytes_sent();
    owned->clear();
    for (size_t p = 0; p < table.params.size(); ++p) owned->push_back(dp.owned(p));
    return store.grads_to_host();
  }
  std::unique_ptr<Backend> be;
  std::unique_ptr<Communicator> comm;  // on the backend's memory
  MpiCommunicator host{MPI_COMM_WORLD};  // the test's own sums
  ParamTable table;
  std::vector<Shard> shards;
};

TEST_P(GradReduce, Bf16SumsTheRoundedGradientsExactly) {
  const int R = comm->size();
  // One round (the default), and rounds of 3 values of every block (odd slices, each padded).
  for (const int64_t round_values : {DataParallel::kRoundValues, int64_t(3) * R})
  for (bool zero : {true, false}) {
    SCOPED_TRACE("round_values " + std::to_string(round_values));
    int64_t bytes = 0;
    std::vector<RowRange> owned;
    const auto got = reduce(zero, ReduceDtype::bf16, &bytes, &owned, round_values);
    int64_t at = 0, checked = 0, missed_fp32 = 0;
    for (size_t p = 0; p < table.params.size(); ++p) {
      const int64_t cols = table.params[p].cols;
      for (int64_t e = 0; e < table.params[p].numel(); ++e, ++at) {
        if (e / cols < owned[p].begin || e / cols >= owned[p].end) continue;  // not this replica's rows
        double want = 0, fp32 = 0;
        for (int r = 0; r < R; ++r) want += bf16_value(r, at), fp32 += grad_value(r, at);
        if (R == 1) want = fp32;  // one replica: nothing is sent, nothing rounded
        ASSERT_EQ(double(got[p][size_t(e)]), want) << "zero " << zero << " " << table.params[p].name << "[" << e << "]";
        ++checked, missed_fp32 += fp32 != want;
      }
    }
    // Every element with ZeRO off; with ZeRO-1 this replica's chunk (the chunks cover the 25).
    int64_t all = checked;
    host.allreduce_sum(&all, 1);
    EXPECT_EQ(all, zero || R == 1 ? 25 : 25 * R);
    if (R > 1) {
      EXPECT_GT(missed_fp32, checked / 2) << "the inputs must tell BF16 from FP32";
    }
    int64_t fp32_bytes = 0;
    reduce(zero, ReduceDtype::fp32, &fp32_bytes, &owned);
    int64_t sums[2] = {bytes, fp32_bytes};
    host.allreduce_sum(sums, 2);
    // Over the ranks: the reduce-scatter sends (R - 1) x 25 values, 2 bytes each in BF16 (an odd
    // block padded by one value per sender), 4 in FP32; without ZeRO the all-gather of the sums
    // (R - 1) x 25 FP32 values (ZeRO-1 all-gathers the weights after the update instead).
    const int64_t rs16 = (R - 1) * 25 * 2, rs32 = (R - 1) * 25 * 4, ag = zero ? 0 : (R - 1) * 25 * 4;
    EXPECT_NEAR(double(sums[1]), double(rs32 + ag), R) << "zero " << zero;  // the ring's count rounds down per rank
    EXPECT_GE(sums[0], rs16 + ag) << "zero " << zero;
    const int64_t rounds = round_values == DataParallel::kRoundValues ? 1 : (25 + R - 1) / R / 3 + 1;
    EXPECT_LE(sums[0], rs16 + ag + 2 * R * (R - 1) * rounds) << "zero " << zero;
  }
}

TEST_P(GradReduce, Bf16GivesTheSameBitsWithAndWithoutZero) {
  int64_t bytes = 0;
  std::vector<RowRange> owned_zero, owned_full;
  const auto zero = reduce(true, ReduceDtype::bf16, &bytes, &owned_zero);
  const auto full = reduce(false, ReduceDtype::bf16, &bytes, &owned_full);
  for (size_t p = 0; p < table.params.size(); ++p)
    for (int64_t e = owned_zero[p].begin * table.params[p].cols; e < owned_zero[p].end * table.params[p].cols; ++e)
      ASSERT_EQ(zero[p][size_t(e)], full[p][size_t(e)]) << table.params[p].name << "[" << e << "]";
}

// optim.overlap_grad_reduce: one bucket per run of a layer's members (a and c are layer 0 around
// b, layer 1: three buckets), posted layer by layer as the backward would, waited in
// reduce_gradients. Integer gradients: every order of the sum is exact, so the expected sums are
// known without the code under test; the bytes are those of the reduction in one piece.
TEST_P(GradReduce, OverlappedBucketsGiveTheSumsAndTheBytesOfOneReduction) {
  // The emulated device's own collectives post (the staged transport the other tests use does not).
  if (GetParam() == DeviceKind::emulated) comm = make_device_communicator(MPI_COMM_WORLD, *be, true, "data");
  ASSERT_TRUE(comm->overlaps());
  const int R = comm->size();
  table.params[0].layer = 0, table.params[1].layer = 1, table.params[2].layer = 0;
  auto integer_grad = [](int r, int64_t i) { return double((7 * i + 13 * r) % 23 - 11); };
  for (bool zero : {true, false})
  for (bool overlap : {true, false}) {
    SCOPED_TRACE(std::string("zero ") + (zero ? "1" : "0") + " overlap " + (overlap ? "on" : "off"));
    ParamStore store(*be, table, shards, 1);
    int64_t at = 0;
    for (size_t p = 0; p < table.params.size(); ++p) {
      std::vector<float> g(size_t(table.params[p].numel()));
      for (float& x : g) x = float(integer_grad(comm->rank(), at++));
      store.grad_from_host(p, g);
    }
    DataParallel dp(store, store.dense(), store.dense_members(), *comm, zero, ReduceDtype::fp32,
                    DataParallel::kRoundValues, overlap);
    EXPECT_EQ(dp.overlapped(), overlap && R > 1 && comm->overlaps());
    comm->reset_bytes_sent();
    dp.post_layer(store, 1);  // the backward passes layer 1 first
    dp.progress();
    dp.post_layer(store, 1);  // posted already: nothing
    dp.post_layer(store, 0);
    dp.reduce_gradients(store);
    int64_t bytes = comm->bytes_sent();
    const auto got = store.grads_to_host();
    at = 0;
    int64_t checked = 0;
    for (size_t p = 0; p < table.params.size(); ++p) {
      const RowRange own = dp.owned(p);
      const int64_t cols = table.params[p].cols;
      for (int64_t e = 0; e < table.params[p].numel(); ++e, ++at) {
        if (e / cols < own.begin || e / cols >= own.end) continue;
        double want = 0;
        for (int r = 0; r < R; ++r) want += integer_grad(r, at);
        ASSERT_EQ(double(got[p][size_t(e)]), want) << table.params[p].name << "[" << e << "]";
        ++checked;
      }
    }
    int64_t sums[2] = {checked, bytes};
    host.allreduce_sum(sums, 2);
    EXPECT_EQ(sums[0], zero || R == 1 ? 25 : 25 * R);
    // Over the ranks: the reduce-scatter sends (R - 1) x 25 values; an all-reduce twice that (the
    // ring's count rounds down per rank and bucket).
    const int64_t want_bytes = (zero ? 1 : 2) * (R - 1) * 25 * 4;
    EXPECT_NEAR(double(sums[1]), double(want_bytes), zero ? 0 : 3 * R);
    // A second step reuses the buckets: posted again, waited again.
    dp.reduce_gradients(store);
  }
}

INSTANTIATE_TEST_SUITE_P(Backends, GradReduce, testing::Values(DeviceKind::cpu, DeviceKind::emulated),
                         [](const testing::TestParamInfo<DeviceKind>& i) { return std::string(to_string(i.param)); });

}  // namespace
}  // namespace fp8moe
