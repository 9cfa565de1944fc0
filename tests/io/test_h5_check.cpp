// H5_CHECK: a failed HDF5 call prints HDF5's error stack and the call, then ends the process.
#include <gtest/gtest.h>
#include <hdf5.h>

#include "kernels/check.h"

namespace fp8moe {
namespace {

TEST(CheckDeathTest, Hdf5FailureIsReported) {
  EXPECT_DEATH(H5_CHECK(H5Fopen("/nonexistent/x.h5", H5F_ACC_RDONLY, H5P_DEFAULT)),
               "H5Fopen\\(\"/nonexistent/x.h5\", H5F_ACC_RDONLY, H5P_DEFAULT\\): HDF5 call failed \\(returned -1");
}

TEST(Check, Hdf5SuccessReturnsTheValue) {
  unsigned major = 0, minor = 0, release = 0;
  EXPECT_EQ(H5_CHECK(H5get_libversion(&major, &minor, &release)), 0);
  EXPECT_EQ(major, 1u);
}

}  // namespace
}  // namespace fp8moe
