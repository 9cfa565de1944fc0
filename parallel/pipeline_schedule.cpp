#include "parallel/pipeline_schedule.h"

#include <algorithm>

#include "kernels/check.h"

namespace fp8moe {

std::vector<PipelineOp> one_f_one_b(int stages, int stage, int micro_batches) {
  const int M = micro_batches, warmup = std::min(stages - stage - 1, M);
  std::vector<PipelineOp> ops;
  ops.reserve(size_t(2 * M));
  for (int i = 0; i < warmup; ++i) ops.push_back({true, i});
  for (int i = 0; i < M - warmup; ++i) ops.push_back({true, warmup + i}), ops.push_back({false, i});
  for (int i = M - warmup; i < M; ++i) ops.push_back({false, i});
  return ops;
}

// The eight parts of DualPipeV for rank r of P (each rank's counts differ so that the ranks meet):
//   1. 2 (P - r - 1) forwards of phase 0 (the ranks further from the V's turn start earlier);
//   2. r + 1 pairs: a forward of phase 0, one of phase 1;
//   3. P - r - 1 times: a phase-1 backward with its weights deferred, their weight op, a phase-1 forward;
//   4. M - 2P + r + 1 times: F&B (phase-0 forward, phase-1 backward) then F&B (phase 1, phase 0); the
//      first pair of rank P - 1 runs its forward and backward apart (nothing to overlap with yet);
//   5. P - r - 1 times: a phase-1 backward, then F&B (phase-1 forward, phase-0 backward);
//   6. r + 1 pairs: a phase-1 backward, a phase-0 backward, from the middle on with their weights
//      deferred (odd ranks from the pair's first backward, even ranks from its second);
//   7. P - r - 1 times: a deferred weight op, a phase-0 backward deferring its own;
//   8. r + 1 weight ops: the rest.
// Forwards and backwards of each phase take the micro-batches in order; weight ops the deferred
// backwards in order.
std::vector<DualOp> dualpipev(int ranks, int rank, int micro_batches) {
  const int P = ranks, r = rank, M = micro_batches;
  FP8MOE_ASSERT(P >= 1 && r >= 0 && r < P && M >= 2 * P, "DualPipeV: ", M, " micro-batches on ", P,
                " ranks (it needs at least 2 x ranks)");
  std::vector<DualOp> ops;
  int next_f[2] = {0, 0}, next_b[2] = {0, 0};
  auto forward = [&](int ph) { ops.push_back({DualOpKind::forward, ph, next_f[ph]++}); };
  auto backward = [&](int ph, bool defer) { ops.push_back({DualOpKind::backward, ph, next_b[ph]++, -1, defer}); };
  auto weight = [&] { ops.push_back({DualOpKind::weight}); };
  auto overlapped = [&](int fph) {
    const int bph = 1 - fph;
    ops.push_back({DualOpKind::forward_backward, fph, next_f[fph]++, next_b[bph]++});
  };
  for (int i = 0; i < 2 * (P - r - 1); ++i) forward(0);
  for (int i = 0; i < r + 1; ++i) forward(0), forward(1);
  for (int i = 0; i < P - r - 1; ++i) backward(1, true), weight(), forward(1);
  for (int i = 0; i < M - 2 * P + r + 1; ++i) {
    if (i == 0 && r == P - 1) forward(0), backward(1, false);
    else overlapped(0);
    overlapped(1);
  }
  for (int i = 0; i < P - r - 1; ++i) backward(1, false), overlapped(1);
  bool defer = false;
  for (int i = 0, half = (r + 1) / 2; i < r + 1; ++i) {
    if (i == half && r % 2 == 1) defer = true;
    backward(1, defer);
    if (i == half && r % 2 == 0) defer = true;
    backward(0, defer);
  }
  for (int i = 0; i < P - r - 1; ++i) weight(), backward(0, true);
  for (int i = 0; i < r + 1; ++i) weight();
  return ops;
}

double one_f_one_b_bubble(int stages, int micro_batches) {
  return double(stages - 1) / double(micro_batches + stages - 1);
}

double dualpipev_bubble(int ranks, int micro_batches, double f, double b, double w) {
  const double idle = (ranks - 1) * (f + 2 * b - 3 * w), busy = 2.0 * micro_batches * (f + b);
  return idle / (busy + idle);
}

}  // namespace fp8moe
