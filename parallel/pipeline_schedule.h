// The order in which one pipeline stage runs the forwards and backwards of a step's micro-batches.
#pragma once

#include <vector>

namespace fp8moe {

// backward: a whole backward, or (with weight ops in the order) its input part alone; weight: the
// weight part of that micro-batch's backward (the zero-bubble split); forward_backward: the
// forward of micro_batch and the backward of backward_micro_batch as one op, interleaved at their
// expert exchanges (parallel/pass_pair.h).
enum class PipeOpKind { forward, backward, weight, forward_backward };
struct PipelineOp {
  PipeOpKind kind;
  int micro_batch;
  int backward_micro_batch = -1;  // forward_backward only
  bool forward() const { return kind == PipeOpKind::forward; }
  bool operator==(const PipelineOp&) const = default;
};

// 1F1B (PipeDream-flush, Megatron's non-interleaved schedule) for stage `stage` of `stages`:
// min(stages - stage - 1, M) warm-up forwards, then alternately one forward and one backward,
// then the remaining backwards. At most min(stages - stage, M) micro-batches are in flight
// (forwarded, not yet backwarded) on a stage; with equal forward and backward times the bubble is
// (stages - 1) / (M + stages - 1) of the step. One stage: F0 B0 F1 B1 ...
std::vector<PipelineOp> one_f_one_b(int stages, int stage, int micro_batches);

// 1F1B with its steady state in pairs (parallel.pair_micro_batches): min(stages - stage, M)
// forwards first (one more than 1F1B: the last stage's pair cannot be its own forward and
// backward), then forward_backward ops, the forward of micro-batch warm-up + i with the backward
// of micro-batch i, then the remaining backwards. At most min(stages - stage + 1, M) micro-batches
// are in flight on a stage (during a pair).
std::vector<PipelineOp> one_f_one_b_paired(int stages, int stage, int micro_batches);

// ZB1P (ZB-H1 of Qi et al., "Zero Bubble Pipeline Parallelism", 2023; DualPipe's README's ZB1P):
// 1F1B's order with every backward split into its input part (B, what the previous stage waits
// for) and its weight part (W); stage s keeps the W's of up to s micro-batches waiting, runs the
// oldest after each B beyond that, and ends the step with the rest. The last stages, which start
// the backwards, get their input gradients out sooner, and their W's fill what was 1F1B's
// cool-down bubble. At most min(P - s, M) micro-batches are forwarded and not yet B'd on a stage,
// as in 1F1B, and at most min(s, M) wait for their W (holding only what W reads). With F, B (a
// whole backward) and W the ops' times, the bubble is (P - 1)(F + B - 2W) for M >= P, W <= F and
// 2W <= B (test_pipeline_schedule simulates it), against 1F1B's (P - 1)(F + B).
// paired: from one_f_one_b_paired's order (a pair's backward is its B).
std::vector<PipelineOp> zb1p(int stages, int stage, int micro_batches, bool paired = false);

// Every stage's ops (orders[s]) run on P stages, simulated: a forward needs the previous stage's,
// a backward the next stage's (the last stage: its own forward), a weight op its own backward, a
// forward_backward both of its parts' inputs; each stage runs its ops in order, each starting when
// the stage is free and its inputs are ready (a pair's forward and backward both end with it).
// Times: f a forward, b a backward (its input part where the order has weight ops), w a weight op,
// fb a pair (default f + b: nothing hidden).
struct PipelineSim {
  std::vector<double> idle;  // per stage: the makespan less the stage's busy time
  bool complete = true;      // every op ran (no deadlock)
  double makespan = 0;
};
PipelineSim simulate_pipeline(const std::vector<std::vector<PipelineOp>>& orders, double f, double b, double w,
                              double fb = -1);
// The same with each stage's own times.
struct OpTimes {
  double f = 0, b = 0, w = 0, fb = 0;
};
PipelineSim simulate_pipeline(const std::vector<std::vector<PipelineOp>>& orders, const std::vector<OpTimes>& t);

// DualPipeV (deepseek-ai/DualPipe's V-shaped form of DualPipe) on P ranks. The model is cut into
// 2P chunks; rank r holds chunk r, which phase 0 runs from rank 0 to P - 1, and chunk 2P - 1 - r,
// which phase 1 runs back from P - 1 to 0: rank 0 holds the first chunk and the last (the
// embedding, the head and the loss), and rank P - 1 turns the V. Every micro-batch runs both
// phases forward and both backward. A backward may leave its weight gradient to a later `weight`
// op (the zero-bubble split: input gradient first, weights later, in order), and a
// `forward_backward` op runs one micro-batch's forward of one phase with another's backward of the
// other phase, overlapped (DualPipe's F&B: one chunk's communication hidden behind the other's
// compute). With F, B (a whole backward), W (its weight part) and F&B the ops' times, the bubble of
// the slowest rank is (P - 1)(F&B + B - 3W) when a forward takes as long as a backward's input part
// (F = B - W, W <= F: test_pipeline_schedule simulates it), against 1F1B's (P - 1)(F + B) per
// stage of two chunks, 2(P - 1)(F + B). A rank holds at most 2P chunk activations (2P + 1 on rank
// P - 1): P + 1/2 stages' worth. Needs micro_batches >= 2P. `fp8moe train` runs it with
// parallel.pipeline_schedule dualpipev (app/stage_runner.cpp): an F&B's backward, then its forward
// (or with parallel.pair_micro_batches both as a pair of passes, parallel/pass_pair.h), and every
// backward whole (W = 0: the weight ops have nothing to run).
enum class DualOpKind { forward, backward, weight, forward_backward };
struct DualOp {
  DualOpKind kind;
  int phase = 0;                  // forward, backward: the phase; forward_backward: the forward's
  int micro_batch = 0;            // forward, backward: the micro-batch; forward_backward: the forward's
  int backward_micro_batch = -1;  // forward_backward: the backward's (of the other phase)
  bool defer_weight = false;      // backward: its weight gradient waits for a later weight op
  bool operator==(const DualOp&) const = default;
};
std::vector<DualOp> dualpipev(int ranks, int rank, int micro_batches);
// Rank `rank`'s ops as fp8moe runs them (app/stage_runner.cpp), forwards and backwards only: an
// F&B its backward, then its forward (so that a rank holds at most 2P chunk activations, 2P + 1
// on the turn), every backward whole, and no weight op (nothing is left to one). paired
// (parallel.pair_micro_batches): the F&B ops kept, run as a pair of passes (parallel/pass_pair.h),
// one chunk activation more at their peak.
std::vector<DualOp> dualpipev_as_run(int ranks, int rank, int micro_batches, bool paired = false);

// DualPipeV on all P ranks, simulated with the schedule's dependencies: a phase-0 forward needs the
// previous rank's (rank 0: none), a phase-1 forward the next rank's (rank P - 1: its own phase-0
// forward, the V's turn); a phase-1 backward the previous rank's (rank 0: its own phase-1 forward,
// the loss), a phase-0 backward the next rank's (rank P - 1: its own phase-1 backward). Each rank
// runs its ops in order, an op starting when the rank is free and its inputs are ready. Chunk
// times: a forward f, a backward b (b - w where it defers its weight part, w for the weight op), an
// F&B fb, both inputs ready. as_run: dualpipev_as_run's ops instead (the F&B's backward and
// forward each when its own input is ready). in_flight: per rank, the most chunk forwards not yet
// backwarded.
struct DualPipeVSim {
  std::vector<double> idle;   // per rank: the step's makespan less the rank's busy time
  std::vector<int> in_flight;
  bool complete = true;       // every op ran (no deadlock) and every deferred weight op too
  double makespan = 0;
};
DualPipeVSim simulate_dualpipev(int ranks, int micro_batches, double f, double b, double w, double fb, bool as_run);

// The bubble's share of the slowest rank's step, idle / (busy + idle): 1F1B's (P - 1) / (M + P - 1);
// DualPipeV's as fp8moe runs it, with chunk times f and b, simulated (simulate_dualpipev, as_run).
double one_f_one_b_bubble(int stages, int micro_batches);
// ZB1P's idle time of the slowest stage, simulated (simulate_pipeline) with a forward f, a
// backward's input part b and its weight part w.
double zb1p_idle(int stages, int micro_batches, double f, double b, double w);
// 1F1B or ZB1P (zb), paired or not, simulated with each stage's own times: every stage's idle time.
std::vector<double> pipeline_idle(int micro_batches, bool zb, bool paired, const std::vector<OpTimes>& t);
// DualPipeV as fp8moe runs it, with chunk times f and b, simulated: the slowest rank's idle time.
// paired (parallel.pair_micro_batches): its F&B ops as pairs (dualpipev()'s ops with W = 0), each
// hiding `hidden` of its f + b.
double dualpipev_idle(int ranks, int micro_batches, double f, double b, bool paired = false, double hidden = 0);
// paired: its F&B ops as pairs that hide nothing (F&B = f + b).
double dualpipev_bubble(int ranks, int micro_batches, double f, double b, bool paired = false);

}  // namespace fp8moe
