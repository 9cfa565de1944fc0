// The MoE ops (kernels/moe_ops.h): permute, unpermute_add (gated and not), gate_grad, row_gates,
// slot_grads, sum_rows (FP32 and BF16), the BF16 forms of the gathers (against loops written here),
// router_grad (with and without the aux loss), aux_loss and the router bias update, through each
// device backend against the CPU backend (backend_cases.h) on the routings of routing_cases.h:
// capacity drops, every assignment dropped, one token and none. Their finite-difference checks run
// through the model, in tests/model/test_moe.cpp (Moe.*).
#include <gtest/gtest.h>

#include <numeric>
#include <vector>

#include "kernels/moe_ops.h"
#include "tests/kernels/backend_cases.h"
#include "tests/kernels/bf16_reference.h"
#include "tests/kernels/routing_cases.h"
#include "tests/test_random.h"

namespace fp8moe::test {
namespace {

// The CPU backend's routing of case s (logits from `seed`, expert 3's bias -10 when `steer`).
HostRouting cpu_routing(Backend& cpu_be, const RouterCase& s, uint64_t seed, bool steer) {
  const auto z = router_logits(s, seed);
  std::vector<float> bias(static_cast<size_t>(s.E), 0.0f);
  if (steer) bias[3] = -10.0f;
  Tensor cz = up(cpu_be, z), cb = up(cpu_be, bias);
  Routing cr(cpu_be, s.N, s.E, s.k);
  cpu_be.route(cz.f32(), cb.f32(), rule_of(s), cr.buffers());
  return HostRouting(cr);
}

TEST_P(DeviceOps, PermuteUnpermuteMatchCpu) {
  for (const RouterCase& s : kRouterCases) {
    SCOPED_TRACE(testing::Message() << "N" << s.N << " E" << s.E << " k" << s.k << " cap " << s.capacity);
    HostRouting h = cpu_routing(cpu(), s, 40 + s.N + s.E, true);
    // permute / unpermute_add on the CPU's routing in each backend's memory (bitwise).
    const int64_t D = 72, R = h.R;
    const auto x = normal_vector(s.N * D, 41), rows = normal_vector(R * D, 42), out0 = normal_vector(s.N * D, 43);
    struct Out {
      std::vector<float> perm, gated, ungated;
    };
    auto [c, g] = both([&](Backend& be) {
      Routing r = copy_routing(h, be);
      const RoutingBuffers rb = r.buffers();
      Tensor gx = up(be, x), grows = up(be, rows), gated = up(be, out0), ungated = up(be, out0),
             perm = poisoned(be, DType::f32, R * D);
      be.permute(gx.f32(), rb.row_token, R, D, perm.f32());
      be.unpermute_add(rb, R, grows.f32(), D, true, gated.f32());
      be.unpermute_add(rb, R, grows.f32(), D, false, ungated.f32());
      expect_unchanged(gx, x, "x");
      expect_unchanged(grows, rows, "rows");
      return Out{down<float>(perm), down<float>(gated), down<float>(ungated)};
    });
    // The CPU backend is the CPU kernel.
    Out ref{poisoned_f32(R * D), out0, out0};
    cpu::permute(x.data(), h.row_token.data(), R, D, ref.perm.data());
    cpu::unpermute_add(h.buffers(), R, rows.data(), D, true, ref.gated.data());
    cpu::unpermute_add(h.buffers(), R, rows.data(), D, false, ref.ungated.data());
    expect_bitwise(c.perm, ref.perm, "cpu backend vs cpu::permute");
    expect_bitwise(c.gated, ref.gated, "cpu backend vs cpu::unpermute_add gated");
    expect_bitwise(c.ungated, ref.ungated, "cpu backend vs cpu::unpermute_add ungated");
    if (R > 0) {
      EXPECT_NE(ref.ungated, out0) << "the kept rows were added";
    }
    expect_bitwise(g.perm, c.perm, "permute");
    expect_bitwise(g.gated, c.gated, "unpermute_add gated");
    expect_bitwise(g.ungated, c.ungated, "unpermute_add ungated");
  }
}

TEST_P(DeviceOps, Bf16GathersMatchLoopsOnTheWidenedRows) {
  // train.activations bf16's gathers: permute_bf16 writes each row rounded to the nearest BF16
  // (tests/kernels/bf16_reference.h); unpermute_add_bf16 and gate_grad_bf16 read BF16 rows. Against
  // loops written here on the rows widened (exactly): a token's rows added into its output in row
  // order in FP32 (gated: the gate times the value, rounded, then added); dye = gate x dout;
  // dgate = dout . row summed in FP64 in order, 0 for dropped slots. Bitwise on every backend, but
  // CUDA's dgate (a warp tree: 1e-12).
  for (const RouterCase& s : kRouterCases) {
    SCOPED_TRACE(testing::Message() << "N" << s.N << " E" << s.E << " k" << s.k << " cap " << s.capacity);
    HostRouting h = cpu_routing(cpu(), s, 80 + s.N + s.E, true);
    const int64_t D = 72, R = h.R, N = s.N, k = s.k;
    auto x = normal_vector(N * D, 81);
    if (N * D >= 3) x[0] = 1.00390625f, x[1] = 1.01171875f, x[2] = -1.00390625f;  // ties: 1 + 2^-8, 1 + 3 2^-8
    const auto out0 = normal_vector(N * D, 83), dout = normal_vector(N * D, 84), rows32 = normal_vector(R * D, 82);
    std::vector<uint16_t> rows(static_cast<size_t>(R * D));
    for (size_t i = 0; i < rows.size(); ++i) rows[i] = nearest_bf16(rows32[i]);
    struct Out {
      std::vector<uint16_t> perm;
      std::vector<float> gated, ungated, dye;
      std::vector<double> dgate;
    };
    auto [c, g] = both([&](Backend& be) {
      Routing r = copy_routing(h, be);
      const RoutingBuffers rb = r.buffers();
      Tensor gx = up(be, x), gdo = up(be, dout), gated = up(be, out0), ungated = up(be, out0);
      Tensor g16(be, DType::bf16, {R * D}), perm = poisoned(be, DType::bf16, R * D),
             dye = poisoned(be, DType::f32, R * D), dgate = poisoned(be, DType::f64, N * k);
      if (R > 0) be.upload(g16.raw(), rows.data(), rows.size() * 2);
      be.permute_bf16(gx.f32(), rb.row_token, R, D, perm.data<uint16_t>());
      be.unpermute_add_bf16(rb, R, g16.data<uint16_t>(), D, true, gated.f32());
      be.unpermute_add_bf16(rb, R, g16.data<uint16_t>(), D, false, ungated.f32());
      be.gate_grad_bf16(rb, R, gdo.f32(), g16.data<uint16_t>(), D, dye.f32(), dgate.data<double>());
      expect_unchanged(gx, x, "x");
      expect_unchanged(g16, rows, "rows");
      return Out{down<uint16_t>(perm), down<float>(gated), down<float>(ungated), down<float>(dye),
                 down<double>(dgate)};
    });
    Out want{std::vector<uint16_t>(size_t(R * D)), out0, out0, std::vector<float>(size_t(R * D)),
             std::vector<double>(size_t(N * k), 0.0)};
    for (int64_t i = 0; i < R; ++i) {
      const int64_t n = h.row_token[size_t(i)], slot = n * k + h.row_slot[size_t(i)];
      const float gate = h.gate[size_t(slot)];
      double dg = 0;
      for (int64_t d = 0; d < D; ++d) {
        const float v = bf16_value(rows[size_t(i * D + d)]);
        want.perm[size_t(i * D + d)] = nearest_bf16(x[size_t(n * D + d)]);
        const float gv = gate * v;
        want.gated[size_t(n * D + d)] += gv;
        want.ungated[size_t(n * D + d)] += v;
        want.dye[size_t(i * D + d)] = gate * dout[size_t(n * D + d)];
        dg += double(dout[size_t(n * D + d)]) * double(v);
      }
      want.dgate[size_t(slot)] = dg;
    }
    if (N * D >= 3 && R > 0 && h.row_token[0] == 0) {
      EXPECT_EQ(want.perm[0], 0x3F80) << "1 + 2^-8: a tie, to even (1)";
      EXPECT_EQ(want.perm[1], 0x3F82) << "1 + 3 2^-8: a tie, to even (1 + 2^-6)";
    }
    expect_bitwise(c.perm, want.perm, "cpu permute_bf16 vs the nearest BF16");
    expect_bitwise(c.gated, want.gated, "cpu unpermute_add_bf16 gated vs the loop");
    expect_bitwise(c.ungated, want.ungated, "cpu unpermute_add_bf16 ungated vs the loop");
    expect_bitwise(c.dye, want.dye, "cpu gate_grad_bf16 dye vs the loop");
    expect_bitwise(c.dgate, want.dgate, "cpu gate_grad_bf16 dgate vs the loop");
    if (R > 0) {
      EXPECT_NE(c.ungated, out0) << "the kept rows were added";
    }
    expect_bitwise(g.perm, c.perm, "permute_bf16");
    expect_bitwise(g.gated, c.gated, "unpermute_add_bf16 gated");
    expect_bitwise(g.ungated, c.ungated, "unpermute_add_bf16 ungated");
    expect_bitwise(g.dye, c.dye, "gate_grad_bf16 dye");
    expect_match(g.dgate, c.dgate, 1e-12, "gate_grad_bf16 dgate");
  }
}

TEST_P(DeviceOps, RowGatesAndSlotGradsMatchCpu) {
  // train.moe_gates expert: each permuted row's gate to the experts, and the gates' gradients the
  // experts computed per row back to their (token, slot). Checked through slot_row (slot -> row,
  // -1 where dropped), which the ops do not read: row slot_row[n, j] carries gate[n, j], and
  // dgate[n, j] is that row's gradient, 0 for a dropped slot. Copies: bitwise on every backend.
  for (const RouterCase& s : kRouterCases) {
    SCOPED_TRACE(testing::Message() << "N" << s.N << " E" << s.E << " k" << s.k << " cap " << s.capacity);
    HostRouting h = cpu_routing(cpu(), s, 70 + s.N + s.E, true);
    const int64_t R = h.R;
    std::vector<double> row_grads(static_cast<size_t>(R));
    for (int64_t i = 0; i < R; ++i) row_grads[size_t(i)] = 0.5 + double(i);
    auto [c, g] = both([&](Backend& be) {
      Routing r = copy_routing(h, be);
      const RoutingBuffers rb = r.buffers();
      Tensor gates = poisoned(be, DType::f32, R), rg = up(be, row_grads), dgate = poisoned(be, DType::f64, s.N * s.k);
      be.row_gates(rb, R, gates.f32());
      be.slot_grads(rb, R, rg.data<double>(), dgate.data<double>());
      return std::make_pair(down<float>(gates), down<double>(dgate));
    });
    int64_t kept = 0;
    for (int64_t slot = 0; slot < s.N * s.k; ++slot) {
      const int32_t row = h.slot_row[size_t(slot)];
      if (row < 0) {
        EXPECT_EQ(c.second[size_t(slot)], 0.0) << "dropped slot " << slot;
        continue;
      }
      ++kept;
      EXPECT_EQ(c.first[size_t(row)], h.gate[size_t(slot)]) << "row " << row;
      EXPECT_EQ(c.second[size_t(slot)], row_grads[size_t(row)]) << "slot " << slot;
    }
    EXPECT_EQ(kept, R) << "every row is some slot's";
    expect_bitwise(g.first, c.first, "row_gates");
    expect_bitwise(g.second, c.second, "slot_grads");
  }
}

TEST_P(DeviceOps, SumRowsMatchFp64AndCpu) {
  // The relay's sums across nodes (parallel/expert_dispatch.h): out[u] = the rows index[offsets[u]
  // .. offsets[u + 1]) summed in that order, an empty list giving zeros and a row repeated counting
  // twice. FP32: within 1e-6 of the FP64 sum; BF16: exact on sums BF16 holds, and rounded once
  // (1 + 2^-8 + 2^-8 = 1 + 2^-7, where a rounding after each addition would stay at 1). Bitwise
  // on every backend.
  const int64_t D = 37, M = 9, n = 5;
  const auto rows = normal_vector(M * D, 71);
  const std::vector<int64_t> offsets{0, 3, 3, 4, 7, 10}, index{2, 7, 3, 5, 1, 1, 8, 4, 6, 0};
  std::vector<uint16_t> rows16(static_cast<size_t>(M * D));
  for (int64_t i = 0; i < M * D; ++i) rows16[size_t(i)] = bf16_encode(float(i % 11) - 3.0f + 0.5f * float(i % 3));
  // Output 4 (rows 4, 6, 0, which no other output reads), column 0: 1 + 2^-8 + 2^-8.
  rows16[size_t(4 * D)] = bf16_encode(1.0f), rows16[size_t(6 * D)] = bf16_encode(0.00390625f);
  rows16[size_t(0 * D)] = bf16_encode(0.00390625f);
  auto [c, g] = both([&](Backend& be) {
    Tensor r = up(be, rows), off = up(be, offsets), idx = up(be, index), out = poisoned(be, DType::f32, n * D);
    Tensor r16(be, DType::bf16, {M * D}), out16(be, DType::bf16, {n * D});
    be.upload(r16.raw(), rows16.data(), rows16.size() * 2);
    be.sum_rows(r.f32(), off.data<int64_t>(), idx.data<int64_t>(), n, D, out.f32());
    be.sum_rows_bf16(r16.data<uint16_t>(), off.data<int64_t>(), idx.data<int64_t>(), n, D, out16.data<uint16_t>());
    return std::make_pair(down<float>(out), down<uint16_t>(out16));
  });
  for (int64_t u = 0; u < n; ++u)
    for (int64_t d = 0; d < D; ++d) {
      double want = 0, want16 = 0;
      for (int64_t t = offsets[size_t(u)]; t < offsets[size_t(u) + 1]; ++t) {
        want += double(rows[size_t(index[size_t(t)] * D + d)]);
        want16 += double(bf16_decode(rows16[size_t(index[size_t(t)] * D + d)]));
      }
      EXPECT_NEAR(c.first[size_t(u * D + d)], want, 1e-6) << "u " << u << " d " << d;
      const float got16 = bf16_decode(c.second[size_t(u * D + d)]);
      if (u == 4 && d == 0) {
        EXPECT_EQ(got16, 1.0078125f) << "1 + 2^-8 + 2^-8 rounded once";
        EXPECT_EQ(want16, 1.0078125);
      } else {
        EXPECT_EQ(double(got16), want16) << "u " << u << " d " << d;
      }
    }
  for (int64_t d = 0; d < D; ++d) EXPECT_EQ(c.first[size_t(D + d)], 0.0f) << "an empty list";
  expect_bitwise(g.first, c.first, "sum_rows");
  expect_bitwise(g.second, c.second, "sum_rows_bf16");
}

TEST_P(DeviceOps, MoeGradientsMatchCpu) {
  for (const RouterCase& s : kRouterCases) {
    SCOPED_TRACE(testing::Message() << "N" << s.N << " E" << s.E << " k" << s.k << (s.sigmoid ? " sigmoid" : " softmax")
                                    << " normalise " << s.normalise << " scaling " << s.scaling << " cap " << s.capacity);
    HostRouting h = cpu_routing(cpu(), s, 50 + s.N + s.E, false);
    const int64_t D = 72, R = h.R;
    const auto dout = normal_vector(s.N * D, 61), expert_out = normal_vector(R * D, 62);
    const auto bias0 = normal_vector(s.E, 63, 0.01f);
    struct Out {
      std::vector<float> dye;
      std::vector<double> dgate;
      std::vector<float> dz_plain, dz_aux, bias;
      std::vector<double> aux, aux_off;
    };
    RouterGradRule rule;
    rule.sigmoid = s.sigmoid, rule.normalise = s.normalise, rule.scaling = s.scaling;
    RouterGradRule rule_aux = rule;
    rule_aux.aux_coef = 0.01, rule_aux.aux_grad_scale = 3.0;
    // router_grad from the CPU's dgate on both backends (bitwise given the same dgate).
    std::vector<double> cpu_dgate;
    auto [c, g] = both([&](Backend& be) {
      Routing r = copy_routing(h, be);
      const RoutingBuffers rb = r.buffers();
      Tensor gdo = up(be, dout), geo = up(be, expert_out), dye = poisoned(be, DType::f32, R * D),
             dgate = poisoned(be, DType::f64, s.N * s.k);
      be.gate_grad(rb, R, gdo.f32(), geo.f32(), D, dye.f32(), dgate.data<double>());
      Out o;
      o.dye = down<float>(dye), o.dgate = down<double>(dgate);
      if (is_cpu(be)) cpu_dgate = o.dgate;
      Tensor dg = up(be, cpu_dgate), dz = poisoned(be, DType::f32, s.N * s.E);
      be.router_grad(rb, dg.data<double>(), rule, dz.f32());
      o.dz_plain = down<float>(dz);
      be.router_grad(rb, dg.data<double>(), rule_aux, dz.f32());
      o.dz_aux = down<float>(dz);
      Tensor aux = poisoned(be, DType::f64, 1);
      be.aux_loss(rb, 0.01, s.sigmoid, aux.data<double>());
      o.aux = down<double>(aux);
      be.aux_loss(rb, 0.0, s.sigmoid, aux.data<double>());
      o.aux_off = down<double>(aux);
      Tensor b = up(be, bias0);
      be.bias_update(b.f32(), rb.load, s.E, 1e-3);
      o.bias = down<float>(b);
      expect_unchanged(gdo, dout, "dout");
      expect_unchanged(geo, expert_out, "expert_out");
      expect_unchanged(r.load, h.load, "load");
      return o;
    });
    // The CPU backend is the CPU kernel.
    Out ref{poisoned_f32(R * D), poisoned_f64(s.N * s.k), poisoned_f32(s.N * s.E), poisoned_f32(s.N * s.E), bias0,
            {}, {}};
    cpu::gate_grad(h.buffers(), R, dout.data(), expert_out.data(), D, ref.dye.data(), ref.dgate.data());
    cpu::router_grad(h.buffers(), ref.dgate.data(), rule, ref.dz_plain.data());
    cpu::router_grad(h.buffers(), ref.dgate.data(), rule_aux, ref.dz_aux.data());
    ref.aux = {cpu::aux_loss(h.buffers(), 0.01, s.sigmoid)};
    cpu::bias_update(ref.bias.data(), h.load.data(), s.E, 1e-3);
    expect_bitwise(c.dye, ref.dye, "cpu backend vs cpu::gate_grad dye");
    expect_bitwise(c.dgate, ref.dgate, "cpu backend vs cpu::gate_grad dgate");
    expect_bitwise(c.dz_plain, ref.dz_plain, "cpu backend vs cpu::router_grad");
    expect_bitwise(c.dz_aux, ref.dz_aux, "cpu backend vs cpu::router_grad with the aux loss");
    expect_bitwise(c.aux, ref.aux, "cpu backend vs cpu::aux_loss");
    expect_bitwise(c.bias, ref.bias, "cpu backend vs cpu::bias_update");
    if (R > 0) {
      EXPECT_NE(c.dz_aux, c.dz_plain) << "the aux loss has a gradient";
    }
    expect_bitwise(g.dye, c.dye, "dye");
    // CUDA: each row's dot product in double: a warp tree on the GPU, serial on the CPU.
    expect_match(g.dgate, c.dgate, 1e-12, "dgate");
    expect_bitwise(g.dz_plain, c.dz_plain, "router_grad");
    expect_bitwise(g.dz_aux, c.dz_aux, "router_grad with the aux loss");
    expect_bitwise(g.aux, c.aux, "aux_loss");
    EXPECT_EQ(g.aux_off[0], 0.0);
    EXPECT_EQ(c.aux_off[0], 0.0);
    expect_bitwise(g.bias, c.bias, "router bias");
  }
}

TEST_P(DeviceOps, BiasUpdateMatchesCpuBitwise) {
  const std::vector<float> bias = normal_vector(64, 55);
  std::vector<int64_t> load(64);
  for (int e = 0; e < 64; ++e) load[e] = (e * 37) % 11;
  auto [c, g] = both([&](Backend& be) {
    Tensor gb = up(be, bias), gl = up(be, load);
    be.bias_update(gb.f32(), gl.data<int64_t>(), 64, 1e-3);
    expect_unchanged(gl, load, "load");
    return down<float>(gb);
  });
  // Each bias moves by the rate towards balance: up when its load is below the mean, down above.
  std::vector<float> ref = bias;
  const double mean = double(std::accumulate(load.begin(), load.end(), int64_t(0))) / 64.0;
  for (int e = 0; e < 64; ++e) ref[e] = bias[e] + (load[e] < mean ? 1e-3f : load[e] > mean ? -1e-3f : 0.0f);
  expect_bitwise(c, ref, "cpu backend router bias vs the rule");
  expect_bitwise(g, c, "router bias");
}

}  // namespace
}  // namespace fp8moe::test
