// The expert dispatcher at ep = world (1, 2, 4, 8 ranks) with self-describing rows: every row
// carries its source rank, token id, slot and expert, so a row that lands at the wrong rank, in the
// wrong expert's group or out of order is seen; counts per expert are checked against an
// independent enumeration of every rank's routing; dispatch -> identity -> combine -> gate-weighted
// sum must give x * sum(gates) exactly (power-of-two gates).
#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <numeric>

#include "kernels/backend.h"
#include "kernels/fp8.h"
#include "parallel/device_communicator.h"
#include "parallel/expert_dispatch.h"
#include "parallel/mpi_communicator.h"

namespace fp8moe {
namespace {

constexpr int kD = 6;  // row: src, token, slot, expert, two payload values

// Routing of token t of rank r: top-k distinct experts, deterministic. Some ranks send nothing to
// some experts, and expert E - 1 never receives a row (an empty expert).
int expert_of(int r, int t, int slot, int E) {
  const int usable = std::max(1, E - 1);
  return (r * 7 + t * 3 + slot * (1 + t % 2)) % usable;
}

struct Routed {
  std::vector<int> expert;  // (T, k)
  std::vector<float> gate;  // (T, k)
};

Routed route(int r, int T, int k, int E) {
  Routed out;
  for (int t = 0; t < T; ++t) {
    std::vector<int> chosen;
    for (int s = 0; chosen.size() < size_t(k); ++s) {
      const int e = expert_of(r, t, s, E);
      if (std::find(chosen.begin(), chosen.end(), e) == chosen.end()) chosen.push_back(e);
      if (s > 64) chosen.push_back(e);  // fewer usable experts than k: repeats are allowed
    }
    for (int s = 0; s < k; ++s) {
      out.expert.push_back(chosen[size_t(s)]);
      out.gate.push_back(s == 0 ? 0.5f : 0.25f);
    }
  }
  return out;
}

float payload(int r, int t, int d) { return float(r * 1000 + t) + 0.125f * float(d); }

// On the cpu backend (host memory), and on the emulated device with its own collectives and with
// MPI staged through host memory: the rows never leave device memory but through the communicator.
struct DispatchCase {
  DeviceKind kind;
  bool native;  // the emulated device's own collectives (runtime.comm nccl), else staged MPI
};
class ExpertDispatchOn : public testing::TestWithParam<DispatchCase> {
 protected:
  void SetUp() override {
    be_ = make_backend(GetParam().kind);
    if (!be_->host_accessible()) device_ = make_device_communicator(MPI_COMM_WORLD, *be_, GetParam().native, "ep");
  }
  Communicator& rows_comm() { return device_ ? *device_ : world_; }
  MpiCommunicator world_{MPI_COMM_WORLD};
  std::unique_ptr<Backend> be_;
  std::unique_ptr<Communicator> device_;  // (destroyed before the backend it works on)
};

TEST_P(ExpertDispatchOn, SelfDescribingRowsRoundTrip) {
  MpiCommunicator& world = world_;
  const std::unique_ptr<Backend>& be = be_;
  Communicator& rows_comm = this->rows_comm();
  const int P = world.size(), me = world.rank();
  for (int E : {P, 2 * P, 4 * P}) {
    for (int T : {0, 1, 13}) {
      const int k = std::min(2, E);
      ExpertDispatcher disp(*be, rows_comm, world, E);
      ASSERT_EQ(disp.local_experts(), E / P);
      const Routed rt = route(me, T, k, E);
      // Permute (token, slot) rows into global expert order, stable.
      std::vector<int> order(static_cast<size_t>(T * k));
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return rt.expert[size_t(a)] < rt.expert[size_t(b)]; });
      std::vector<int64_t> counts(static_cast<size_t>(E), 0);
      std::vector<float> x(static_cast<size_t>(T * kD)), rows(static_cast<size_t>(T * k * kD));
      for (int t = 0; t < T; ++t)
        for (int d = 0; d < kD; ++d) x[size_t(t * kD + d)] = d < 4 ? 0.0f : payload(me, t, d);
      for (size_t i = 0; i < order.size(); ++i) {
        const int a = order[i], t = a / k, s = a % k, e = rt.expert[size_t(a)];
        ++counts[size_t(e)];
        float* row = &rows[i * kD];
        row[0] = float(me), row[1] = float(t), row[2] = float(s), row[3] = float(e);
        row[4] = payload(me, t, 4), row[5] = payload(me, t, 5);
      }
      const DispatchPlan plan = disp.plan(counts.data());
      const Tensor rows_d = tensor_from(*be, rows, {int64_t(rows.size())});
      Tensor got_d;
      disp.dispatch(plan, rows_d.f32(), kD, &got_d);
      const std::vector<float> got = to_host<float>(got_d);

      // Every rank's routing, enumerated independently: rows per local expert, per source.
      const int L = E / P, first = me * L;
      std::vector<int64_t> want_local(static_cast<size_t>(L), 0);
      std::vector<std::vector<float>> want_rows(static_cast<size_t>(L));  // expected rows per local expert, in order
      for (int r = 0; r < P; ++r) {
        const Routed o = route(r, T, k, E);
        for (int l = 0; l < L; ++l)
          for (int a = 0; a < T * k; ++a)  // stable order within (expert, source): by (t, s)
            if (o.expert[size_t(a)] == first + l) {
              ++want_local[size_t(l)];
              const int t = a / k, s = a % k;
              for (float v : {float(r), float(t), float(s), float(first + l), payload(r, t, 4), payload(r, t, 5)})
                want_rows[size_t(l)].push_back(v);
            }
      }
      EXPECT_EQ(plan.local_rows, want_local) << "E " << E << " T " << T;
      std::vector<float> want;
      for (const auto& w : want_rows) want.insert(want.end(), w.begin(), w.end());
      EXPECT_EQ(got, want) << "E " << E << " T " << T;
      if (me == P - 1 && E > 1) {
        EXPECT_EQ(plan.local_rows[size_t(L - 1)], 0) << "expert E - 1 receives nothing";
      }

      // Identity experts, combine, gate-weighted sum: x * sum(gates).
      Tensor back_d(*be, DType::f32, {int64_t(rows.size())});
      disp.combine(plan, got_d.f32(), kD, back_d.f32());
      const std::vector<float> back = to_host<float>(back_d);
      EXPECT_EQ(back, rows) << "combine must return every row to its place";
      std::vector<float> y(static_cast<size_t>(T * kD), 0.0f);
      for (size_t i = 0; i < order.size(); ++i) {
        const int a = order[i], t = a / k;
        for (int d = 4; d < kD; ++d) y[size_t(t * kD + d)] += rt.gate[size_t(a)] * back[i * kD + d];
      }
      for (int t = 0; t < T; ++t) {
        float gsum = 0;
        for (int s = 0; s < k; ++s) gsum += rt.gate[size_t(t * k + s)];
        for (int d = 4; d < kD; ++d) EXPECT_EQ(y[size_t(t * kD + d)], x[size_t(t * kD + d)] * gsum);
      }

      // train.activations bf16's formats, the bytes moved unchanged: BF16 rows (the FP32 rows'
      // values rounded), and FP8 rows of 8 self-describing bytes with their two 1 x 4 tiles' scales.
      std::vector<uint16_t> rows16(rows.size()), want16(want.size());
      for (size_t i = 0; i < rows.size(); ++i) rows16[i] = bf16_encode(rows[i]);
      for (size_t i = 0; i < want.size(); ++i) want16[i] = bf16_encode(want[i]);
      const Tensor rows16_d = tensor_from(*be, rows16, {int64_t(rows16.size())});
      Tensor got16_d;
      disp.dispatch(plan, rows16_d.data<uint16_t>(), kD, &got16_d);
      EXPECT_EQ(to_host<uint16_t>(got16_d), want16) << "BF16 rows, E " << E << " T " << T;
      Tensor back16_d(*be, DType::bf16, {int64_t(rows.size())});
      disp.combine(plan, got16_d.data<uint16_t>(), kD, back16_d.data<uint16_t>());
      EXPECT_EQ(to_host<uint16_t>(back16_d), rows16) << "BF16 combine, E " << E << " T " << T;

      constexpr int kQ = 8;  // FP8 row: src, token, slot, expert and 4 payload bytes; scales (2) per row
      auto fp8_row = [](int r, int t, int s, int e, std::vector<uint8_t>* b, std::vector<float>* sc) {
        for (int v : {r, t, s, e, r * 7 + t, t * 3 + s, e + 1, 255 - t}) b->push_back(uint8_t(v));
        sc->push_back(float(r) + float(t) / 64), sc->push_back(float(s) + float(e) / 64);
      };
      std::vector<uint8_t> qb, want_qb;
      std::vector<float> qs, want_qs;
      for (size_t i = 0; i < order.size(); ++i) {
        const int a = order[i];
        fp8_row(me, a / k, a % k, rt.expert[size_t(a)], &qb, &qs);
      }
      for (int l = 0; l < L; ++l)
        for (int r = 0; r < P; ++r) {
          const Routed o = route(r, T, k, E);
          for (int a = 0; a < T * k; ++a)
            if (o.expert[size_t(a)] == first + l) fp8_row(r, a / k, a % k, first + l, &want_qb, &want_qs);
        }
      const int64_t R = int64_t(order.size());
      QTensor q(*be, R, kQ, Fp8Dtype::e4m3, Tiling::rows_1xT, 4);
      if (R > 0) to_device(*be, qb, q.data.data<uint8_t>()), to_device(*be, qs, q.scale_inv.data<float>());
      QTensor got_q;
      disp.dispatch(plan, q, &got_q);
      ASSERT_EQ(got_q.rows, plan.received);
      ASSERT_EQ(got_q.tiling, Tiling::rows_1xT);
      ASSERT_EQ(got_q.tile, 4);
      EXPECT_EQ(to_host<uint8_t>(got_q.data), want_qb) << "FP8 rows, E " << E << " T " << T;
      EXPECT_EQ(to_host<float>(got_q.scale_inv), want_qs) << "FP8 rows' scales, E " << E << " T " << T;

      // Per-tensor FP8 rows (the per-tensor recipes): the same bytes, no scales on the wire; the
      // group's one scale is its amax reduced over the ranks (rank r's amax r + 0.5: max P - 0.5),
      // and the received tensor carries this rank's copy (which the caller made the group's).
      Tensor amax = tensor_from(*be, std::vector<float>{float(me) + 0.5f}, {1});
      disp.reduce_amax(amax.f32());
      EXPECT_EQ(to_host<float>(amax), std::vector<float>{float(P) - 0.5f});
      QTensor t(*be, R, kQ, Fp8Dtype::e5m2, Tiling::per_tensor, 1);
      if (R > 0) to_device(*be, qb, t.data.data<uint8_t>());
      // (Each rank's own value here, to tell the receiver's copy from a sender's.)
      to_device(*be, std::vector<float>{0.25f * float(me + 1)}, t.scale_inv.data<float>());
      QTensor got_t;
      disp.dispatch(plan, t, &got_t);
      ASSERT_EQ(got_t.rows, plan.received);
      ASSERT_EQ(got_t.tiling, Tiling::per_tensor);
      ASSERT_EQ(got_t.dtype, Fp8Dtype::e5m2);
      EXPECT_EQ(to_host<uint8_t>(got_t.data), want_qb) << "per-tensor FP8 rows, E " << E << " T " << T;
      EXPECT_EQ(to_host<float>(got_t.scale_inv), std::vector<float>{0.25f * float(me + 1)});
    }
  }
}

