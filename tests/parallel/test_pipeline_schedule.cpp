// The 1F1B schedule of every stage, for 1-6 stages and 1-12 micro-batches: each micro-batch
// forwarded and backwarded once, in order; never more than min(P - stage, M) in flight on a stage
// (GPipe, all forwards first, keeps M); and the whole pipeline, simulated with unit-time forwards
// and backwards and the dependencies between stages (a forward needs the previous stage's, a
// backward the next stage's), finishes without deadlock in 2 (M + P - 1) units: the bubble is
// exactly (P - 1) / (M + P - 1).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <vector>

#include "parallel/pipeline_schedule.h"

namespace fp8moe {
namespace {

TEST(PipelineSchedule, EveryStageRunsEachMicroBatchOnceInOrderWithBoundedMemory) {
  for (int P = 1; P <= 6; ++P)
    for (int M = 1; M <= 12; ++M)
      for (int s = 0; s < P; ++s) {
        SCOPED_TRACE("P " + std::to_string(P) + " M " + std::to_string(M) + " stage " + std::to_string(s));
        const std::vector<PipelineOp> ops = one_f_one_b(P, s, M);
        ASSERT_EQ(int(ops.size()), 2 * M);
        int next_f = 0, next_b = 0, in_flight = 0, most = 0;
        for (const PipelineOp& op : ops) {
          if (op.forward) {
            ASSERT_EQ(op.micro_batch, next_f++);
            most = std::max(most, ++in_flight);
          } else {
            ASSERT_EQ(op.micro_batch, next_b++);
            ASSERT_LT(op.micro_batch, next_f) << "a backward before its forward";
            --in_flight;
          }
        }
        EXPECT_EQ(most, std::min(P - s, M)) << "micro-batches in flight";
      }
}

TEST(PipelineSchedule, SimulatedPipelineHasTheOneFOneBBubble) {
  for (int P = 1; P <= 6; ++P)
    for (int M = 1; M <= 12; ++M) {
      SCOPED_TRACE("P " + std::to_string(P) + " M " + std::to_string(M));
      std::vector<std::vector<PipelineOp>> ops(static_cast<size_t>(P));
      for (int s = 0; s < P; ++s) ops[size_t(s)] = one_f_one_b(P, s, M);
      // done_f[s][m] / done_b[s][m]: the time unit at whose end that op finished (-1: not yet).
      std::vector<std::vector<int>> done_f(size_t(P), std::vector<int>(size_t(M), -1)), done_b = done_f;
      std::vector<size_t> next(size_t(P), 0);
      int t = 0, finished = 0;
      for (; finished < 2 * M * P; ++t) {
        ASSERT_LT(t, 4 * (M + P)) << "deadlock";
        for (int s = 0; s < P; ++s) {  // each stage runs its next op if its inputs finished before t
          if (next[size_t(s)] == ops[size_t(s)].size()) continue;
          const PipelineOp op = ops[size_t(s)][next[size_t(s)]];
          const int m = op.micro_batch;
          const bool ready = op.forward ? (s == 0 || (done_f[size_t(s - 1)][size_t(m)] >= 0 && done_f[size_t(s - 1)][size_t(m)] < t))
                                        : (s == P - 1 || (done_b[size_t(s + 1)][size_t(m)] >= 0 && done_b[size_t(s + 1)][size_t(m)] < t));
          if (!ready) continue;
          (op.forward ? done_f : done_b)[size_t(s)][size_t(m)] = t;
          ++next[size_t(s)], ++finished;
        }
      }
      EXPECT_EQ(t, 2 * (M + P - 1)) << "time units for 2 M units of work per stage";
      const double bubble = 1.0 - double(2 * M) / double(t);
      EXPECT_NEAR(bubble, double(P - 1) / double(M + P - 1), 1e-12);
      EXPECT_NEAR(one_f_one_b_bubble(P, M), bubble, 1e-12);
    }
}

}  // namespace
}  // namespace fp8moe

