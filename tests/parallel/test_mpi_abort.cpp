// A failed MPI call on one rank ends the whole job with the decoded error, rank and host (see
// abort_probe.cpp), instead of leaving the other ranks blocked.
#include <gtest/gtest.h>

#include "tests/test_util.h"

namespace fp8moe::test {
namespace {

TEST(MpiCheck, FailureOnOneRankAbortsTheJob) {
  const RunResult r = run({mpiexec(), "-n", "2", "--oversubscribe", FP8MOE_ABORT_PROBE}, 120);
  ASSERT_FALSE(r.timed_out) << "the job hung instead of aborting:\n" << r.all();
  EXPECT_EQ(r.status, 1) << r.all();  // the documented status of an internal error
  EXPECT_NE(r.err.find("fp8moe: fatal: rank 1 on "), std::string::npos) << r.all();
  EXPECT_NE(r.err.find("abort_probe.cpp:"), std::string::npos) << r.all();
  EXPECT_NE(r.err.find("MPI_Send(&value, 1, MPI_INT, mpi.size() + 10, 0, MPI_COMM_WORLD): MPI error"), std::string::npos)
      << r.all();
  EXPECT_NE(r.err.find("MPI_ERR_RANK"), std::string::npos) << r.all();  // decoded by MPI_Error_string
}

// The watchdog (parallel/watchdog.h) with a 1 s limit: a step or a call that lasts 20 s ends the job
// with exit 4 and a report naming it; 3 s of short calls is progress and ends normally.
TEST(Watchdog, AStepLongerThanTheLimitEndsTheJobWithExitFour) {
  const RunResult r = run({mpiexec(), "-n", "1", FP8MOE_ABORT_PROBE, "watchdog-step"}, 60);
  ASSERT_FALSE(r.timed_out) << r.all();
  EXPECT_EQ(r.status, 4) << r.all();
  EXPECT_NE(r.err.find("rank 0: no progress for 1 s (one step longer than runtime.timeout_s = 1 s): step 7 (compute), "
                       "no collective"),
            std::string::npos)
      << r.all();
}

TEST(Watchdog, ACallLongerThanTheLimitEndsTheJobNamingTheCallAndGroup) {
  const RunResult r = run({mpiexec(), "-n", "1", FP8MOE_ABORT_PROBE, "watchdog-call"}, 60);
  ASSERT_FALSE(r.timed_out) << r.all();
  EXPECT_EQ(r.status, 4) << r.all();
  EXPECT_NE(r.err.find("(one call longer than runtime.timeout_s = 1 s): before the first step, in allreduce over dp;"),
            std::string::npos)
      << r.all();
}

TEST(Watchdog, ShortCallsInsideALongOneAreProgress) {
  const RunResult r = run({mpiexec(), "-n", "1", FP8MOE_ABORT_PROBE, "watchdog-progress"}, 60);
  ASSERT_FALSE(r.timed_out) << r.all();
  EXPECT_EQ(r.status, 0) << r.all();
  EXPECT_EQ(r.err.find("no progress"), std::string::npos) << r.all();
}

}  // namespace
}  // namespace fp8moe::test
