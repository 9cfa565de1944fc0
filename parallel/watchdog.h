// A per-process watchdog for hung jobs (runtime.timeout_s; docs/ARCHITECTURE.md "Failures"). The
// main thread marks what it is in: a training step and its phase (watch_step), and the innermost
// collective or checkpoint I/O call (WatchScope); one background thread (WatchLane: the
// asynchronous checkpoint writer) marks its calls in a lane of its own. A thread looks twice a second; when the
// innermost mark, or the step, has lasted longer than the limit, it prints one line naming the
// rank, the step, the phase and the call, runs the abort hooks (NCCL communicators register
// ncclCommAbort there), and ends the whole job with MPI_Abort(kExitHung).
//
// A rank that is stopped or dead is found by its peers: they wait in a collective it never joins.
// Without a running Watchdog the marks cost a few relaxed atomic stores.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

namespace fp8moe {

// The exit status of a job the watchdog ended (app/exit_codes.h: kExitHung). Requeue-able.
constexpr int kWatchdogExit = 4;

class Watchdog {
 public:
  // Starts the thread; one per process at a time. timeout_s 0: no limit on calls and steps (the
  // guards below still hold).
  Watchdog(double timeout_s, int rank);
  ~Watchdog();
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

 private:
  bool running_ = false;
};

// From construction to destruction the main thread is in `what` (a static string: "allreduce",
// "checkpoint save") over `group` ("dp", "world", or nullptr). Nested scopes restore the outer one.
// A scope with a group is communication: its time counts in parallel/trace.h's exposed clock and
// timeline.
// A guard has a limit of its own, and past it the watchdog asks `verdict` (on its own thread) for
// the status and the message to end the job with, instead of its report: for calls that may never
// return after a failure (closing an HDF5 file whose writes failed on some ranks, or on a file
// system that just filled), so that the job ends with the failure's message and status rather
// than waiting. Needs a running Watchdog; without one it only marks.
struct WatchVerdict {
  int exit_code = kWatchdogExit;
  std::string message;
};
class WatchScope {
 public:
  explicit WatchScope(const char* what, const char* group = nullptr);
  WatchScope(const char* what, double limit_s, std::function<WatchVerdict()> verdict);
  ~WatchScope();
  WatchScope(const WatchScope&) = delete;
  WatchScope& operator=(const WatchScope&) = delete;

 private:
  int lane_;
  const char *what_, *group_;
  const char* comm_ = nullptr;  // this call's name when it is communication (a group): the exposed clock
  int64_t since_;
  bool guard_ = false;
};

// For its lifetime, this thread's WatchScopes (and guards) are the background lane's: watched with
// the same limit as the main thread's calls, reported "on the thread of the <name>", apart from the
// main thread's marks and outside the timeline. One at a time, on a thread other than the main one.
class WatchLane {
 public:
  explicit WatchLane(const char* name);
  ~WatchLane();
  WatchLane(const WatchLane&) = delete;
  WatchLane& operator=(const WatchLane&) = delete;
};

// Prints "fp8moe: error: MESSAGE" on stderr and ends the whole job with exit_code (MPI_Abort; the
// watchdog's abort hooks run first). For a failure after which this rank cannot take part in the
// collectives the others are in.
[[noreturn]] void abort_job(const std::string& message, int exit_code);

// In training step `step` (1-based), doing `phase` (a static string): the step limit applies from
// the first mark of a step. watch_step_done: the step is over and `phase` follows it (a checkpoint
// save, whose calls are watched one by one): no step limit, the report says "after step N".
void watch_step(int64_t step, const char* phase);
void watch_step_done(const char* phase);

// The tests' fault point in an overlapped collective's wait, just before it blocks
// (MpiCommunicator::wait, inside its watch scope): `fp8moe-faults` installs one (FP8MOE_WAIT_STOP,
// io/checkpoint_faults.h) to freeze a rank there; the product installs none and it does nothing.
void set_wait_fault_point(void (*point)());
void wait_fault_point();

// Runs on the watchdog's thread just before MPI_Abort. Not removable: register objects that live
// until the end of the job, or make the hook check their lifetime.
void watch_on_abort(std::function<void()> hook);

}  // namespace fp8moe
