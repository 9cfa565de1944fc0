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

}  // namespace
}  // namespace fp8moe::test
