#include "parallel/pipeline_schedule.h"

#include <algorithm>

#include "kernels/check.h"

namespace fp8moe {

std::vector<PipelineOp> one_f_one_b(int stages, int stage, int micro_batches) {
  const int M = micro_batches, warmup = std::min(stages - stage - 1, M);
  std::vector<PipelineOp> ops;
  ops.reserve(size_t(2 * M));
  for (int i = 0; i < warmup; ++i) ops.push_back({PipeOpKind::forward, i});
  for (int i = 0; i < M - warmup; ++i)
    ops.push_back({PipeOpKind::forward, warmup + i}), ops.push_back({PipeOpKind::backward, i});
  for (int i = M - warmup; i < M; ++i) ops.push_back({PipeOpKind::backward, i});
  return ops;
}

std::vector<PipelineOp> one_f_one_b_paired(int stages, int stage, int micro_batches) {
  const int M = micro_batches, warmup = std::min(stages - stage, M);
  std::vector<PipelineOp> ops;
  for (int i = 0; i < warmup; ++i) ops.push_back({PipeOpKind::forward, i});
  for (int i = 0; i < M - warmup; ++i) ops.push_back({PipeOpKind::forward_backward, warmup + i, i});
  for (int i = M - warmup; i < M; ++i) ops.push_back({PipeOpKind::backward, i});
  return ops;
}

std::vector<PipelineOp> zb1p(int stages, int stage, int micro_batches, bool paired) {
  std::vector<PipelineOp> ops;
  ops.reserve(size_t(3 * micro_batches));
  int waiting = 0, next_w = 0;  // B's whose W has not run; the oldest of them
  for (const PipelineOp& op : paired ? one_f_one_b_paired(stages, stage, micro_batches)
                                     : one_f_one_b(stages, stage, micro_batches)) {
    ops.push_back(op);
    if (op.forward()) continue;
    for (++waiting; waiting > stage; --waiting) ops.push_back({PipeOpKind::weight, next_w++});
  }
  while (next_w < micro_batches) ops.push_back({PipeOpKind::weight, next_w++});
  return ops;
}

PipelineSim simulate_pipeline(const std::vector<std::vector<PipelineOp>>& orders, double f, double b, double w,
                              double fb) {
  return simulate_pipeline(orders, std::vector<OpTimes>(orders.size(), OpTimes{f, b, w, fb < 0 ? f + b : fb}));
}

PipelineSim simulate_pipeline(const std::vector<std::vector<PipelineOp>>& orders, const std::vector<OpTimes>& times) {
  const int P = int(orders.size());
  int M = 0;
  for (const auto& o : orders)
    for (const PipelineOp& op : o) M = std::max({M, op.micro_batch + 1, op.backward_micro_batch + 1});
  // done[kind][s][m]: when that op finished (< 0: not yet)
  std::vector<std::vector<std::vector<double>>> done(3, std::vector<std::vector<double>>(size_t(P), std::vector<double>(size_t(M), -1)));
  std::vector<size_t> next(size_t(P), 0);
  std::vector<double> free(size_t(P), 0), busy(size_t(P), 0);
  for (bool progress = true; progress;) {
    progress = false;
    for (int s = 0; s < P; ++s)
      while (next[size_t(s)] < orders[size_t(s)].size()) {
        const PipelineOp op = orders[size_t(s)][next[size_t(s)]];
        auto forward_ready = [&](size_t m) { return s == 0 ? 0.0 : done[0][size_t(s - 1)][m]; };
        auto backward_ready = [&](size_t m) { return s == P - 1 ? done[0][size_t(s)][m] : done[1][size_t(s + 1)][m]; };
        const size_t m = size_t(op.micro_batch);
        const OpTimes& ot = times[size_t(s)];
        double ready = 0, t = 0;
        switch (op.kind) {
          case PipeOpKind::forward: ready = forward_ready(m), t = ot.f; break;
          case PipeOpKind::backward: ready = backward_ready(m), t = ot.b; break;
          case PipeOpKind::weight: ready = done[1][size_t(s)][m], t = ot.w; break;
          case PipeOpKind::forward_backward: {
            const double a = forward_ready(m), b = backward_ready(size_t(op.backward_micro_batch));
            ready = a < 0 || b < 0 ? -1 : std::max(a, b), t = ot.fb;
            break;
          }
        }
        if (ready < 0) break;
        const double end = std::max(free[size_t(s)], ready) + t;
        if (op.kind == PipeOpKind::forward_backward)
          done[0][size_t(s)][m] = end, done[1][size_t(s)][size_t(op.backward_micro_batch)] = end;
        else
          done[size_t(op.kind)][size_t(s)][m] = end;
        free[size_t(s)] = end, busy[size_t(s)] += t;
        ++next[size_t(s)], progress = true;
      }
  }
  PipelineSim r;
  for (int s = 0; s < P; ++s) r.complete = r.complete && next[size_t(s)] == orders[size_t(s)].size();
  r.makespan = *std::max_element(free.begin(), free.end());
  for (int s = 0; s < P; ++s) r.idle.push_back(r.makespan - busy[size_t(s)]);
  return r;
}

double zb1p_idle(int stages, int micro_batches, double f, double b, double w) {
  std::vector<std::vector<PipelineOp>> orders;
  for (int s = 0; s < stages; ++s) orders.push_back(zb1p(stages, s, micro_batches));
  const PipelineSim sim = simulate_pipeline(orders, f, b, w);
  FP8MOE_ASSERT(sim.complete, "ZB1P on ", stages, " stages did not complete");
  return *std::max_element(sim.idle.begin(), sim.idle.end());
}

std::vector<double> pipeline_idle(int micro_batches, bool zb, bool paired, const std::vector<OpTimes>& t) {
  const int P = int(t.size());
  std::vector<std::vector<PipelineOp>> orders;
  for (int s = 0; s < P; ++s)
    orders.push_back(zb ? zb1p(P, s, micro_batches, paired)
                        : paired ? one_f_one_b_paired(P, s, micro_batches) : one_f_one_b(P, s, micro_batches));
  const PipelineSim sim = simulate_pipeline(orders, t);
  FP8MOE_ASSERT(sim.complete, "the pipeline on ", P, " stages did not complete");
  return sim.idle;
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

std::vector<DualOp> dualpipev_as_run(int ranks, int rank, int micro_batches, bool paired) {
  std::vector<DualOp> ops;
  for (const DualOp& op : dualpipev(ranks, rank, micro_batches)) {
    if (op.kind == DualOpKind::forward_backward && paired) {
      ops.push_back(op);
    } else if (op.kind == DualOpKind::forward_backward) {
      ops.push_back({DualOpKind::backward, 1 - op.phase, op.backward_micro_batch});
      ops.push_back({DualOpKind::forward, op.phase, op.micro_batch});
    } else if (op.kind != DualOpKind::weight) {
      ops.push_back({op.kind, op.phase, op.micro_batch});  // (a backward whole)
    }
  }
  return ops;
}

DualPipeVSim simulate_dualpipev(int ranks, int micro_batches, double f, double b, double w, double fb, bool as_run) {
  const int P = ranks, M = micro_batches;
  std::vector<std::vector<DualOp>> ops(static_cast<size_t>(P));
  for (int r = 0; r < P; ++r) ops[size_t(r)] = as_run ? dualpipev_as_run(P, r, M) : dualpipev(P, r, M);
  // done[kind][phase][rank][mb]: finish time, < 0 until run (kind 0 forward, 1 backward).
  std::vector<double> done(size_t(2 * 2 * P * M), -1);
  auto at = [&](int kind, int ph, int r, int mb) -> double& { return done[size_t(((kind * 2 + ph) * P + r) * M + mb)]; };
  auto forward_ready = [&](int ph, int r, int mb) {
    if (ph == 0) return r == 0 ? 0.0 : at(0, 0, r - 1, mb);
    return r == P - 1 ? at(0, 0, r, mb) : at(0, 1, r + 1, mb);
  };
  auto backward_ready = [&](int ph, int r, int mb) {
    if (ph == 1) return r == 0 ? at(0, 1, r, mb) : at(1, 1, r - 1, mb);
    return r == P - 1 ? at(1, 1, r, mb) : at(1, 0, r + 1, mb);
  };
  DualPipeVSim s;
  s.idle.assign(size_t(P), 0), s.in_flight.assign(size_t(P), 0);
  std::vector<size_t> pos(size_t(P), 0);
  std::vector<double> free(size_t(P), 0), busy(size_t(P), 0);
  std::vector<int> open(size_t(P), 0), deferred(size_t(P), 0);
  for (bool progress = true; progress;) {
    progress = false;
    for (int r = 0; r < P; ++r)
      while (pos[size_t(r)] < ops[size_t(r)].size()) {
        const DualOp& op = ops[size_t(r)][pos[size_t(r)]];
        double ready = 0, dur = 0;
        if (op.kind == DualOpKind::forward) {
          ready = forward_ready(op.phase, r, op.micro_batch), dur = f;
        } else if (op.kind == DualOpKind::backward) {
          ready = backward_ready(op.phase, r, op.micro_batch), dur = op.defer_weight ? b - w : b;
        } else if (op.kind == DualOpKind::weight) {
          if (deferred[size_t(r)] == 0) {  // a weight op with nothing deferred
            s.complete = false;
            return s;
          }
          --deferred[size_t(r)], dur = w;
        } else {
          const double a = forward_ready(op.phase, r, op.micro_batch),
                       c = backward_ready(1 - op.phase, r, op.backward_micro_batch);
          ready = a < 0 || c < 0 ? -1 : std::max(a, c), dur = fb;
        }
        if (ready < 0) break;  // an input not ready yet: another rank first
        const double finish = std::max(free[size_t(r)], ready) + dur;
        free[size_t(r)] = finish, busy[size_t(r)] += dur;
        if (op.kind == DualOpKind::forward) at(0, op.phase, r, op.micro_batch) = finish, ++open[size_t(r)];
        if (op.kind == DualOpKind::backward) {
          at(1, op.phase, r, op.micro_batch) = finish, --open[size_t(r)];
          if (op.defer_weight) ++deferred[size_t(r)];
        }
        if (op.kind == DualOpKind::forward_backward)
          at(0, op.phase, r, op.micro_batch) = finish, at(1, 1 - op.phase, r, op.backward_micro_batch) = finish;
        s.in_flight[size_t(r)] = std::max(s.in_flight[size_t(r)], open[size_t(r)]);
        ++pos[size_t(r)], progress = true;
      }
  }
  for (int r = 0; r < P; ++r)
    if (pos[size_t(r)] != ops[size_t(r)].size() || deferred[size_t(r)] != 0) s.complete = false;
  s.makespan = *std::max_element(free.begin(), free.end());
  for (int r = 0; r < P; ++r) s.idle[size_t(r)] = s.makespan - busy[size_t(r)];
  return s;
}

double dualpipev_idle(int ranks, int micro_batches, double f, double b, bool paired, double hidden) {
  const DualPipeVSim s = paired ? simulate_dualpipev(ranks, micro_batches, f, b, 0, f + b - hidden, false)
                                : simulate_dualpipev(ranks, micro_batches, f, b, 0, 0, true);
  FP8MOE_ASSERT(s.complete, "DualPipeV's simulation stopped");
  return *std::max_element(s.idle.begin(), s.idle.end());
}

double dualpipev_bubble(int ranks, int micro_batches, double f, double b, bool paired) {
  const double idle = dualpipev_idle(ranks, micro_batches, f, b, paired);
  return idle / (idle + 2.0 * micro_batches * (f + b));
}

}  // namespace fp8moe
