// The level of kernels/cpu/vmath.h this process uses, and the calls through its table.
#include "kernels/cpu/vmath.h"

#include <atomic>

#include "kernels/check.h"
#include "kernels/cpu/vmath_table.h"

namespace fp8moe::cpu::vm {

namespace {

const Table& table_of(Level level) {
  switch (level) {
#if defined(__x86_64__)
    case Level::avx512: return kAvx512Table;
    case Level::avx: return kAvxTable;
    case Level::sse2: return kSse2Table;
#endif
    default: return kScalarTable;
  }
}

Level widest() {
  Level best = Level::scalar;
  for (Level l : kLevels)
    if (supported(l)) best = l;
  return best;
}

// NOTE: one process-wide choice, as the load-time choice of target_clones: made at the first call
// (the widest level) and changed only by set_level, which the tests call between ops.
std::atomic<const Table*> g_table{nullptr};
std::atomic<Level> g_level{Level::scalar};

const Table& table() {
  const Table* t = g_table.load(std::memory_order_acquire);
  if (t) return *t;
  const Level l = widest();
  g_level.store(l, std::memory_order_relaxed);
  g_table.store(&table_of(l), std::memory_order_release);
  return table_of(l);
}

}  // namespace

const char* to_string(Level level) {
  switch (level) {
    case Level::avx512: return "avx512";
    case Level::avx: return "avx";
    case Level::sse2: return "sse2";
    default: return "scalar";
  }
}

bool supported(Level level) {
  switch (level) {
    case Level::scalar: return true;
#if defined(__x86_64__)
    case Level::sse2: return true;  // part of x86-64
    // NOTE: __builtin_cpu_supports also checks that the OS saves the wider registers (XCR0).
    case Level::avx: return __builtin_cpu_supports("avx");
    case Level::avx512: return __builtin_cpu_supports("avx512f");
#endif
    default: return false;
  }
}

Level level() {
  table();
  return g_level.load(std::memory_order_relaxed);
}

Level set_level(Level l) {
  FP8MOE_ASSERT(supported(l), "vector math level ", to_string(l), " is not supported by this CPU or build");
  const Level previous = level();
  g_level.store(l, std::memory_order_relaxed);
  g_table.store(&table_of(l), std::memory_order_release);
  return previous;
}

void exp_sub(const float* x, float shift, float* y, int64_t n) { table().exp_sub(x, shift, y, n); }
double exp_sub_sum(const float* x, float shift, float* y, int64_t n) { return table().exp_sub_sum(x, shift, y, n); }
void exp_neg(const float* x, float* y, int64_t n) { table().exp_neg(x, y, n); }
void exp_sub_f64(const float* x, double shift, double* y, int64_t n) { table().exp_sub_f64(x, shift, y, n); }
double exp_sub_sum_f64(const float* x, double shift, int64_t n) { return table().exp_sub_sum_f64(x, shift, n); }
void exp_sub_scale_f64(const float* x, double shift, double scale, float* y, int64_t n) {
  table().exp_sub_scale_f64(x, shift, scale, y, n);
}

}  // namespace fp8moe::cpu::vm
