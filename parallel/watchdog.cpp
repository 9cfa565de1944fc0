#include "parallel/watchdog.h"

#include <mpi.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <mutex>
#include <thread>
#include <vector>

#include "kernels/check.h"

namespace fp8moe {
namespace {

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// What the main thread is in. `since` 0: nothing.
struct Marks {
  std::atomic<const char*> what{nullptr}, group{nullptr}, phase{nullptr};
  std::atomic<int64_t> since{0}, step{0}, step_since{0};
};
Marks g_marks;

struct State {
  std::mutex mu;
  std::condition_variable cv;
  bool stop = false;
  std::thread thread;
  std::vector<std::function<void()>> hooks;
};
State& state() {
  static State s;
  return s;
}

[[noreturn]] void end_job(int rank, double limit, const char* which, double stuck_s) {
  const char* what = g_marks.what.load();
  const char* group = g_marks.group.load();
  const char* phase = g_marks.phase.load();
  const int64_t step = g_marks.step.load();
  char in[160] = "no collective";
  if (what) std::snprintf(in, sizeof in, "in %s%s%s", what, group ? " over " : "", group ? group : "");
  char at[96] = "between steps";
  if (step > 0) std::snprintf(at, sizeof at, "step %lld (%s)", (long long)step, phase ? phase : "?");
  std::fprintf(stderr,
               "fp8moe: error: rank %d: no progress for %.0f s (%s longer than runtime.timeout_s = %.0f s): %s, %s; "
               "a rank is stopped, dead or hung: ending the job (exit %d, requeue-able)\n",
               rank, stuck_s, which, limit, at, in, kWatchdogExit);
  std::fflush(stderr);
  std::vector<std::function<void()>> hooks;
  {
    std::lock_guard<std::mutex> lock(state().mu);
    hooks = state().hooks;
  }
  for (auto& h : hooks) h();
  MPI_Abort(MPI_COMM_WORLD, kWatchdogExit);
  std::_Exit(kWatchdogExit);  // NOTE: MPI_Abort does not return; should it, this rank still ends
}

}  // namespace

Watchdog::Watchdog(double timeout_s, int rank) {
  if (timeout_s <= 0) return;
  State& s = state();
  FP8MOE_ASSERT(!s.thread.joinable(), "one Watchdog per process");
  s.stop = false;
  running_ = true;
  const int64_t limit = int64_t(timeout_s * 1e9);
  s.thread = std::thread([&s, limit, timeout_s, rank] {
    std::unique_lock<std::mutex> lock(s.mu);
    while (!s.cv.wait_for(lock, std::chrono::milliseconds(500), [&s] { return s.stop; })) {
      const int64_t t = now_ns(), since = g_marks.since.load(), step_since = g_marks.step_since.load();
      if (since > 0 && t - since > limit) {
        lock.unlock();
        end_job(rank, timeout_s, "one call", double(t - since) * 1e-9);
      }
      if (g_marks.step.load() > 0 && step_since > 0 && t - step_since > limit) {
        lock.unlock();
        end_job(rank, timeout_s, "one step", double(t - step_since) * 1e-9);
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
    : what_(g_marks.what.load(std::memory_order_relaxed)),
      group_(g_marks.group.load(std::memory_order_relaxed)),
      since_(g_marks.since.load(std::memory_order_relaxed)) {
  g_marks.since.store(0, std::memory_order_relaxed);  // never a new name with an old time
  g_marks.what.store(what, std::memory_order_relaxed);
  g_marks.group.store(group, std::memory_order_relaxed);
  g_marks.since.store(now_ns(), std::memory_order_release);
}

WatchScope::~WatchScope() {
  g_marks.since.store(0, std::memory_order_relaxed);
  g_marks.what.store(what_, std::memory_order_relaxed);
  g_marks.group.store(group_, std::memory_order_relaxed);
  // The outer call goes on: its time counts from now, not from its start (a long sequence of
  // short inner calls is progress).
  g_marks.since.store(since_ > 0 ? now_ns() : 0, std::memory_order_release);
}

void watch_step(int64_t step, const char* phase) {
  if (step != g_marks.step.load(std::memory_order_relaxed)) {
    g_marks.step_since.store(step > 0 ? now_ns() : 0, std::memory_order_relaxed);
    g_marks.step.store(step, std::memory_order_relaxed);
  }
  g_marks.phase.store(phase, std::memory_order_release);
}

void watch_on_abort(std::function<void()> hook) {
  std::lock_guard<std::mutex> lock(state().mu);
  state().hooks.push_back(std::move(hook));
}

}  // namespace fp8moe
