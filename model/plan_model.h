// What a config needs on a layout, computed from the config alone (`fp8moe plan`,
// app/plan_roofline.cpp): the bytes one rank of each pipeline stage holds and keeps, the FLOPs it
// runs, and the bytes each of its groups sends per step. Nothing is allocated: every number follows
// the code that would allocate or send it (named beside each formula), so that a change there shows
// up as a difference between the plan and a measured run (tests/app/test_plan.cpp,
// bench/plan-vs-measured.sh).
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "model/config.h"
#include "model/param_table.h"

namespace fp8moe {

// The process grid of a config on `world` ranks (parallel/grid.h's order): data replicas
// world / (tensor x pipeline), expert-data replicas data / expert.
struct PlanLayout {
  int world = 1, tensor = 1, pipeline = 1, expert = 1, data = 1, expert_data = 1, micro_batches = 1;
  int64_t sequences = 1;  // per replica and micro-batch (StageRunner::sequences())
  int64_t seq_len = 1;
  std::vector<int> split;  // blocks per pipeline stage, or chunk under DualPipeV (model/placement.h stage_split)
  bool v_shape = false;    // parallel.pipeline_schedule dualpipev: two chunks per rank
  bool mtp_alone = false;  // parallel.mtp_own_stage (with several stages)
  int64_t tokens() const { return sequences * seq_len; }  // N of one micro-batch on one rank
};
// Assumes a config load_config accepted for `world` ranks.
PlanLayout plan_layout(const Config& c, int world);

// The analytical bytes one rank sends in one step, per group (tp, ep, dp, edp, pp): the formulas
// of README "Communication", which app/comm_accounting.cpp compares with the counted bytes.
struct CommShape {
  const ModelConfig* model = nullptr;
  int tensor = 1, expert = 1, data = 1, expert_data = 1, pipeline = 1;
  double tokens = 0;          // N: per micro-batch on this rank
  double micro_batches = 1;
  bool first = true, last = true;  // this rank's stage: the embedding, the head
  // parallel.mtp_own_stage: the head (final norm, head, loss) on the stage before the last (`head`:
  // this rank's), the modules alone on the last; once a step the last sends its gradient of the
  // head's weight to the head stage and the head stage its updated weight back (V_local x D floats
  // each).
  bool mtp_alone = false, head = false;
  // The last stage (chunk) runs the head with no block (model/placement.h head_alone): its input
  // gradient travels in FP32 under train.activations bf16.
  bool head_alone = false;
  int layer_begin = 0, layer_end = 0;
  // DualPipeV (parallel.pipeline_schedule): the rank's second chunk [layer_begin2, layer_end2) (the
  // V's way back), and whether it is the V's turn (the last rank); its messages go both ways.
  bool v_shape = false, turn = false;
  int layer_begin2 = 0, layer_end2 = 0;
  int local_experts = 0;
  double dense_bytes = 0, expert_bytes = 0;  // the trainable parameters this rank holds, FP32
  double rows_off_rank = 0;  // routed rows of this rank sent to another expert rank, over the step
  // Of rows_off_rank, those whose rank is on another node; and runtime.node_dedup across nodes
  // (parallel/expert_dispatch.h's relay), over the step: the token rows this rank sends across
  // nodes (one per token and other node chosen) and forwards in its node for other nodes' ranks,
  // per exchange; the expert group's ranks on other nodes than this rank's.
  bool relay = false;
  double rows_off_node = 0, relay_across = 0, relay_forwarded = 0;
  int remote_ranks = 0;
  const Fp8Config* fp8 = nullptr;                       // nullptr: FP8 off
  ActivationDtype activations = ActivationDtype::fp32;  // train.activations
  ReduceDtype grad_reduce = ReduceDtype::fp32;          // optim.grad_reduce
  GateSite moe_gates = GateSite::combine;               // train.moe_gates
  Recompute recompute = Recompute::none;                // train.recompute: moe, full run forwards again
  const std::vector<int>* recompute_layers = nullptr;   // train.recompute_layers (nullptr: none)
  // Of rows_off_rank, rows_off_node, relay_across and relay_forwarded, those of the MoE blocks run
  // again (a run's counts); < 0: by those blocks' share of the stage's MoE blocks (the plan).
  double rows_off_rank_again = -1, rows_off_node_again = -1, relay_across_again = -1, relay_forwarded_again = -1;
};
// The shape's blocks (both chunks under DualPipeV; not the modules'), and of them the MoE blocks.
std::array<int, 2> shape_blocks(const CommShape& s);
// The blocks of the shape's stage (its modules' on the last) that run their forward again:
// {dense, MoE}.
std::array<double, 2> recomputed_blocks(const CommShape& s);
// Of the shape's stage's MoE blocks (its modules' on the last), the share that runs its forward
// again (0 without MoE blocks).
double recomputed_moe_share(const CommShape& s);
std::array<double, 5> analytic_comm_bytes(const CommShape& s);
// Of ep's formula, the expert rows' bytes over the step to ranks of this rank's node and of other
// nodes ({in, across}; rows only, not the counts or the relay's map): every exchange's rows whose
// expert is on another rank (rows_off_rank) or node (rows_off_node), and with the relay its
// relayed exchanges once per token and other node (relay_across), plus the rows the relay forwards
// in its node (relay_forwarded).
std::array<double, 2> expert_rows_by_node(const CommShape& s);

// The bytes of one routed row of D values in each of the expert all-to-all's four exchanges
// (model/moe.h MoeWire): the experts' input (dispatch), their output (combine), its gradient
// (dispatch, backward) and the input's gradient (combine, backward). fp32: 4 D each; bf16: FP8 rows
// of D bytes and ceil(D / tile) FP32 scales where the experts are blockwise FP8, D bytes where they
// are per-tensor FP8, else 2 D; combine 2 D both ways. gates: train.moe_gates expert sends each
// row's gate (4 bytes) with the dispatch and brings its gradient (8 bytes, FP64) back with the
// backward's combine, two exchanges of their own; 0 with combine.
struct ExpertRowBytes {
  double dispatch = 0, combine = 0, grad_dispatch = 0, grad_combine = 0, gates = 0;
  double total() const { return dispatch + combine + grad_dispatch + grad_combine + gates; }
  // A row of a MoE layer that train.recompute moe or full (or recompute_layers) runs again: its
  // forward's dispatch and combine once more (the routing, the exchange's plan, its scale and the
  // gates are kept). again: the share of the MoE layers run again (0 to 1).
  double per_step(double again) const { return total() + again * (dispatch + combine); }
  // Of per_step, the exchanges the relay across nodes (runtime.node_dedup) moves once per token and
  // node: those whose rows are the same for each of a token's experts (the experts' input, again
  // where recomputed; with the gates in the experts, its output's gradient) and those the token's
  // side only sums (the input's gradient; with the gates in the experts, the output, again where
  // recomputed).
  double relayed(double again) const {
    const double fwd = 1 + again;
    return dispatch * fwd + grad_combine + (gates > 0 ? grad_dispatch + combine * fwd : 0);
  }
};
ExpertRowBytes expert_row_bytes(int64_t D, const Fp8Config* fp8, ActivationDtype activations, GateSite gates);
// Per MoE layer and micro-batch, what one rank of an expert group of P sends for the FP8 rows' one
// scale under a per-tensor recipe (train.activations bf16): two 4-byte amax all-reduces (dispatch,
// and the gradients' dispatch); else 0.
double expert_wire_scale_bytes(int P, const Fp8Config* fp8, ActivationDtype activations);
// model/moe.h MoeWire: the routed experts' rows travel in FP8 at one scale per exchange (the
// per-tensor recipes under train.activations bf16).
bool tensor_scaled_wire(const Fp8Config* fp8, ActivationDtype activations);
// The bytes of one value of the pipeline's messages (activations and their gradients): 4 or 2.
double pipeline_value_bytes(ActivationDtype activations);
inline constexpr const char* kCommGroupNames[5] = {"tp", "ep", "dp", "edp", "pp"};

// One FP8 copy's bytes (kernels/tensor.h QTensor: one byte per element and its FP32 scales in the
// tiling's layout, kernels/quantize.h tiling_scale_rows/cols).
enum class PlanTiling { per_tensor, rows_1xT, cols_Tx1, blocks_TxT };
double fp8_copy_bytes(int64_t rows, int64_t cols, PlanTiling t, int tile);

// Bytes one block (layer l of the model, the multi-token prediction modules' blocks numbered on
// from n_layers) keeps for its backward per micro-batch on one rank: Transformer::BlockSaved::bytes
// when the block is kept, its input and MoE routing when it is recomputed. Uniform routing: every
// expert receives N x top_k x expert / n_experts rows; no token dropped.
double block_saved_bytes(const Config& c, const PlanLayout& L, int layer);

// The memory of one rank of a pipeline stage, in bytes. Every tensor-parallel and expert-parallel
// rank of a stage holds the same amounts (even splits); the ZeRO-1 shard is the largest replica's.
struct StageMemory {
  int stage = 0, layer_begin = 0, layer_end = 0, mtp_blocks = 0;
  bool first = true, last = true;
  bool head = true;  // the main head's final norm, head and loss (parallel.mtp_own_stage: not the last)
  // DualPipeV: the rank's second chunk [layer_begin2, layer_end2), the V's way back (v_shape).
  bool v_shape = false;
  int layer_begin2 = 0, layer_end2 = 0;
  int64_t held = 0, dense_trainable = 0, expert_trainable = 0;  // elements
  int64_t owned_dense = 0, owned_expert = 0;  // trainable elements this rank keeps moments for
  double weights = 0;      // FP32 parameters (the master weights: fp8moe keeps no other copy)
  double grads = 0;        // FP32 gradients, one per held parameter (model/param_store.h)
  double moments = 0;      // AdamW m and v of the owned rows (FP32 or BF16)
  double fp8_weights = 0;  // the step's FP8 weight copies and scales (model/linear.h WeightCache)
  double fp8_state = 0;    // delayed-scaling amax histories and scales (model/linear.h LinearScaling)
  double saved_per_micro_batch = 0;  // activations kept for backward by one micro-batch (both chunks)
  int in_flight = 1;                 // micro-batches between forward and backward at once (1F1B);
                                     // DualPipeV: chunk forwards not yet backwarded, at most
  double activations = 0;            // 1F1B: saved_per_micro_batch x in_flight; DualPipeV: the most
                                     // of its chunks' activations at once over its schedule
  // ZB1P (parallel.pipeline_schedule zb1p): what one micro-batch's weight op holds (the copies of
  // its blocks' linear layers' inputs and output gradients, FP8 with their scales or FP32), and
  // the micro-batches holding it at once, min(stage + 1, M); counted in `activations` on top of the
  // in-flight ones (an upper bound: a B frees its state as its copies are made).
  double weight_op_bytes = 0;
  int weight_ops_waiting = 0;
  double workspace = 0;              // the largest set of temporaries alive at once on top
  // Host memory, not in total(): what this rank writes of a checkpoint (its replica's share of the
  // parameters' rows, the moments' rows it writes), which an asynchronous save copies
  // (checkpoint.async; io/checkpoint.h checkpoint_copy_bytes).
  double checkpoint_copy = 0;
  double total() const { return weights + grads + moments + fp8_weights + fp8_state + activations + workspace; }
};
std::vector<StageMemory> plan_memory(const Config& c, const PlanLayout& L);
// The MoE blocks a rank of the stage runs: its chunks' and, with the head, the modules'.
int stage_moe_blocks(const ModelConfig& m, const StageMemory& s);
// A time measured on one rank holding every block (the CPU's probe models, app/plan_probe.cpp),
// per micro-batch or per step, in parts: the work outside the blocks (embedding, final norm, head,
// loss, the fixed work), one dense block's, one MoE block's, one MTP module's.
struct BlockSeconds {
  double outside = 0, dense = 0, moe = 0, mtp = 0;
};
// A stage's rank's share of it: its dense and MoE blocks (both chunks under DualPipeV), and on the
// stage with the head the work outside the blocks and the modules. Summed over the stages: the
// whole model's. (model/plan_stages.cpp, with stage_moe_blocks, in_flight_micro_batches and
// dualpipev_activations.)
double stage_seconds(const ModelConfig& m, const StageMemory& s, const BlockSeconds& t);
// The model one rank of `tp`-way tensor parallelism computes, as a model of its own: the heads (and
// GQA's kv heads), the dense MLP's and every expert's width and the vocabulary over `tp`; the
// norms, the router, MLA's latents and the MTP modules' eh_proj whole (io/config_rules.cpp
// split_rules). The CPU's probe models time it (app/plan_probe.cpp); its parameters are a rank's.
ModelConfig tensor_rank_model(const ModelConfig& m, int tp);

// FLOPs one rank of a stage runs per micro-batch (forward + backward, recomputation included),
// split by the unit that runs them.
struct StageFlops {
  double fp8_gemm = 0;    // linear layers fp8.recipe and fp8.layers run in FP8
  // Of fp8_gemm, hp_gemm and bf16_gemm, the weight-gradient GEMMs ZB1P's weight ops run
  // (zb1p_weight_op).
  double wgrad_fp8 = 0, wgrad_hp = 0, wgrad_bf16 = 0;
  double hp_gemm = 0;     // the other GEMMs (FP32 in fp8moe): linear layers FP8 is off for,
                          // router, eh_proj, head (under train.hp_gemm fp32)
  double attention = 0;   // QK^T and PV, causal, forward and backward
  double recompute = 0;   // of the above, the recomputed forwards
  double bf16_gemm = 0;   // the router, eh_proj and head under train.hp_gemm bf16 (at the BF16 peak)
  double total() const { return fp8_gemm + hp_gemm + bf16_gemm + attention; }
};
std::vector<StageFlops> plan_flops(const Config& c, const PlanLayout& L);
// Whether ZB1P's weight op runs parameter p's weight-gradient GEMM: the blocks' (and the modules'
// blocks') linear layers, the head and eh_proj, but not the shared and routed experts where their
// exchange is posted (expert parallelism with runtime.overlap_expert_comm: model/moe.cpp keeps
// their weight gradients behind it), nor the router.
struct ParamSpec;
bool zb1p_weight_op(const Config& c, const PlanLayout& L, const ParamSpec& p);

// The seconds one step may take when `world` devices spend `hours` device-hours on `tokens`
// tokens at `step_tokens` a step: hours x 3600 / (tokens / step_tokens) / world.
double step_budget_seconds(double hours, double tokens, double step_tokens, int world);
// Micro-batches between their forward and their backward at once on a stage (parallel/pipeline_schedule.h;
// paired: parallel.pair_micro_batches, a pair's forward made before its backward frees).
int in_flight_micro_batches(int stages, int stage, int micro_batches, bool paired = false);
// DualPipeV's rank `rank` of `ranks`: the most bytes its chunks' activations hold at once over its
// schedule (saved[phase]: one micro-batch's of that phase's chunk), and the most chunk forwards
// not yet backwarded (paired: parallel.pair_micro_batches, an F&B's forward state made before its
// backward frees the other's).
double dualpipev_activations(int ranks, int rank, int micro_batches, const double saved[2], int* most_chunks,
                             bool paired = false);

}  // namespace fp8moe
