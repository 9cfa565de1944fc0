// Exit statuses of fp8moe (documented in the README and in --help).
#pragma once

#include <cstdio>
#include <string>

#include "parallel/watchdog.h"

namespace fp8moe {
constexpr int kExitOk = 0;
constexpr int kExitFailure = 1;  // an internal error (fatal check, MPI_Abort)
constexpr int kExitUsage = 2;    // bad command line, config, file or world size: nothing was run
constexpr int kExitRequeue = 3;  // stopped by SIGUSR1 or SIGTERM after a committed checkpoint: requeue me
constexpr int kExitHung = kWatchdogExit;  // 4: a rank made no progress for runtime.timeout_s; the job was
                                          // aborted (parallel/watchdog.h); requeue to resume from the last checkpoint

// Prints "fp8moe: error: MESSAGE" on stderr; returns kExitUsage.
inline int usage_error(const std::string& message) {
  std::fprintf(stderr, "fp8moe: error: %s\n", message.c_str());
  std::fflush(stderr);
  return kExitUsage;
}
}  // namespace fp8moe
