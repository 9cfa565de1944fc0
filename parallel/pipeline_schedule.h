// The order in which one pipeline stage runs the forwards and backwards of a step's micro-batches.
#pragma once

#include <vector>

namespace fp8moe {

// backward: a whole backward, or (with weight ops in the order) its input part alone; weight: the
// weight part of that micro-batch's backward (the zero-bubble split).
enum class PipeOpKind { forward, backward, weight };
struct PipelineOp {
  PipeOpKind kind;
  int micro_batch;
  bool forward() const { return kind == PipeOpKind::forward; }
  bool operator==(const PipelineOp&) const = default;
};

// 1F1B (PipeDream-flush, Megatron's non-interleaved schedule) for stage `stage` of `stages`:
// min(stages - stage - 1, M) warm-up forwards, then alternately one forward and one backward,
// then the remaining backwards. At most min(stages - stage, M) micro-batches are in flight
// (forwarded, not yet backwarded) on a stage; with equal forward and backward times the bubble is
// (stages - 1) / (M + stages - 1) of the step. One stage: F0 B0 F1 B1 ...
std::vector<PipelineOp> one_f_one_b(int stages, int stage, int micro_batches);

// ZB1P (ZB-H1 of Qi et al., "Zero Bubble Pipeline Parallelism", 2023; DualPipe's README's ZB1P):
// 1F1B's order with every backward split into its input part (B, what the previous stage waits
// for) and its weight part (W); stage s keeps the W's of up to s micro-batches waiting, runs the
// oldest after each B beyond that, and ends the step with the rest. The last stages, which start
// the backwards, get their input gradients out sooner, and their W's fill what was 1F1B's
// cool-down bubble. At most min(P - s, M) micro-batches are forwarded and not yet B'd on a stage,
// as in 1F1B, and at most min(s, M) wait for their W (holding only what W reads). With F, B (a
// whole backward) and W the ops' times, the bubble is (P - 1)(F + B - 2W) for M >= P, W <= F and
// 2W <= B (test_pipeline_schedule simulates it), against 1F1B's (P - 1)(F + B).
std::vector<PipelineOp> zb1p(int stages, int stage, int micro_batches);

// Every stage's ops (orders[s]) run on P stages, simulated: a forward needs the previous stage's,
// a backward the next stage's (the last stage: its own forward), a weight op its own backward;
// each stage runs its ops in order, each starting when the stage is free and its input is ready.
// Times: f a forward, b a backward (its input part where the order has weight ops), w a weight op.
struct PipelineSim {
  std::vector<double> idle;  // per stage: the makespan less the stage's busy time
  bool complete = true;      // every op ran (no deadlock)
  double makespan = 0;
};
PipelineSim simulate_pipeline(const std::vector<std::vector<PipelineOp>>& orders, double f, double b, double w);
// The same with each stage's own times (f[s], b[s], w[s]).
PipelineSim simulate_pipeline(const std::vector<std::vector<PipelineOp>>& orders, const std::vector<double>& f,
                              const std::vector<double>& b, const std::vector<double>& w);

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
// parallel.pipeline_schedule dualpipev (app/stage_runner.cpp): an F&B's backward, then its forward,
// and every backward whole (W = 0: the weight ops have nothing to run).
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
// on the turn), every backward whole, and no weight op (nothing is left to one).
std::vector<DualOp> dualpipev_as_run(int ranks, int rank, int micro_batches);

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
// ZB1P simulated with each stage's own times: every stage's idle time.
std::vector<double> zb1p_idle(int micro_batches, const std::vector<double>& f, const std::vector<double>& b,
                              const std::vector<double>& w);
double dualpipev_bubble(int ranks, int micro_batches, double f, double b);

}  // namespace fp8moe
