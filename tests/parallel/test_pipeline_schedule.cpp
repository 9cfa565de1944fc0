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
          if (op.forward()) {
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
          const bool ready = op.forward() ? (s == 0 || (done_f[size_t(s - 1)][size_t(m)] >= 0 && done_f[size_t(s - 1)][size_t(m)] < t))
                                        : (s == P - 1 || (done_b[size_t(s + 1)][size_t(m)] >= 0 && done_b[size_t(s + 1)][size_t(m)] < t));
          if (!ready) continue;
          (op.forward() ? done_f : done_b)[size_t(s)][size_t(m)] = t;
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

namespace fp8moe {
namespace {

// ZB1P (parallel/pipeline_schedule.h): each micro-batch's forward, input part (B) and weight part
// (W) once each, in order, W after its B; 1F1B's bound on the micro-batches forwarded and not yet
// B'd, and at most `stage` waiting for their W.
TEST(PipelineSchedule, ZeroBubbleRunsEachPartOnceInOrderWithBoundedMemory) {
  for (int P = 1; P <= 8; ++P)
    for (int M = 1; M <= 16; ++M)
      for (int s = 0; s < P; ++s) {
        SCOPED_TRACE("P " + std::to_string(P) + " M " + std::to_string(M) + " stage " + std::to_string(s));
        const std::vector<PipelineOp> ops = zb1p(P, s, M);
        ASSERT_EQ(int(ops.size()), 3 * M);
        int next[3] = {0, 0, 0}, in_flight = 0, most = 0, waiting = 0, most_waiting = 0;
        for (const PipelineOp& op : ops) {
          ASSERT_EQ(op.micro_batch, next[int(op.kind)]++);
          if (op.kind == PipeOpKind::forward) {
            most = std::max(most, ++in_flight);
          } else if (op.kind == PipeOpKind::backward) {
            ASSERT_LT(op.micro_batch, next[0]) << "a B before its forward";
            --in_flight, most_waiting = std::max(most_waiting, ++waiting);
          } else {
            ASSERT_LT(op.micro_batch, next[1]) << "a W before its B";
            --waiting;
          }
        }
        EXPECT_EQ(most, std::min(P - s, M)) << "micro-batches forwarded, not yet B'd";
        // (a W waits from its B to the end of the B after `stage` more)
        EXPECT_EQ(most_waiting, std::min(s, M) + (s < M ? 1 : 0)) << "B'd micro-batches whose W has not run";
      }
}

// The whole pipeline simulated (simulate_pipeline) against the closed forms, exactly (integer
// times): ZB1P's bubble (P - 1)(F + B - 2W) of DualPipe's README, B the whole backward (here
// b + w), for M >= P, W <= F and W <= b; and 1F1B's (P - 1)(F + B) in the same simulator.
TEST(PipelineSchedule, SimulatedZeroBubbleHasTheZb1pBubble) {
  struct Times {
    double f, b, w;
  };
  for (int P = 2; P <= 16; ++P)
    for (const int M : {P, P + 1, 2 * P, 3 * P + 1})
      for (const Times t : {Times{2, 2, 2}, Times{2, 2, 1}, Times{2, 4, 2}, Times{4, 2, 2}, Times{2, 2, 0},
                            Times{3, 4, 2}, Times{5, 3, 3}}) {
        SCOPED_TRACE("P " + std::to_string(P) + " M " + std::to_string(M) + " f " + std::to_string(t.f) + " b " +
                     std::to_string(t.b) + " w " + std::to_string(t.w));
        std::vector<std::vector<PipelineOp>> zb, ofob;
        for (int s = 0; s < P; ++s) zb.push_back(zb1p(P, s, M)), ofob.push_back(one_f_one_b(P, s, M));
        const PipelineSim z = simulate_pipeline(zb, t.f, t.b, t.w);
        ASSERT_TRUE(z.complete);
        const double B = t.b + t.w;
        EXPECT_EQ(*std::max_element(z.idle.begin(), z.idle.end()), (P - 1) * (t.f + B - 2 * t.w));
        EXPECT_EQ(zb1p_idle(P, M, t.f, t.b, t.w), (P - 1) * (t.f + B - 2 * t.w));
        const PipelineSim o = simulate_pipeline(ofob, t.f, B, 0);
        ASSERT_TRUE(o.complete);
        EXPECT_EQ(*std::max_element(o.idle.begin(), o.idle.end()), (P - 1) * (t.f + B));
      }
  // The table of the closing note: P 16, M 120, F 1, B 2, W 1 (a weight part half the backward).
  const double z = zb1p_idle(16, 120, 1, 1, 1), o = 15 * 3.0;
  std::printf("P 16, M 120, F 1, B 2, W 1: bubble 1F1B %.0f (%.4f of the step), ZB1P %.0f (%.4f)\n", o,
              o / (o + 120 * 3), z, z / (z + 120 * 3));
}

}  // namespace
}  // namespace fp8moe

namespace fp8moe {
namespace {

// 1F1B in pairs (parallel.pair_micro_batches): each micro-batch forwarded and backwarded once, in
// order; one forward more before the first pair; at most min(P - s + 1, M) in flight; a pair's
// backward is of a micro-batch forwarded before the pair (never its own forward's); paired ZB1P
// the same with each W after its B. Simulated, every order completes.
TEST(PipelineSchedule, PairsRunEachMicroBatchOnceWithOneMoreInFlight) {
  for (int P = 1; P <= 8; ++P)
    for (int M = 1; M <= 16; ++M) {
      std::vector<std::vector<PipelineOp>> all, all_zb;
      for (int s = 0; s < P; ++s) {
        SCOPED_TRACE("P " + std::to_string(P) + " M " + std::to_string(M) + " stage " + std::to_string(s));
        const std::vector<PipelineOp> ops = one_f_one_b_paired(P, s, M);
        int next_f = 0, next_b = 0, in_flight = 0, most = 0, pairs = 0, warmup = 0;
        for (const PipelineOp& op : ops) {
          if (op.kind == PipeOpKind::forward) {
            ASSERT_EQ(pairs, 0) << "a lone forward after the first pair";
            ASSERT_EQ(op.micro_batch, next_f++);
            ++warmup;
            most = std::max(most, ++in_flight);
          } else if (op.kind == PipeOpKind::forward_backward) {
            ++pairs;
            ASSERT_EQ(op.micro_batch, next_f++);
            ASSERT_EQ(op.backward_micro_batch, next_b++);
            ASSERT_LT(op.backward_micro_batch, op.micro_batch);
            most = std::max(most, ++in_flight);  // (during the pair)
            --in_flight;
          } else {
            ASSERT_EQ(op.kind, PipeOpKind::backward);
            ASSERT_EQ(op.micro_batch, next_b++);
            ASSERT_LT(op.micro_batch, next_f);
            --in_flight;
          }
        }
        ASSERT_EQ(next_f, M);
        ASSERT_EQ(next_b, M);
        EXPECT_EQ(warmup, std::min(P - s, M));
        EXPECT_EQ(pairs, M - std::min(P - s, M));
        EXPECT_EQ(most, std::min(P - s + 1, M)) << "micro-batches in flight";
        all.push_back(ops), all_zb.push_back(zb1p(P, s, M, true));
        int b = 0, w = 0;
        for (const PipelineOp& op : all_zb.back()) {
          if (op.kind == PipeOpKind::backward || op.kind == PipeOpKind::forward_backward) ++b;
          if (op.kind != PipeOpKind::weight) continue;
          ASSERT_LT(op.micro_batch, b);
          ASSERT_EQ(op.micro_batch, w++);
        }
        ASSERT_EQ(w, M);
      }
      EXPECT_TRUE(simulate_pipeline(all, 1, 2, 0).complete) << "P " << P << " M " << M;
      EXPECT_TRUE(simulate_pipeline(all_zb, 1, 1, 1).complete) << "P " << P << " M " << M;
    }
}

// What pairs buy, simulated (integer times, exact; F 2, B 4, F&B 6 - h where the pair hides h).
// One stage: h off each of the M - 1 pairs. Across stages they cost instead: a pair waits for the
// next stage's pair (its backward's input), which waits for this stage's previous pair (its
// forward's input), so neighbouring stages take turns; with nothing hidden the step is longer
// than 1F1B's (why the config takes pairs on one stage only; DualPipeV's F&B pairs chunks that run
// in opposite directions instead).
TEST(PipelineSchedule, PairsAcrossStagesTakeTurns) {
  for (const int M : {1, 2, 5, 16})
    for (const double h : {0.0, 1.0, 2.0}) {
      const PipelineSim p = simulate_pipeline({one_f_one_b_paired(1, 0, M)}, 2, 4, 0, 6 - h);
      ASSERT_TRUE(p.complete);
      EXPECT_EQ(p.makespan, 6.0 * M - h * (M - 1)) << "M " << M << " h " << h;
    }
  for (int P = 2; P <= 16; ++P)
    for (const int M : {2 * P, 3 * P + 1}) {
      std::vector<std::vector<PipelineOp>> ofob, paired;
      for (int s = 0; s < P; ++s) ofob.push_back(one_f_one_b(P, s, M)), paired.push_back(one_f_one_b_paired(P, s, M));
      const PipelineSim o = simulate_pipeline(ofob, 2, 4, 0), p = simulate_pipeline(paired, 2, 4, 0, 6);
      ASSERT_TRUE(p.complete);
      EXPECT_GT(p.makespan, o.makespan) << "P " << P << " M " << M;
      if (P == 4 && M == 13) std::printf("P 4, M 13, F 2, B 4: 1F1B %.0f, in pairs (nothing hidden) %.0f\n", o.makespan, p.makespan);
    }
}

}  // namespace
}  // namespace fp8moe

namespace fp8moe {
namespace {

// DualPipeV as fp8moe runs it in pairs (parallel.pair_micro_batches): DualPipeV's F&B ops kept,
// each pairing a forward and a backward of the two phases; everything else as the unpaired run;
// one chunk more in flight at most (the pair's forward made before its backward frees).
TEST(PipelineSchedule, DualPipeVPairsKeepItsForwardBackwardOps) {
  for (int P = 1; P <= 8; ++P)
    for (const int M : {2 * P, 2 * P + 1, 3 * P, 5 * P}) {
      for (int r = 0; r < P; ++r) {
        SCOPED_TRACE("P " + std::to_string(P) + " M " + std::to_string(M) + " rank " + std::to_string(r));
        const std::vector<DualOp> paired = dualpipev_as_run(P, r, M, true), alone = dualpipev_as_run(P, r, M);
        std::vector<DualOp> split;  // the pairs taken apart as the unpaired run does: backward, then forward
        int fb = 0, open = 0, most = 0, open_alone = 0, most_alone = 0;
        for (const DualOp& op : paired) {
          ASSERT_NE(op.kind, DualOpKind::weight);
          if (op.kind == DualOpKind::forward_backward) {
            ++fb;
            split.push_back({DualOpKind::backward, 1 - op.phase, op.backward_micro_batch});
            split.push_back({DualOpKind::forward, op.phase, op.micro_batch});
            most = std::max(most, ++open), --open;
          } else {
            split.push_back({op.kind, op.phase, op.micro_batch});
            open += op.kind == DualOpKind::forward ? 1 : -1, most = std::max(most, open);
          }
        }
        for (const DualOp& op : alone) open_alone += op.kind == DualOpKind::forward ? 1 : -1, most_alone = std::max(most_alone, open_alone);
        EXPECT_EQ(split, alone);
        EXPECT_GT(fb, 0);
        EXPECT_LE(most, most_alone + 1);
      }
    }
}

}  // namespace
}  // namespace fp8moe
