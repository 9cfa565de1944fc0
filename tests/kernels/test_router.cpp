// The router (kernels/router.h) through each device backend against the CPU backend
// (backend_cases.h, routing_cases.h): sigmoid and softmax scores, node-limited groups, scaled and
// unnormalised gates, capacity drops (capacity 0 included), 1024 experts, one token and none. The
// router's own rules (ties, groups, the bias, capacity order) are checked against hand-worked
// cases through the model, in tests/model/test_moe.cpp (Router.*).
#include <gtest/gtest.h>

#include <vector>

#include "kernels/router.h"
#include "tests/kernels/backend_cases.h"
#include "tests/kernels/routing_cases.h"
#include "tests/kernels/vmath_levels.h"

namespace fp8moe::test {
namespace {

// The scores' exponentials (kernels/cpu/vmath.h) on every vector width this CPU has: every case's
// scores and gates (sigmoid and softmax, 8 to 1024 experts).
TEST(Ops, RoutingIsTheSameOnEveryVectorMathLevel) {
  for (const RouterCase& s : kRouterCases) {
    const auto z = router_logits(s, 90 + s.N + s.E);
    const std::vector<float> bias(static_cast<size_t>(s.E), 0.0f);
    expect_same_bits_on_every_level(
        [&] {
          const int64_t Nk = s.N * s.k;
          const size_t nk = static_cast<size_t>(Nk), e = static_cast<size_t>(s.E);
          std::vector<float> prob(static_cast<size_t>(s.N) * e), gate(nk);
          std::vector<int32_t> expert(nk), row_slot(nk), slot_row(nk);
          std::vector<uint8_t> kept(nk);
          std::vector<int64_t> load(e), offsets(e + 1), row_token(nk);
          cpu::route(z.data(), bias.data(), rule_of(s),
                     {s.N, s.E, s.k, prob.data(), expert.data(), gate.data(), kept.data(), load.data(), offsets.data(),
                      row_token.data(), row_slot.data(), slot_row.data()});
          std::vector<double> all;
          append(all, prob), append(all, gate);
          all.insert(all.end(), expert.begin(), expert.end());
          return all;
        },
        s.sigmoid ? "router, sigmoid" : "router, softmax");
  }
}

TEST_P(DeviceOps, RoutingMatchesCpu) {
  for (const RouterCase& s : kRouterCases) {
    SCOPED_TRACE(testing::Message() << "N" << s.N << " E" << s.E << " k" << s.k << (s.sigmoid ? " sigmoid" : " softmax")
                                    << " groups " << s.groups << "/" << s.topk_group << " normalise " << s.normalise
                                    << " scaling " << s.scaling << " cap " << s.capacity);
    const auto z = router_logits(s, 40 + s.N + s.E);
    std::vector<float> bias(static_cast<size_t>(s.E), 0.0f);
    bias[3] = -10.0f;  // expert 3 receives nothing (the bias steers the keys, never the gates)
    auto [c, g] = both([&](Backend& be) {
      Tensor gz = up(be, z), gb = up(be, bias);
      Routing r(be, s.N, s.E, s.k);
      be.route(gz.f32(), gb.f32(), rule_of(s), r.buffers());
      expect_unchanged(gz, z, "logits");
      expect_unchanged(gb, bias, "bias");
      return HostRouting(r);
    });
    // The CPU backend is the CPU kernel, on poisoned host buffers of the same sizes.
    const int64_t Nk = s.N * s.k;
    std::vector<float> prob = poisoned_f32(s.N * s.E), gate = poisoned_f32(Nk);
    std::vector<int32_t> expert(size_t(Nk), -7), row_slot(size_t(Nk), -7), slot_row(size_t(Nk), -7);
    std::vector<uint8_t> kept(size_t(Nk), 0xFF);
    std::vector<int64_t> load(size_t(s.E), -7), offsets(size_t(s.E + 1), -7), row_token(size_t(Nk), -7);
    cpu::route(z.data(), bias.data(), rule_of(s),
               {s.N, s.E, s.k, prob.data(), expert.data(), gate.data(), kept.data(), load.data(), offsets.data(),
                row_token.data(), row_slot.data(), slot_row.data()});
    row_token.resize(size_t(c.R)), row_slot.resize(size_t(c.R));
    expect_bitwise(c.prob, prob, "cpu backend prob vs cpu::route");
    expect_bitwise(c.gate, gate, "cpu backend gate vs cpu::route");
    EXPECT_EQ(c.expert, expert);
    EXPECT_EQ(c.kept, kept);
    EXPECT_EQ(c.load, load);
    EXPECT_EQ(c.offsets, offsets);
    EXPECT_EQ(c.row_token, row_token);
    EXPECT_EQ(c.row_slot, row_slot);
    EXPECT_EQ(c.slot_row, slot_row);
    EXPECT_EQ(c.load[3], 0);
    if (s.capacity == 0) {
      EXPECT_EQ(c.R, 0);
    }
    EXPECT_EQ(g.expert, c.expert);
    EXPECT_EQ(g.kept, c.kept);
    EXPECT_EQ(g.load, c.load);
    EXPECT_EQ(g.offsets, c.offsets);
    EXPECT_EQ(g.row_token, c.row_token);
    EXPECT_EQ(g.row_slot, c.row_slot);
    EXPECT_EQ(g.slot_row, c.slot_row);
    // CUDA: the device expf / exp against the CPU's (SLEEF, kernels/cpu/vmath.h).
    expect_match(g.prob, c.prob, 1e-6, "prob");
    expect_match(g.gate, c.gate, 1e-6, "gate");
  }
}

}  // namespace
}  // namespace fp8moe::test