// The relay across nodes (runtime.node_dedup): rows that are the same for all of a token's experts,
// sent once per token and other node, give the experts the direct exchange's rows bit for bit, in
// every format. Bytes: across nodes, one row per (token, other node holding one of its experts);
// in the node, the direct rows to this node's ranks plus what this rank forwards as a relay; both
// counted here by enumerating every rank's routing.
TEST_P(ExpertDispatchOn, RelayAcrossNodesSendsEachTokenOncePerNode) {
  MpiCommunicator& world = world_;
  const std::unique_ptr<Backend>& be = be_;
  Communicator& rows_comm = this->rows_comm();
  const int P = world.size(), me = world.rank();
  int cases = 0;
  for (int per_node : {1, 2, 3}) {  // nodes of 1, 2 or 3 ranks (the last node smaller where 3 does not divide P)
    std::vector<int64_t> node(static_cast<size_t>(P));
    for (int j = 0; j < P; ++j) node[size_t(j)] = j / per_node;
    if (node.back() == 0) continue;  // one node: nothing to relay
    for (int E : {P, 4 * P}) {
      for (int T : {0, 1, 13}) {
        const int k = std::min(4, E);
        ExpertDispatcher relay(*be, rows_comm, world, E), direct(*be, rows_comm, world, E);
        relay.set_nodes(node, true), direct.set_nodes(node, false);
        ASSERT_TRUE(relay.relays());
        ASSERT_FALSE(direct.relays());
        auto sorted_rows = [&](int r, std::vector<int>* order) {  // rank r's (token, slot) rows in expert order
          const Routed rt = route(r, T, k, E);
          order->resize(size_t(T * k));
          std::iota(order->begin(), order->end(), 0);
          std::stable_sort(order->begin(), order->end(),
                           [&](int a, int b) { return rt.expert[size_t(a)] < rt.expert[size_t(b)]; });
          return rt;
        };
        std::vector<int> order;
        const Routed rt = sorted_rows(me, &order);
        std::vector<int64_t> counts(static_cast<size_t>(E), 0), row_token;
        std::vector<float> rows;  // a token's row: its source, its token, two payload values
        for (int a : order) {
          ++counts[size_t(rt.expert[size_t(a)])];
          row_token.push_back(a / k);
          for (float v : {float(me), float(a / k), payload(me, a / k, 4), payload(me, a / k, 5)}) rows.push_back(v);
        }
        relay.reset_node_bytes(), direct.reset_node_bytes();
        const DispatchPlan pr = relay.plan(counts.data(), row_token.data());
        const DispatchPlan pd = direct.plan(counts.data());
        ASSERT_TRUE(pr.relay != nullptr);
        ASSERT_EQ(pr.recv_counts, pd.recv_counts);
        EXPECT_EQ(relay.relay_rows().plans, 1);
        const Tensor rows_d = tensor_from(*be, rows, {int64_t(rows.size())});
        Tensor got_r, got_d;
        relay.dispatch(pr, rows_d.f32(), 4, &got_r, true);
        direct.dispatch(pd, rows_d.f32(), 4, &got_d, true);  // (no relay in its plan: direct)
        const std::string at = "nodes of " + std::to_string(per_node) + ", E " + std::to_string(E) + ", T " +
                               std::to_string(T);
        EXPECT_EQ(to_host<float>(got_r), to_host<float>(got_d)) << at;

        // The bytes, from every rank's routing: across, one row per (token, other node among its
        // experts' ranks); in the node, the rows to this node's other ranks and those this rank
        // forwards to them for the sources it relays for.
        const ExpertOwnership own{E, P};
        int64_t across = 0, in_node = 0, forwarded = 0;
        for (int t = 0; t < T; ++t) {
          std::vector<int64_t> nodes_of_t;
          for (int sl = 0; sl < k; ++sl) {
            const int owner = own.owner(rt.expert[size_t(t * k + sl)]);
            if (node[size_t(owner)] == node[size_t(me)]) {
              in_node += owner != me;
            } else if (std::find(nodes_of_t.begin(), nodes_of_t.end(), node[size_t(owner)]) == nodes_of_t.end()) {
              nodes_of_t.push_back(node[size_t(owner)]);
            }
          }
          across += int64_t(nodes_of_t.size());
        }
        for (int s = 0; s < P; ++s) {
          if (node[size_t(s)] == node[size_t(me)] || relay.nodes().relay(s, node[size_t(me)]) != me) continue;
          const Routed o = route(s, T, k, E);
          for (int e : o.expert) {
            const int owner = own.owner(e);
            forwarded += node[size_t(owner)] == node[size_t(me)] && owner != me;
          }
        }
        const int64_t row = 4 * 4;
        EXPECT_EQ(relay.node_bytes().across, across * row) << at;
        EXPECT_EQ(relay.node_bytes().in_node, (in_node + forwarded) * row) << at;
        EXPECT_EQ(relay.relay_rows().across, across) << at;
        EXPECT_EQ(relay.relay_rows().relayed, forwarded) << at;
        EXPECT_LE(direct.node_bytes().across, int64_t(k) * T * row) << at;
        EXPECT_GE(direct.node_bytes().across, relay.node_bytes().across) << at;

        // BF16 rows, FP8 rows with 1 x 4 tiles' scales, per-tensor FP8 rows: the same bytes as direct.
        std::vector<uint16_t> rows16;
        for (float v : rows) rows16.push_back(bf16_encode(v));
        const Tensor rows16_d = tensor_from(*be, rows16, {int64_t(rows16.size())});
        Tensor r16, d16;
        relay.dispatch(pr, rows16_d.data<uint16_t>(), 4, &r16, true);
        direct.dispatch(pd, rows16_d.data<uint16_t>(), 4, &d16, true);
        EXPECT_EQ(to_host<uint16_t>(r16), to_host<uint16_t>(d16)) << "BF16, " << at;
        const int64_t R = int64_t(order.size());
        std::vector<uint8_t> qb;
        std::vector<float> qs;
        for (int a : order) {
          const int t = a / k;
          for (int v : {me, t, me * 7 + t, 255 - t, t * 3, me + 1, t % 5, 9}) qb.push_back(uint8_t(v));
          qs.push_back(float(me) + float(t) / 64), qs.push_back(float(t) + 0.5f);
        }
        for (Tiling tiling : {Tiling::rows_1xT, Tiling::per_tensor}) {
          QTensor q(*be, R, 8, Fp8Dtype::e4m3, tiling, 4);
          if (R > 0) to_device(*be, qb, q.data.data<uint8_t>());
          if (R > 0 && tiling == Tiling::rows_1xT) to_device(*be, qs, q.scale_inv.data<float>());
          if (tiling == Tiling::per_tensor) to_device(*be, std::vector<float>{0.5f}, q.scale_inv.data<float>());
          QTensor qr, qd;
          relay.dispatch(pr, q, &qr, true);
          direct.dispatch(pd, q, &qd, true);
          EXPECT_EQ(to_host<uint8_t>(qr.data), to_host<uint8_t>(qd.data)) << "FP8, " << at;
          EXPECT_EQ(to_host<float>(qr.scale_inv), to_host<float>(qd.scale_inv)) << "FP8 scales, " << at;
        }
        // Rows that differ per expert (not per token) go direct through the relay's plan, and so
        // does a combine that is not only summed: the same as the direct dispatcher's.
        Tensor g_r, g_d;
        relay.dispatch(pr, rows_d.f32(), 4, &g_r);
        EXPECT_EQ(to_host<float>(g_r), to_host<float>(got_d)) << at;
        Tensor back_r(*be, DType::f32, {int64_t(rows.size())});
        relay.combine(pr, got_r.f32(), 4, back_r.f32());
        EXPECT_EQ(to_host<float>(back_r), rows) << at;

        // A summed combine: each expert's row made its own (its expert's number added to the
        // payload), back through the relay; the token's sum over its rows is the direct
        // combine's, exactly (the values are sums of small multiples of 1/8 in FP32, and of
        // values BF16 holds exactly in BF16, so the order of the additions does not matter).
        std::vector<float> outs = to_host<float>(got_d);
        {
          int64_t o = 0;
          for (int l = 0; l < E / P; ++l)
            for (int64_t i = 0; i < pr.local_rows[size_t(l)]; ++i, o += 4) outs[size_t(o + 2)] += float(me * (E / P) + l);
        }
        const Tensor outs_d = tensor_from(*be, outs, {int64_t(outs.size())});
        auto token_sums = [&](const std::vector<float>& back) {  // (T, 4): the sum of each token's rows
          std::vector<float> y(static_cast<size_t>(T * 4), 0.0f);
          for (size_t i = 0; i < order.size(); ++i)
            for (int d = 0; d < 4; ++d) y[size_t(order[i] / k * 4 + d)] += back[i * 4 + d];
          return y;
        };
        relay.reset_node_bytes();
        Tensor sum_r(*be, DType::f32, {int64_t(rows.size())}), sum_d(*be, DType::f32, {int64_t(rows.size())});
        relay.combine(pr, outs_d.f32(), 4, sum_r.f32(), true);
        direct.combine(pd, outs_d.f32(), 4, sum_d.f32(), true);  // (no relay in its plan: direct)
        EXPECT_EQ(token_sums(to_host<float>(sum_r)), token_sums(to_host<float>(sum_d))) << "summed combine, " << at;
        // Bytes: this rank as a relay sends one sum per (source it relays for, token of that
        // source with an expert in this node); its experts' rows of other nodes' sources to their
        // relay in this node (unless itself) and of this node's sources straight back.
        int64_t sums = 0, to_relays = 0, straight = 0;
        for (int s = 0; s < P; ++s) {
          const Routed o = route(s, T, k, E);
          const bool remote = node[size_t(s)] != node[size_t(me)];
          const bool mine = remote && relay.nodes().relay(s, node[size_t(me)]) == me;
          for (int t = 0; t < T; ++t) {
            bool here = false;
            for (int sl = 0; sl < k; ++sl) {
              const int owner = own.owner(o.expert[size_t(t * k + sl)]);
              here = here || node[size_t(owner)] == node[size_t(me)];
              if (owner != me) continue;
              if (remote) to_relays += relay.nodes().relay(s, node[size_t(me)]) != me;
              else straight += s != me;
            }
            sums += mine && here;
          }
        }
        EXPECT_EQ(relay.node_bytes().across, sums * row) << "summed combine, " << at;
        EXPECT_EQ(relay.node_bytes().in_node, (to_relays + straight) * row) << "summed combine, " << at;
        std::vector<uint16_t> outs16;
        for (size_t i = 0; i < outs.size(); ++i) outs16.push_back(bf16_encode(float(int(outs[i]) % 16) + 0.5f * float(i % 4)));
        const Tensor outs16_d = tensor_from(*be, outs16, {int64_t(outs16.size())});
        Tensor s16r(*be, DType::bf16, {int64_t(rows.size())}), s16d(*be, DType::bf16, {int64_t(rows.size())});
        relay.combine(pr, outs16_d.data<uint16_t>(), 4, s16r.data<uint16_t>(), true);
        direct.combine(pd, outs16_d.data<uint16_t>(), 4, s16d.data<uint16_t>(), true);
        auto widened = [](const std::vector<uint16_t>& v) {
          std::vector<float> f;
          for (uint16_t b : v) f.push_back(bf16_decode(b));
          return f;
        };
        EXPECT_EQ(token_sums(widened(to_host<uint16_t>(s16r))), token_sums(widened(to_host<uint16_t>(s16d))))
            << "summed BF16 combine, " << at;
        ++cases;
      }
    }
  }
  if (P > 1) EXPECT_GT(cases, 0);
}

