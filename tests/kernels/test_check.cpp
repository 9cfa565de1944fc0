// kernels/check.h: a failed check prints rank, host, file:line and the decoded error, then ends the
// process through the installed abort hook (MPI_Abort in a real run) or std::abort().
#include <gtest/gtest.h>
#include <unistd.h>

#include "kernels/check.h"

namespace fp8moe {
namespace {

std::string host() {
  char h[256] = {};
  gethostname(h, sizeof h - 1);
  return h;
}

TEST(CheckDeathTest, AssertPrintsFileLineAndValuesThenAborts) {
  const int three = 3;
  EXPECT_DEATH(FP8MOE_ASSERT(three == 4, "three is ", three),
               "fp8moe: fatal: on " + host() + ": .*test_check.cpp:[0-9]+: assertion `three == 4` failed: three is 3");
}

TEST(CheckDeathTest, RankAndAbortHookAreUsed) {
  EXPECT_EXIT(
      {
        set_fatal_context(5, [](int code) { _exit(40 + code); });
        FP8MOE_ASSERT(false, "boom");
      },
      testing::ExitedWithCode(41), "fp8moe: fatal: rank 5 on " + host() + ": .*assertion `false` failed: boom");
}

TEST(Check, PassingAssertDoesNothing) {
  int evaluated = 0;
  FP8MOE_ASSERT(++evaluated == 1, "never printed");
  EXPECT_EQ(evaluated, 1);  // the condition is evaluated exactly once
}

}  // namespace
}  // namespace fp8moe

#ifdef FP8MOE_HAVE_CUDA
// The library checks decode errors with the libraries' own tables, which need no GPU.
#include <cublasLt.h>
#include <cuda_runtime_api.h>
#include <nccl.h>

namespace fp8moe {
namespace {

TEST(CheckDeathTest, CudaErrorIsDecoded) {
  EXPECT_DEATH(CUDA_CHECK(cudaErrorMemoryAllocation),
               "cudaErrorMemoryAllocation: CUDA error cudaErrorMemoryAllocation: out of memory");
}

TEST(CheckDeathTest, CublasErrorIsDecoded) {
  EXPECT_DEATH(CUBLAS_CHECK(CUBLAS_STATUS_NOT_SUPPORTED), "cuBLAS error CUBLAS_STATUS_NOT_SUPPORTED");
}

TEST(CheckDeathTest, NcclErrorIsDecoded) {
  EXPECT_DEATH(NCCL_CHECK(ncclInvalidArgument), "NCCL error invalid argument");
}

}  // namespace
}  // namespace fp8moe
#endif
