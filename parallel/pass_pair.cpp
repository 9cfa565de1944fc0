#include "parallel/pass_pair.h"

#include <omp.h>

#include <condition_variable>
#include <exception>
#include <mutex>
#include <thread>

namespace fp8moe {
namespace {

struct Baton {
  std::mutex mu;
  std::condition_variable cv;
  int turn = 0;                  // the pass that may run
  bool ended[2] = {false, false};
};

thread_local Baton* t_baton = nullptr;
thread_local int t_self = -1;

}  // namespace

bool PassPair::active() { return t_baton != nullptr; }

void PassPair::yield_point() {
  Baton* b = t_baton;
  if (!b) return;
  const int self = t_self, other = 1 - self;
  std::unique_lock<std::mutex> lock(b->mu);
  if (b->ended[other]) return;
  b->turn = other;
  b->cv.notify_all();
  b->cv.wait(lock, [&] { return b->turn == self; });
}

void PassPair::run(const std::function<void()>& first, const std::function<void()>& second,
                   const std::function<void()>& enter_thread) {
  Baton baton;
  std::exception_ptr error[2];
  auto pass = [&](int self, const std::function<void()>& body) {
    {
      std::unique_lock<std::mutex> lock(baton.mu);
      baton.cv.wait(lock, [&] { return baton.turn == self; });
    }
    t_baton = &baton, t_self = self;
    try {
      if (body) body();
    } catch (...) {
      error[self] = std::current_exception();
    }
    t_baton = nullptr, t_self = -1;
    std::lock_guard<std::mutex> lock(baton.mu);
    baton.ended[self] = true;
    baton.turn = 1 - self;
    baton.cv.notify_all();
  };
  // The rank's OpenMP threads (parallel/cpu_binding.h set them on this thread; a new thread starts
  // from OpenMP's defaults).
  const int threads = omp_get_max_threads();
  std::thread other([&] {
    omp_set_num_threads(threads);
    if (enter_thread) {
      try {
        enter_thread();
      } catch (...) {
        error[1] = std::current_exception();
      }
    }
    pass(1, error[1] ? std::function<void()>{} : second);
  });
  pass(0, first);
  other.join();
  for (const std::exception_ptr& e : error)
    if (e) std::rethrow_exception(e);
}

}  // namespace fp8moe