// Posted exchanges (ExchangeLater: the MoE layer's rows travelling behind its shared expert and
// its experts' weight gradients) give the in-line exchanges' rows and bytes, with several posted at
// once and finished together, directly and through the relay across nodes.
TEST_P(ExpertDispatchOn, PostedExchangesMatchTheInLineOnes) {
  const int P = world_.size(), me = world_.rank();
  Communicator& rows_comm = this->rows_comm();
  for (int per_node : {P, 1, 2}) {  // one node (direct), then nodes of 1 and 2 ranks (relayed)
    std::vector<int64_t> node(static_cast<size_t>(P));
    for (int j = 0; j < P; ++j) node[size_t(j)] = j / per_node;
    const int E = 2 * P, k = std::min(3, E), T = 11;
    ExpertDispatcher ep(*be_, rows_comm, world_, E);
    ep.set_nodes(node, true);
    const Routed rt = route(me, T, k, E);
    std::vector<int> order(size_t(T * k));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return rt.expert[size_t(a)] < rt.expert[size_t(b)]; });
    std::vector<int64_t> counts(static_cast<size_t>(E), 0), row_token;
    std::vector<float> rows;
    std::vector<uint16_t> rows16;
    std::vector<double> rows64;
    for (int a : order) {
      ++counts[size_t(rt.expert[size_t(a)])];
      row_token.push_back(a / k);
      for (int d = 0; d < 4; ++d) rows.push_back(payload(me, a / k, d)), rows16.push_back(bf16_encode(float(d + a % 7)));
      rows64.push_back(double(me) + 0.25 * a);
    }
    const DispatchPlan plan = ep.plan(counts.data(), ep.relays() ? row_token.data() : nullptr);
    ASSERT_EQ(plan.relay != nullptr, per_node < P);
    const int64_t R = int64_t(order.size()), in = plan.received;
    const Tensor x = tensor_from(*be_, rows, {R * 4}), x16 = tensor_from(*be_, rows16, {R * 4});
    QTensor q(*be_, R, 8, Fp8Dtype::e4m3, Tiling::rows_1xT, 4);
    std::vector<uint8_t> qb;
    std::vector<float> qs;
    for (int a : order)
      for (int d = 0; d < 8; ++d) qb.push_back(uint8_t(me * 31 + a / k * 5 + d)), qs.push_back(float(a / k) + 0.5f * float(d % 2));
    qs.resize(size_t(2 * R));
    if (R > 0) to_device(*be_, qb, q.data.data<uint8_t>()), to_device(*be_, qs, q.scale_inv.data<float>());
    // The experts' side: rows of their own (in_ rows) for the combines.
    std::vector<float> back(size_t(in * 4));
    std::vector<uint16_t> back16(size_t(in * 4));
    std::vector<double> back64(static_cast<size_t>(in));
    for (int64_t i = 0; i < in * 4; ++i) back[size_t(i)] = float(i % 13) * 0.25f, back16[size_t(i)] = bf16_encode(float(i % 5));
    for (int64_t i = 0; i < in; ++i) back64[size_t(i)] = 0.5 * double(i) + me;
    const Tensor y = tensor_from(*be_, back, {in * 4}), y16 = tensor_from(*be_, back16, {in * 4}),
                 y64 = tensor_from(*be_, back64, {in});

    struct Got {
      Tensor d32, d16, c32, c16, c64;
      QTensor dq;
    };
    auto run = [&](ExchangeLater* later) {
      Got g;
      g.c32 = Tensor(*be_, DType::f32, {R * 4}), g.c16 = Tensor(*be_, DType::bf16, {R * 4}), g.c64 = Tensor(*be_, DType::f64, {R});
      ep.reset_node_bytes();
      ep.dispatch(plan, x.f32(), 4, &g.d32, true, later);
      ep.dispatch(plan, x16.data<uint16_t>(), 4, &g.d16, true, later);
      ep.dispatch(plan, q, &g.dq, true, later);
      ep.combine(plan, y.f32(), 4, g.c32.f32(), true, later);
      ep.combine(plan, y16.data<uint16_t>(), 4, g.c16.data<uint16_t>(), true, later);
      ep.combine(plan, y64.data<double>(), 1, g.c64.data<double>(), later);
      if (later) {
        EXPECT_TRUE(later->pending() || P == 1 && !plan.relay);
        later->finish();
        EXPECT_FALSE(later->pending());
      }
      return g;
    };
    const Got a = run(nullptr);
    const ExpertDispatcher::NodeBytes inline_bytes = ep.node_bytes();
    ExchangeLater later;
    const Got b = run(&later);
    const std::string at = "nodes of " + std::to_string(per_node);
    EXPECT_EQ(to_host<float>(b.d32), to_host<float>(a.d32)) << at;
    EXPECT_EQ(to_host<uint16_t>(b.d16), to_host<uint16_t>(a.d16)) << at;
    EXPECT_EQ(to_host<uint8_t>(b.dq.data), to_host<uint8_t>(a.dq.data)) << at;
    EXPECT_EQ(to_host<float>(b.dq.scale_inv), to_host<float>(a.dq.scale_inv)) << at;
    EXPECT_EQ(to_host<float>(b.c32), to_host<float>(a.c32)) << at;
    EXPECT_EQ(to_host<uint16_t>(b.c16), to_host<uint16_t>(a.c16)) << at;
    EXPECT_EQ(to_host<double>(b.c64), to_host<double>(a.c64)) << at;
    EXPECT_EQ(ep.node_bytes().across, inline_bytes.across) << at;
    EXPECT_EQ(ep.node_bytes().in_node, inline_bytes.in_node) << at;
    // And the dispatched FP32 rows are the ones sent (the rows carry their token).
    std::vector<float> d = to_host<float>(b.d32);
    for (int64_t i = 0; i < in; ++i) ASSERT_EQ(std::fmod(d[size_t(i * 4 + 1)] - payload(0, 0, 1), 1.0f), 0.0f) << at;
  }
}

