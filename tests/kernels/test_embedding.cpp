// The embedding (kernels/embedding.h): the CPU gather and scatter-add against their definition,
// then both through each device backend against the CPU backend (backend_cases.h): the whole
// vocabulary and one tensor-parallel rank's rows [v0, v0 + Vl), repeated ids, one token, none.
#include <gtest/gtest.h>

#include <algorithm>
#include <tuple>
#include <utility>
#include <vector>

#include "kernels/embedding.h"
#include "tests/kernels/backend_cases.h"
#include "tests/kernels/fp64_reference.h"
#include "tests/test_random.h"

namespace fp8moe::test {
namespace {

// ---- the CPU op against its definition ---------------------------------------------------------

TEST(Ops, EmbeddingGatherAndScatterAdd) {
  const int64_t V = 5, D = 3;
  const Vec table = random_vec(V * D, 11);
  const std::vector<int32_t> ids = {4, 0, 4, 2};
  Vec out(ids.size() * D);
  cpu::embedding_forward(table.data(), ids.data(), int64_t(ids.size()), D, 0, V, out.data());
  for (size_t n = 0; n < ids.size(); ++n)
    for (int64_t d = 0; d < D; ++d) EXPECT_EQ(out[n * D + d], table[ids[n] * D + d]);
  Vec dtable(V * D, 1.0f);
  const Vec dout = random_vec(ids.size() * D, 12);
  cpu::embedding_backward(dout.data(), ids.data(), int64_t(ids.size()), D, 0, V, dtable.data());
  for (int64_t d = 0; d < D; ++d) {
    EXPECT_FLOAT_EQ(dtable[4 * D + d], 1.0f + dout[0 * D + d] + dout[2 * D + d]);  // id 4 twice
    EXPECT_FLOAT_EQ(dtable[0 * D + d], 1.0f + dout[1 * D + d]);
    EXPECT_EQ(dtable[1 * D + d], 1.0f);  // unused row untouched
  }
}

// ---- each device backend against the CPU backend ------------------------------------------------

TEST_P(DeviceOps, EmbeddingMatchesCpuBitwise) {
  const int64_t V = 1000, D = 96;
  // The whole vocabulary, then this rank's rows [300, 700) of it (tensor parallelism); more tokens
  // than the CUDA backward's 65,535 position blocks (its grid-stride loop).
  for (auto [N, v0, Vl] : {std::tuple<int64_t, int64_t, int64_t>{4097, 0, V}, {4097, 300, 400}, {1, 0, V}, {0, 0, V},
                           {70001, 0, V}}) {
    SCOPED_TRACE(testing::Message() << "N " << N << " rows [" << v0 << ", " << v0 + Vl << ")");
    const auto table = normal_vector(Vl * D, 31), dout = normal_vector(N * D, 32), dtable0 = normal_vector(Vl * D, 33);
    std::vector<int32_t> ids(static_cast<size_t>(N));
    for (int64_t n = 0; n < N; ++n) ids[n] = int32_t((n * n) % 37 * 27 % V);  // many repeats, local and not
    auto [c, g] = both([&](Backend& be) {
      Tensor gtab = up(be, table), gdo = up(be, dout), gdt = up(be, dtable0), gid = up(be, ids),
             out = poisoned(be, DType::f32, N * D);
      be.embedding_forward(gtab.f32(), gid.data<int32_t>(), N, D, v0, Vl, out.f32());
      be.embedding_backward(gdo.f32(), gid.data<int32_t>(), N, D, v0, Vl, gdt.f32());
      expect_unchanged(gtab, table, "table");
      expect_unchanged(gdo, dout, "dout");
      expect_unchanged(gid, ids, "ids");
      return std::make_pair(down<float>(out), down<float>(gdt));
    });
    // The CPU backend is the CPU kernel.
    std::vector<float> out = poisoned_f32(N * D), dtable = dtable0;
    cpu::embedding_forward(table.data(), ids.data(), N, D, v0, Vl, out.data());
    cpu::embedding_backward(dout.data(), ids.data(), N, D, v0, Vl, dtable.data());
    expect_bitwise(c.first, out, "cpu backend vs cpu::embedding_forward");
    expect_bitwise(c.second, dtable, "cpu backend vs cpu::embedding_backward");
    if (N > 0) {
      EXPECT_NE(c.second, dtable0) << "the scatter-add changed dtable";
    }
    expect_bitwise(g.first, c.first, "embedding");
    expect_bitwise(g.second, c.second, "dtable");
    if (v0 > 0 && N > 0) {
      const int64_t n_far = std::find_if(ids.begin(), ids.end(), [&](int32_t id) { return id < v0 || id >= v0 + Vl; }) - ids.begin();
      ASSERT_LT(n_far, N);
      for (int64_t d = 0; d < D; ++d) ASSERT_EQ(g.first[n_far * D + d], 0.0f) << "a non-local id's row is 0";
    }
  }
}

}  // namespace
}  // namespace fp8moe::test