namespace fp8moe {
namespace {

// DualPipeV (parallel/pipeline_schedule.h), checked by simulating all P ranks with the schedule's
// dependencies: a phase-0 forward needs the previous rank's (rank 0: none), a phase-1 forward the
// next rank's (rank P - 1: its own phase-0 forward, the V's turn); a phase-1 backward the previous
// rank's (rank 0: its own phase-1 forward, the loss), a phase-0 backward the next rank's (rank
// P - 1: its own phase-1 backward). Each rank runs its ops in order, an op starting when the rank
// is free and its inputs are ready; times are integers, so every comparison is exact.
struct Times {
  int64_t f, b, w, fb;  // forward, whole backward, its weight part, overlapped forward + backward
};

struct Simulated {
  std::vector<int64_t> idle;  // per rank: the step's makespan less the rank's busy time
  std::vector<int> in_flight;  // per rank: the most chunk forwards not yet backwarded
};

Simulated simulate_dualpipev(int P, int M, const Times& t) {
  std::vector<std::vector<DualOp>> ops;
  for (int r = 0; r < P; ++r) ops.push_back(dualpipev(P, r, M));
  // done[kind][phase][rank][mb]: finish time, -1 until run (kind 0 forward, 1 backward).
  std::vector<int64_t> done(size_t(2 * 2 * P * M), -1);
  auto at = [&](int kind, int ph, int r, int mb) -> int64_t& { return done[size_t(((kind * 2 + ph) * P + r) * M + mb)]; };
  auto forward_ready = [&](int ph, int r, int mb) -> int64_t {
    if (ph == 0) return r == 0 ? 0 : at(0, 0, r - 1, mb);
    return r == P - 1 ? at(0, 0, r, mb) : at(0, 1, r + 1, mb);
  };
  auto backward_ready = [&](int ph, int r, int mb) -> int64_t {
    if (ph == 1) return r == 0 ? at(0, 1, r, mb) : at(1, 1, r - 1, mb);
    return r == P - 1 ? at(1, 1, r, mb) : at(1, 0, r + 1, mb);
  };
  Simulated s;
  s.idle.assign(size_t(P), 0), s.in_flight.assign(size_t(P), 0);
  std::vector<size_t> pos(size_t(P), 0);
  std::vector<int64_t> free(size_t(P), 0), busy(size_t(P), 0);
  std::vector<int> open(size_t(P), 0);
  std::vector<std::vector<int>> deferred(static_cast<size_t>(P));  // per rank: deferred backwards' ids, in order
  for (bool progress = true; progress;) {
    progress = false;
    for (int r = 0; r < P; ++r)
      while (pos[size_t(r)] < ops[size_t(r)].size()) {
        const DualOp& op = ops[size_t(r)][pos[size_t(r)]];
        int64_t ready = 0, dur = 0;
        if (op.kind == DualOpKind::forward) {
          ready = forward_ready(op.phase, r, op.micro_batch), dur = t.f;
        } else if (op.kind == DualOpKind::backward) {
          ready = backward_ready(op.phase, r, op.micro_batch), dur = op.defer_weight ? t.b - t.w : t.b;
        } else if (op.kind == DualOpKind::weight) {
          EXPECT_FALSE(deferred[size_t(r)].empty()) << "rank " << r << ": a weight op with no backward deferred";
          if (deferred[size_t(r)].empty()) return s;
          deferred[size_t(r)].erase(deferred[size_t(r)].begin());
          dur = t.w;
        } else {
          const int64_t a = forward_ready(op.phase, r, op.micro_batch), b = backward_ready(1 - op.phase, r, op.backward_micro_batch);
          ready = a < 0 || b < 0 ? -1 : std::max(a, b), dur = t.fb;
        }
        if (ready < 0) break;  // an input not ready yet: another rank first
        const int64_t finish = std::max(free[size_t(r)], ready) + dur;
        free[size_t(r)] = finish, busy[size_t(r)] += dur;
        if (op.kind == DualOpKind::forward) at(0, op.phase, r, op.micro_batch) = finish, ++open[size_t(r)];
        if (op.kind == DualOpKind::backward) {
          at(1, op.phase, r, op.micro_batch) = finish, --open[size_t(r)];
          if (op.defer_weight) deferred[size_t(r)].push_back(op.phase * M + op.micro_batch);
        }
        if (op.kind == DualOpKind::forward_backward) {
          at(0, op.phase, r, op.micro_batch) = finish, at(1, 1 - op.phase, r, op.backward_micro_batch) = finish;
        }
        s.in_flight[size_t(r)] = std::max(s.in_flight[size_t(r)], open[size_t(r)]);
        ++pos[size_t(r)], progress = true;
      }
  }
  for (int r = 0; r < P; ++r) {
    EXPECT_EQ(pos[size_t(r)], ops[size_t(r)].size()) << "rank " << r << " deadlocked";
    EXPECT_TRUE(deferred[size_t(r)].empty()) << "rank " << r << ": deferred weight gradients never run";
  }
  const int64_t makespan = *std::max_element(free.begin(), free.end());
  for (int r = 0; r < P; ++r) s.idle[size_t(r)] = makespan - busy[size_t(r)];
  return s;
}

TEST(PipelineSchedule, DualPipeVRunsEveryMicroBatchOfBothPhasesOnce) {
  for (int P = 1; P <= 8; ++P)
    for (int M = 2 * P; M <= 2 * P + 6; ++M)
      for (int r = 0; r < P; ++r) {
        SCOPED_TRACE("P " + std::to_string(P) + " M " + std::to_string(M) + " rank " + std::to_string(r));
        int next_f[2] = {0, 0}, next_b[2] = {0, 0}, deferred = 0;
        auto f = [&](int ph, int mb) { ASSERT_EQ(mb, next_f[ph]++) << "phase " << ph << " forward"; };
        auto b = [&](int ph, int mb) {
          ASSERT_EQ(mb, next_b[ph]++) << "phase " << ph << " backward";
          ASSERT_LT(mb, next_f[ph]) << "a backward before its forward";
        };
        for (const DualOp& op : dualpipev(P, r, M)) {
          if (op.kind == DualOpKind::forward) f(op.phase, op.micro_batch);
          if (op.kind == DualOpKind::backward) b(op.phase, op.micro_batch), deferred += op.defer_weight;
          if (op.kind == DualOpKind::forward_backward) f(op.phase, op.micro_batch), b(1 - op.phase, op.backward_micro_batch);
          if (op.kind == DualOpKind::weight) {
            ASSERT_GT(deferred--, 0) << "a weight op before its backward";
          }
        }
        EXPECT_EQ(next_f[0], M);
        EXPECT_EQ(next_f[1], M);
        EXPECT_EQ(next_b[0], M);
        EXPECT_EQ(next_b[1], M);
        EXPECT_EQ(deferred, 0);
      }
}

// The bubble of the slowest rank is (P - 1)(F&B + B - 3W) exactly, for every F&B from B (fully
// overlapped) to F + B (not at all), when F = B - W and W <= F; at most 2P chunk activations in
// flight (2P + 1 on rank P - 1). 1F1B on P stages of two chunks: 2 (P - 1)(F + B).
TEST(PipelineSchedule, DualPipeVSimulatedBubbleIsItsFormula) {
  for (int P = 1; P <= 16; ++P)
    for (const int M : {2 * P, 2 * P + 1, 2 * P + 5, 3 * P + 2})
      for (const int64_t w : {0, 1, 2})
        for (const int64_t f : {w, w + 1, w + 3}) {
          if (f == 0) continue;
          const int64_t b = f + w;
          for (const int64_t fb : {b, (f + 2 * b) / 2, f + b}) {
            SCOPED_TRACE("P " + std::to_string(P) + " M " + std::to_string(M) + " F " + std::to_string(f) + " B " +
                         std::to_string(b) + " W " + std::to_string(w) + " F&B " + std::to_string(fb));
            const Simulated s = simulate_dualpipev(P, M, {f, b, w, fb});
            const int64_t idle = *std::max_element(s.idle.begin(), s.idle.end());
            ASSERT_EQ(idle, (P - 1) * (fb + b - 3 * w));
            // The share of the step, not overlapped (every rank busy 2M(F + B)).
            if (fb == f + b)
              EXPECT_NEAR(dualpipev_bubble(P, M, double(f), double(b), double(w)),
                          double(idle) / double(idle + 2 * M * (f + b)), 1e-12);
            for (int r = 0; r < P; ++r) EXPECT_EQ(s.in_flight[size_t(r)], r == P - 1 ? 2 * P + 1 : 2 * P) << "rank " << r;
          }
        }
  // Against 1F1B with F = W = 1, B = 2, F&B = 3 (no overlap): 2 (P - 1) vs 6 (P - 1) per stage of two chunks.
  const Simulated s = simulate_dualpipev(8, 20, {1, 2, 1, 3});
  EXPECT_EQ(*std::max_element(s.idle.begin(), s.idle.end()), 14);
  // The table of README "Parallelism": chunk times F = W = 1, B = 2; F&B = 3 (no overlap) and 2
  // (fully overlapped); 1F1B on P stages of two chunks idles 2 (P - 1)(F + B).
  std::printf("  P   M   1F1B (P-1)(2F+2B)   DualPipeV F&B=3 (formula)   F&B=2 (formula)\n");
  for (int P : {2, 4, 8, 16}) {
    const int M = 2 * P + 4;
    const Simulated a = simulate_dualpipev(P, M, {1, 2, 1, 3}), b = simulate_dualpipev(P, M, {1, 2, 1, 2});
    std::printf("%3d %3d   %17d   %12lld (%lld)   %9lld (%lld)\n", P, M, 6 * (P - 1),
                (long long)*std::max_element(a.idle.begin(), a.idle.end()), (long long)(2 * (P - 1)),
                (long long)*std::max_element(b.idle.begin(), b.idle.end()), (long long)(P - 1));
  }
}

}  // namespace
}  // namespace fp8moe
