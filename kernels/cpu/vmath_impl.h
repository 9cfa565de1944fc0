// The functions of kernels/cpu/vmath.h for one level, over that level's 16-element chunks.
// Included once by each vmath_<level>.cpp, after it defined, in namespace fp8moe::cpu::vm::{anon},
// its chunk types and their operations (F16: 16 floats, D16: 16 doubles, in its registers):
//   F16 load(const float* x);  void store(float* y, F16 v);         // 16 elements, unaligned
//   F16 sub(F16 v, float s);  F16 neg(F16 v);  F16 exp(F16 v);      // FP32, elementwise
//   D16 widen(F16 v);  D16 sub(D16 v, double s);  D16 exp(D16 v);   // double, elementwise
//   D16 add(D16 a, D16 b);  F16 narrow(D16 v, double scale);        // float(scale * v)
//   void spill(D16 v, double* out);                                 // the 16 lanes, in order
// and FP8MOE_VM_TABLE, the name of the Table to define (kernels/cpu/vmath_table.h).
//
// NOTE: everything here has internal linkage: the file is compiled with each level's flags, and
// an inline function with external linkage would be merged by the linker with another level's
// (AVX-512 code reached from the SSE2 level). Only the Table itself is external.
#ifndef FP8MOE_VM_TABLE
#error "vmath_impl.h is included by kernels/cpu/vmath_<level>.cpp only"
#endif

#include "kernels/cpu/vmath.h"
#include "kernels/cpu/vmath_table.h"

namespace fp8moe::cpu::vm {
namespace {

constexpr int64_t kChunk = 16;
static_assert(kChunk == kSumLanes, "the exponentials' chunks are the sums' lanes");

// The last, partial chunk (m < 16 elements) goes through a copy padded with zeros, whose results
// are dropped: the same chunk operations as the full ones.
F16 load_part(const float* x, int64_t m) {
  alignas(64) float t[kChunk] = {};
  for (int64_t l = 0; l < m; ++l) t[l] = x[l];
  return load(t);
}
void store_part(float* y, F16 v, int64_t m) {
  alignas(64) float t[kChunk];
  store(t, v);
  for (int64_t l = 0; l < m; ++l) y[l] = t[l];
}

// The lanes of a sum added pairwise: l + 8 into l, then + 4, + 2, + 1 (vmath.h's order); the
// lanes of a partial chunk beyond m were never added to.
double fold(D16 acc, const double* tail, int64_t m) {
  alignas(64) double a[kChunk];
  spill(acc, a);
  for (int64_t l = 0; l < m; ++l) a[l] += tail[l];
  for (int64_t w = kChunk / 2; w >= 1; w /= 2)
    for (int64_t l = 0; l < w; ++l) a[l] += a[l + w];
  return a[0];
}

D16 zero() { return widen(load_part(nullptr, 0)); }

void exp_sub_impl(const float* x, float shift, float* y, int64_t n) {
  int64_t i = 0;
  for (; i + kChunk <= n; i += kChunk) store(y + i, exp(sub(load(x + i), shift)));
  if (i < n) store_part(y + i, exp(sub(load_part(x + i, n - i), shift)), n - i);
}

double exp_sub_sum_impl(const float* x, float shift, float* y, int64_t n) {
  D16 acc = zero();
  int64_t i = 0;
  for (; i + kChunk <= n; i += kChunk) {
    const F16 e = exp(sub(load(x + i), shift));
    store(y + i, e);
    acc = add(acc, widen(e));
  }
  alignas(64) double tail[kChunk];
  const int64_t m = n - i;
  if (m > 0) {
    const F16 e = exp(sub(load_part(x + i, m), shift));
    store_part(y + i, e, m);
    spill(widen(e), tail);
  }
  return fold(acc, tail, m);
}

void exp_neg_impl(const float* x, float* y, int64_t n) {
  int64_t i = 0;
  for (; i + kChunk <= n; i += kChunk) store(y + i, exp(neg(load(x + i))));
  if (i < n) store_part(y + i, exp(neg(load_part(x + i, n - i))), n - i);
}

void exp_sub_f64_impl(const float* x, double shift, double* y, int64_t n) {
  int64_t i = 0;
  for (; i + kChunk <= n; i += kChunk) spill(exp(sub(widen(load(x + i)), shift)), y + i);
  if (i == n) return;
  alignas(64) double t[kChunk];
  spill(exp(sub(widen(load_part(x + i, n - i)), shift)), t);
  for (int64_t l = 0; l < n - i; ++l) y[i + l] = t[l];
}

double exp_sub_sum_f64_impl(const float* x, double shift, int64_t n) {
  D16 acc = zero();
  int64_t i = 0;
  for (; i + kChunk <= n; i += kChunk) acc = add(acc, exp(sub(widen(load(x + i)), shift)));
  alignas(64) double tail[kChunk];
  const int64_t m = n - i;
  if (m > 0) spill(exp(sub(widen(load_part(x + i, m)), shift)), tail);
  return fold(acc, tail, m);
}

void exp_sub_scale_f64_impl(const float* x, double shift, double scale, float* y, int64_t n) {
  int64_t i = 0;
  for (; i + kChunk <= n; i += kChunk) store(y + i, narrow(exp(sub(widen(load(x + i)), shift)), scale));
  if (i < n) store_part(y + i, narrow(exp(sub(widen(load_part(x + i, n - i)), shift)), scale), n - i);
}

}  // namespace

extern const Table FP8MOE_VM_TABLE;
const Table FP8MOE_VM_TABLE = {exp_sub_impl,     exp_sub_sum_impl,     exp_neg_impl,
                               exp_sub_f64_impl, exp_sub_sum_f64_impl, exp_sub_scale_f64_impl};

}  // namespace fp8moe::cpu::vm
