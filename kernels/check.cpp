#include "kernels/check.h"

#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>

namespace fp8moe {
namespace {
std::atomic<int> g_rank{-1};              // NOTE: process-wide by nature, like std::set_terminate
std::atomic<AbortHook> g_abort{nullptr};  // set once MPI is up; nullptr -> std::abort()
}  // namespace

void set_fatal_context(int rank, AbortHook hook) {
  g_rank.store(rank);
  g_abort.store(hook);
}

void fatal_error(const char* file, int line, const std::string& what) {
  char host[256] = "?";
  gethostname(host, sizeof(host) - 1);
  const int rank = g_rank.load();
  // One fprintf so that lines from different ranks do not interleave mid-line.
  if (rank >= 0)
    std::fprintf(stderr, "fp8moe: fatal: rank %d on %s: %s:%d: %s\n", rank, host, file, line, what.c_str());
  else
    std::fprintf(stderr, "fp8moe: fatal: on %s: %s:%d: %s\n", host, file, line, what.c_str());
  std::fflush(stderr);
  if (AbortHook hook = g_abort.load()) hook(1);
  std::_Exit(1);  // before MPI is up (or after it is down): exit status 1, as documented
}
}  // namespace fp8moe