INSTANTIATE_TEST_SUITE_P(Backends, ExpertDispatchOn,
                         testing::Values(DispatchCase{DeviceKind::cpu, false}, DispatchCase{DeviceKind::emulated, true},
                                         DispatchCase{DeviceKind::emulated, false}),
                         [](const testing::TestParamInfo<DispatchCase>& i) {
                           return i.param.kind == DeviceKind::cpu ? std::string("cpu")
                                  : i.param.native                ? std::string("emulated_native")
                                                                  : std::string("emulated_staged");
                         });

TEST(ExpertDispatch, CollectivesCountTheirBytes) {
  MpiCommunicator world(MPI_COMM_WORLD);
  const int P = world.size();
  world.reset_bytes_sent();
  std::vector<float> v(100, 1.0f);
  world.allreduce_sum(v.data(), 100);
  EXPECT_EQ(world.bytes_sent(), P > 1 ? 2 * (P - 1) * 400 / P : 0);
  EXPECT_EQ(v[0], float(P));
  world.reset_bytes_sent();
  std::vector<float> all(static_cast<size_t>(100 * P));
  world.allgather(v.data(), 100, all.data());
  EXPECT_EQ(world.bytes_sent(), int64_t(P - 1) * 400);
  std::vector<float> part(100);
  world.reduce_scatter_sum(all.data(), part.data(), 100);
  EXPECT_EQ(part[0], float(P * P));
}

}  // namespace
}  // namespace fp8moe
