// The 1F1B schedule of every stage, for 1-6 stages and 1-12 micro-batches: each micro-batch
// forwarded and backwarded once, in order; never more than min(P - stage, M) in flight on a stage
// (GPipe, all forwards first, keeps M); and the whole pipeline, simulated with unit-time forwards
// and backwards and the dependencies between stages (a forward needs the previous stage's, a
// backward the next stage's), finishes without deadlock in 2 (M + P - 1) units: the bubble is
// exactly (P - 1) / (M + P - 1).
#include <gtest/gtest.h>

#include <algorithm>
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
    }
}

}  // namespace
}  // namespace fp8moe
