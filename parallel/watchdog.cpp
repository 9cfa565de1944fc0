#include "parallel/watchdog.h"

#include <mpi.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "kernels/check.h"
#include "parallel/trace.h"

namespace fp8moe {
namespace {

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// What a thread is in. `since` 0: nothing. Lane 0 is the main thread (calls and steps), lane 1 a
// background thread's (WatchLane: the checkpoint writer; calls only).
struct Marks {
  std::atomic<const char*> what{nullptr}, group{nullptr}, phase{nullptr};
  std::atomic<int64_t> since{0}, step{0}, step_since{0};
};
constexpr int kLanes = 2;
Marks g_lanes[kLanes];
Marks& g_marks = g_lanes[0];
std::atomic<const char*> g_lane_name{nullptr};  // lane 1's thread, for the report
thread_local int t_lane = 0;

struct State {
  std::mutex mu;
  std::condition_variable cv;
  bool stop = false;
  std::thread thread;
  std::vector<std::function<void()>> hooks;
  // Each lane's guard (WatchScope with a limit of its own): its limit (0: none) and verdict.
  int64_t guard_limit[kLanes] = {0, 0};
  std::function<WatchVerdict()> guard_verdict[kLanes];
};
State& state() {
  static State s;
  return s;
}

void run_abort_hooks() {
  std::vector<std::function<void()>> hooks;
  {
    std::lock_guard<std::mutex> lock(state().mu);
    hooks = state().hooks;
  }
  for (auto& h : hooks) h();
}

// Seconds as a report reads them: whole seconds from 1 s, two significant digits below (a limit
// of 0.5 s is not "0 s").
std::string seconds_text(double s) {
  char b[32];
  std::snprintf(b, sizeof b, s >= 1 ? "%.0f" : "%.2g", s);
  return b;
}

[[noreturn]] void end_job(int rank, double limit, const char* which, double stuck_s, int lane) {
  const Marks& m = g_lanes[lane];
  const char* what = m.what.load();
  const char* group = m.group.load();
  const char* phase = g_marks.phase.load();
  const int64_t step = g_marks.step.load();
  char in[200] = "no collective";
  if (what)
    std::snprintf(in, sizeof in, "in %s%s%s%s%s", what, group ? " over " : "", group ? group : "",
                  lane > 0 ? " on the thread of the " : "", lane > 0 && g_lane_name.load() ? g_lane_name.load() : "");
  char at[128] = "before the first step";
  if (step > 0)
    std::snprintf(at, sizeof at, "%sstep %lld (%s)", g_marks.step_since.load() > 0 ? "" : "after ", (long long)step,
                  phase ? phase : "?");
  std::fprintf(stderr,
               "fp8moe: error: rank %d: no progress for %s s (%s longer than runtime.timeout_s = %s s): %s, %s; "
               "a rank is stopped, dead or hung: ending the job (exit %d, requeue-able)\n",
               rank, seconds_text(stuck_s).c_str(), which, seconds_text(limit).c_str(), at, in, kWatchdogExit);
  std::fflush(stderr);
  run_abort_hooks();
  // NOTE: MPI_Abort from this thread is outside what MPI_THREAD_FUNNELED promises; Open MPI 4.1
  // ends the job from here (tests/app/watchdog.sh, test_mpi_abort). Should an MPI return, _Exit
  // still ends this rank, and the launcher the job.
  MPI_Abort(MPI_COMM_WORLD, kWatchdogExit);
  std::_Exit(kWatchdogExit);
}

}  // namespace

Watchdog::Watchdog(double timeout_s, int rank) {
  State& s = state();
  FP8MOE_ASSERT(!s.thread.joinable(), "one Watchdog per process");
  s.stop = false;
  running_ = true;
  const int64_t limit = int64_t(timeout_s * 1e9);
  s.thread = std::thread([&s, limit, timeout_s, rank] {
    std::unique_lock<std::mutex> lock(s.mu);
    while (!s.cv.wait_for(lock, std::chrono::milliseconds(250), [&s] { return s.stop; })) {
      const int64_t t = now_ns(), step_since = g_marks.step_since.load();
      for (int lane = 0; lane < kLanes; ++lane) {
        const int64_t since = g_lanes[lane].since.load();
        if (s.guard_limit[lane] > 0 && since > 0 && t - since > s.guard_limit[lane]) {
          const auto verdict_of = s.guard_verdict[lane];
          lock.unlock();
          const WatchVerdict v = verdict_of();
          abort_job("rank " + std::to_string(rank) + ": " + v.message, v.exit_code);
        }
        if (limit > 0 && since > 0 && t - since > limit) {
          lock.unlock();
          end_job(rank, timeout_s, "one call", double(t - since) * 1e-9, lane);
        }
      }
      if (limit > 0 && step_since > 0 && t - step_since > limit) {
        lock.unlock();
        end_job(rank, timeout_s, "one step", double(t - step_since) * 1e-9, 0);
      }
    }
  });
}

Watchdog::~Watchdog() {
  if (!running_) return;
  State& s = state();
  {
    std::lock_guard<std::mutex> lock(s.mu);
    s.stop = true;
  }
  s.cv.notify_all();
  s.thread.join();
}

WatchScope::WatchScope(const char* what, const char* group)
    : lane_(t_lane),
      what_(g_lanes[lane_].what.load(std::memory_order_relaxed)),
      group_(g_lanes[lane_].group.load(std::memory_order_relaxed)),
      since_(g_lanes[lane_].since.load(std::memory_order_relaxed)) {
  Marks& m = g_lanes[lane_];
  m.since.store(0, std::memory_order_relaxed);  // never a new name with an old time
  m.what.store(what, std::memory_order_relaxed);
  m.group.store(group, std::memory_order_relaxed);
  m.since.store(now_ns(), std::memory_order_release);
  if (group && lane_ == 0) comm_ = what, trace::comm_enter();  // the timeline is the main thread's
}

WatchScope::WatchScope(const char* what, double limit_s, std::function<WatchVerdict()> verdict) : WatchScope(what) {
  std::lock_guard<std::mutex> lock(state().mu);
  state().guard_limit[lane_] = int64_t(limit_s * 1e9), state().guard_verdict[lane_] = std::move(verdict);
  guard_ = true;
}

WatchScope::~WatchScope() {
  Marks& m = g_lanes[lane_];
  if (comm_) trace::comm_leave(comm_, m.group.load(std::memory_order_relaxed));
  if (guard_) {  // one guard a lane at a time; its limit applies to the innermost call inside it
    std::lock_guard<std::mutex> lock(state().mu);
    state().guard_limit[lane_] = 0;
  }
  m.since.store(0, std::memory_order_relaxed);
  m.what.store(what_, std::memory_order_relaxed);
  m.group.store(group_, std::memory_order_relaxed);
  // The outer call goes on: its time counts from now, not from its start (a long sequence of
  // short inner calls is progress).
  m.since.store(since_ > 0 ? now_ns() : 0, std::memory_order_release);
}

WatchLane::WatchLane(const char* name) {
  FP8MOE_ASSERT(t_lane == 0 && g_lane_name.load() == nullptr, "one background watch lane at a time");
  g_lane_name.store(name);
  t_lane = 1;
}

WatchLane::~WatchLane() {
  Marks& m = g_lanes[1];
  m.since.store(0, std::memory_order_relaxed);
  m.what.store(nullptr, std::memory_order_relaxed);
  m.group.store(nullptr, std::memory_order_relaxed);
  t_lane = 0;
  g_lane_name.store(nullptr);
}

void watch_step(int64_t step, const char* phase) {
  if (step != g_marks.step.load(std::memory_order_relaxed) || g_marks.step_since.load(std::memory_order_relaxed) == 0) {
    g_marks.step_since.store(0, std::memory_order_relaxed);
    g_marks.step.store(step, std::memory_order_relaxed);
    g_marks.step_since.store(now_ns(), std::memory_order_relaxed);
  }
  g_marks.phase.store(phase, std::memory_order_release);
}

void watch_step_done(const char* phase) {
  g_marks.step_since.store(0, std::memory_order_relaxed);
  g_marks.phase.store(phase, std::memory_order_release);
}

void abort_job(const std::string& message, int exit_code) {
  std::fprintf(stderr, "fp8moe: error: %s\n", message.c_str());
  std::fflush(stderr);
  run_abort_hooks();
  MPI_Abort(MPI_COMM_WORLD, exit_code);
  std::_Exit(exit_code);
}

namespace {
std::atomic<void (*)()> g_wait_fault{nullptr};
}  // namespace

void set_wait_fault_point(void (*point)()) { g_wait_fault.store(point); }

void wait_fault_point() {
  if (void (*point)() = g_wait_fault.load(std::memory_order_relaxed)) point();
}

void watch_on_abort(std::function<void()> hook) {
  std::lock_guard<std::mutex> lock(state().mu);
  state().hooks.push_back(std::move(hook));
}

}  // namespace fp8moe
