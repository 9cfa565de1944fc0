// Helpers for tests that run real executables (fp8moe, mpirun) and inspect what they print.
#pragma once

#include <string>
#include <vector>

namespace fp8moe::test {

struct RunResult {
  int status = -1;         // exit status; 128+N when killed by signal N
  bool timed_out = false;  // killed after the timeout
  std::string out, err;    // stdout, stderr
  std::string all() const { return out + err; }
};

// Runs argv[0] (PATH is searched) with stdout and stderr captured; kills it after timeout_s.
// Open MPI's run-as-root and oversubscription variables are set for the child unless already set.
RunResult run(const std::vector<std::string>& argv, double timeout_s = 120);

// Paths of the programs under test (compile definitions from tests/CMakeLists.txt).
inline std::string exe() { return FP8MOE_EXE; }
inline std::string mpiexec() { return FP8MOE_MPIEXEC; }
inline std::string source_dir() { return FP8MOE_SOURCE_DIR; }
inline std::string python() { return FP8MOE_PYTHON; }

// A fresh temporary directory (removed by the caller's TempDir).
struct TempDir {
  TempDir();
  ~TempDir();
  std::string path;
  std::string write(const std::string& name, const std::string& text) const;  // returns the file's path
};

// Number of (non-overlapping) occurrences of `needle` in `hay`.
size_t count(const std::string& hay, const std::string& needle);

}  // namespace fp8moe::test
