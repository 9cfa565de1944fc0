// GoogleTest main for tests run under mpirun.
//
// - Every rank runs every test. Rank 0 prints the usual gtest output; every rank prints its own
//   failures tagged "[rank R]", so a failure on rank 5 is not lost.
// - At the end the failure flags are combined over all ranks: if any rank failed, EVERY rank
//   returns 1, so mpirun (and ctest) fail whichever rank it was.
// - MPI errors return codes (MPI_ERRORS_RETURN via MpiSession) and MPI_CHECK aborts the job.
#include <gtest/gtest.h>

#include <cstdio>
#include <string>

#include "parallel/mpi_session.h"

namespace {

class RankTaggedFailures : public testing::EmptyTestEventListener {
 public:
  explicit RankTaggedFailures(int rank) : rank_(rank) {}
  // NOTE: the test's name is kept here: OnTestPartResult runs under GoogleTest's own lock, so
  // asking UnitTest::current_test_info() there deadlocks (every failing MPI test hung).
  void OnTestStart(const testing::TestInfo& t) override { test_ = std::string(t.test_suite_name()) + "." + t.name(); }
  void OnTestPartResult(const testing::TestPartResult& r) override {
    if (!r.failed()) return;
    std::fprintf(stderr, "[rank %d] FAILED %s at %s:%d\n%s\n", rank_, test_.c_str(), r.file_name() ? r.file_name() : "?",
                 r.line_number(), r.message());
    std::fflush(stderr);
  }

 private:
  int rank_;
  std::string test_ = "?";
};

}  // namespace

int main(int argc, char** argv) {
  testing::InitGoogleTest(&argc, argv);
  fp8moe::MpiSession mpi(&argc, &argv);
  testing::TestEventListeners& listeners = testing::UnitTest::GetInstance()->listeners();
  if (mpi.rank() != 0) delete listeners.Release(listeners.default_result_printer());
  listeners.Append(new RankTaggedFailures(mpi.rank()));

  const int local_failed = RUN_ALL_TESTS() != 0 ? 1 : 0;
  int failed_ranks = 0;
  MPI_Allreduce(&local_failed, &failed_ranks, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  // Every test skipped on every rank (and none failed): exit 77, which ctest reports as Skipped
  // (SKIP_RETURN_CODE) — never from the text printed, so a failure is never read as a skip.
  const testing::UnitTest& unit = *testing::UnitTest::GetInstance();
  const int local_all_skipped = unit.total_test_count() > 0 && unit.skipped_test_count() == unit.total_test_count();
  int all_skipped = 0;
  MPI_Allreduce(&local_all_skipped, &all_skipped, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  if (mpi.rank() == 0) {
    if (failed_ranks > 0)
      std::fprintf(stderr, "MPI TEST FAILED: %d of %d ranks had failures (see [rank R] lines)\n", failed_ranks, mpi.size());
    else if (all_skipped)
      std::printf("MPI TEST SKIPPED on all %d ranks (the reasons are above)\n", mpi.size());
    else
      std::printf("MPI TEST PASSED on all %d ranks\n", mpi.size());
  }
  return failed_ranks > 0 ? 1 : all_skipped ? 77 : 0;
}
