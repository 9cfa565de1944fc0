// A per-process watchdog for hung jobs (runtime.timeout_s; docs/ARCHITECTURE.md "Failures"). The
// main thread marks what it is in: a training step and its phase (watch_step), and the innermost
// collective or checkpoint I/O call (WatchScope). A thread looks twice a second; when the
// innermost mark, or the step, has lasted longer than the limit, it prints one line naming the
// rank, the step, the phase and the call, runs the abort hooks (NCCL communicators register
// ncclCommAbort there), and ends the whole job with MPI_Abort(kExitHung).
//
// A rank that is stopped or dead is found by its peers: they wait in a collective it never joins.
// Without a running Watchdog the marks cost a few relaxed atomic stores.
#pragma once

#include <cstdint>
#include <functional>

namespace fp8moe {

// The exit status of a job the watchdog ended (app/exit_codes.h: kExitHung). Requeue-able.
constexpr int kWatchdogExit = 4;

class Watchdog {
 public:
  // Starts the thread (timeout_s > 0; 0: no watchdog). One per process at a time.
  Watchdog(double timeout_s, int rank);
  ~Watchdog();
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

 private:
  bool running_ = false;
};

// From construction to destruction the main thread is in `what` (a static string: "allreduce",
// "checkpoint save") over `group` ("dp", "world", or nullptr). Nested scopes restore the outer one.
class WatchScope {
 public:
  explicit WatchScope(const char* what, const char* group = nullptr);
  ~WatchScope();
  WatchScope(const WatchScope&) = delete;
  WatchScope& operator=(const WatchScope&) = delete;

 private:
  const char *what_, *group_;
  int64_t since_;
};

// In training step `step` (1-based), doing `phase` (a static string); step 0: between steps (the
// step limit does not apply, e.g. during a checkpoint save whose calls are watched one by one).
void watch_step(int64_t step, const char* phase);

// Runs on the watchdog's thread just before MPI_Abort. Not removable: register objects that live
// until the end of the job, or make the hook check their lifetime.
void watch_on_abort(std::function<void()> hook);

}  // namespace fp8moe
