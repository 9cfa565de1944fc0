#include "io/build_info.h"

#include <hdf5.h>

#include "kernels/check.h"

namespace fp8moe {

std::string io_build_info() {
  unsigned major = 0, minor = 0, release = 0;
  H5_CHECK(H5get_libversion(&major, &minor, &release));
#ifdef H5_HAVE_PARALLEL
  const char* kind = "parallel (MPI-IO)";
#else
  const char* kind = "serial";
#endif
  return "  HDF5:       " + std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(release) +
         " " + kind + "\n  yaml-cpp:   " FP8MOE_YAML_CPP_VERSION "\n";
}

}  // namespace fp8moe
