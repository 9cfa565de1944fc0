// The 1F1B schedule of every stage, for 1-6 stages and 1-12 micro-batches: each micro-batch
// forwarded and backwarded once, in order; never more than min(P - stage, M) in flight on a stage
// (GPipe, all forwards first, keeps M); and the whole pipeline, simulated with unit-time forwards
// and backwards and the dependencies between stages (a forward needs the previous stage's, a
// backward the next stage's), finishes without deadlock in 2 (M + P - 1) units: the bubble is
// exactly (P - 1) / (M + P - 1).
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
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

// DualPipeV (parallel/pipeline_schedule.h), checked through simulate_dualpipev: all P ranks, each
// running its ops in order, an op starting when the rank is free and its inputs are ready; times
// are integers, so every comparison is exact. Its results against closed forms: DualPipe's
// README's bubble, and as fp8moe runs it the values of an independent simulation
// (tests/parallel/dualpipev_sim.py, in Python from the schedule's eight parts).
double most(const std::vector<double>& v) { return *std::max_element(v.begin(), v.end()); }

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
            const DualPipeVSim s = simulate_dualpipev(P, M, double(f), double(b), double(w), double(fb), false);
            ASSERT_TRUE(s.complete) << "a rank deadlocked, or ran a weight op with nothing deferred";
            ASSERT_EQ(most(s.idle), double((P - 1) * (fb + b - 3 * w)));
            for (int r = 0; r < P; ++r) EXPECT_EQ(s.in_flight[size_t(r)], r == P - 1 ? 2 * P + 1 : 2 * P) << "rank " << r;
          }
        }
  // Against 1F1B with F = W = 1, B = 2, F&B = 3 (no overlap): 2 (P - 1) vs 6 (P - 1) per stage of two chunks.
  EXPECT_EQ(most(simulate_dualpipev(8, 20, 1, 2, 1, 3, false).idle), 14);
  // The table of README "Parallelism": chunk times F = W = 1, B = 2; F&B = 3 (no overlap) and 2
  // (fully overlapped); 1F1B on P stages of two chunks idles 2 (P - 1)(F + B).
  std::printf("  P   M   1F1B (P-1)(2F+2B)   DualPipeV F&B=3 (formula)   F&B=2 (formula)   as run (W=0)\n");
  for (int P : {2, 4, 8, 16}) {
    const int M = 2 * P + 4;
    const DualPipeVSim a = simulate_dualpipev(P, M, 1, 2, 1, 3, false), b = simulate_dualpipev(P, M, 1, 2, 1, 2, false),
                       run = simulate_dualpipev(P, M, 1, 2, 0, 0, true);
    std::printf("%3d %3d   %17d   %12.0f (%d)   %9.0f (%d)   %10.0f\n", P, M, 6 * (P - 1), most(a.idle), 2 * (P - 1),
                most(b.idle), P - 1, most(run.idle));
  }
}

// As fp8moe runs it (app/stage_runner.cpp: backwards whole, an F&B its backward then its
// forward, each when its input is there), the slowest rank idles 2B(P - 1) - F where B = 2F or
// 3F, 2B(P - 1) where B = F, whatever M >= 2P (the Python simulation's values), and a rank holds
// at most 2P chunk activations (2P + 1 on rank P - 1); the bubble's share is that idle over idle
// plus 2M(F + B).
TEST(PipelineSchedule, DualPipeVAsFp8moeRunsIt) {
  for (int P = 2; P <= 16; ++P)
    for (const int M : {2 * P, 2 * P + 3, 3 * P + 2}) {
      SCOPED_TRACE("P " + std::to_string(P) + " M " + std::to_string(M));
      for (const auto& [f, b, idle] : std::vector<std::array<int, 3>>{{1, 1, 2 * P - 2}, {1, 2, 4 * P - 5}, {1, 3, 6 * P - 7}}) {
        const DualPipeVSim s = simulate_dualpipev(P, M, f, b, 0, 0, true);
        ASSERT_TRUE(s.complete);
        EXPECT_EQ(most(s.idle), double(idle)) << "F " << f << " B " << b;
        for (int r = 0; r < P; ++r) EXPECT_EQ(s.in_flight[size_t(r)], r == P - 1 ? 2 * P + 1 : 2 * P) << "rank " << r;
        EXPECT_NEAR(dualpipev_bubble(P, M, f, b), double(idle) / double(idle + 2 * M * (f + b)), 1e-12);
      }
    }
}

}  // namespace
}  // namespace fp8moe
