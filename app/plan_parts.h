// The parts of `fp8moe plan` (app/plan.h), internal to the executable: the devices
// (app/plan_devices.cpp), the CPU measured on probe models of the config's blocks
// (app/plan_probe.cpp), the plan of a config and its roofline time model (app/plan_roofline.cpp),
// the report (app/plan_report.cpp); app/plan.cpp holds the command, the loading, the search for a
// layout that fits and run_plan, which calls the others in turn.
#pragma once

#include <algorithm>
#include <array>
#include <string>
#include <vector>

#include "app/plan.h"
#include "model/config.h"
#include "model/plan_model.h"

namespace fp8moe::plan_detail {

// ---- the devices (app/plan_devices.cpp, app/plan_probe.cpp) -----------------------------------

// The CPU's step, measured on fp8moe's own code: small models of the config's blocks (the same
// widths, micro-batch, recipe and recompute mode; one or two blocks of each kind) trained one
// micro-batch at a time on the backend `train` would use, their times split by block kind. Seconds.
struct CpuProbe {
  bool valid = false;
  std::string why_not;             // when not valid
  Recompute recompute = Recompute::none;
  int64_t tokens = 0;              // the micro-batch the probes ran
  int tensor = 1;                  // the tensor parallelism whose rank's shards they ran
  // Each as probe A's time (`a`: embedding, final norm, head, cross-entropy, the fixed work, and
  // A's one dense and one MoE block) + each further block's.
  struct Part { double a = 0, dense = 0, moe = 0, mtp = 0; };
  int dense_in_a = 0, moe_in_a = 0;
  bool per_block = false;  // each kind of block the model has probed apart from A (a split's stages)
  // A part for a model of `dense` + `moe` blocks and `mtp` modules on one rank.
  double of(const Part& q, int dense, int moe, int mtp) const {
    return q.a + (dense - dense_in_a) * q.dense + (moe - moe_in_a) * q.moe + mtp * q.mtp;
  }
  // The same as per-block parts, for a pipeline stage's share (model/plan_model.h stage_seconds).
  BlockSeconds blocks(const Part& q) const {
    return {std::max(0.0, q.a - dense_in_a * q.dense - moe_in_a * q.moe), q.dense, q.moe, q.mtp};
  }
  Part cached;     // a micro-batch's forward + backward with the step's FP8 weights already quantized
  Part first;      // the first micro-batch of a step: with the FP8 weights' quantization
  Part optimizer;  // zero_grads, the gradient norm and AdamW's step
  int probes = 0;
  bool real_data = false;          // the probes trained on the config's data.path (else random tokens)
  double probe_seconds = 0;        // the measurement's own wall time
};

// A device's peaks and memory.
struct Device {
  std::string name, basis;
  CpuProbe probe;
  double fp8 = 0, bf16 = 0, fp32 = 0;  // FLOP/s
  double attention = 0;                // the attention core's FLOP/s
  double memory = 0;                   // bytes one rank may hold
  double hbm = 0;                      // bytes/s
  double nvlink = 0, ib = 0;           // bytes/s per GPU and direction
  bool cpu = false;
};

// --device, or its default for the config's runtime.device (cpu for cpu or emulated, else h100).
std::string device_name(const PlanOptions& o, const Config& c);
// Whether `name` is a device of the table; else the error message names the devices there are.
bool is_device(const std::string& name);
extern const char* const kDeviceNames;  // "h100, h200, h800, b200 or cpu"
// A GPU of the table (h100, h200, h800, b200): its datasheet peaks.
Device gpu(const std::string& name);
// The resident memory of an `fp8moe train` process on the CPU besides its tensors: the process
// itself and the libraries' heap, bytes (measured: app/plan_devices.cpp says how).
extern const double kCpuProcessBaseline;
extern const double kCpuLibraryHeap;

// This CPU, measured now at the config's shapes (GEMMs, attention, memory bandwidth, RAM) and,
// with `probe`, on probe models of the config's blocks (app/plan_probe.cpp).
Device cpu_device(const Config& c, const PlanLayout& L, bool probe);

// ---- the plan of one config and its time model (app/plan_roofline.cpp) ----------------------

struct Roofline {
  double compute_mb = 0;   // the slowest stage's compute per micro-batch, s
  double comm_mb = 0;      // its tp, ep and pp communication per micro-batch, s (what the step waits for)
  double ep_hidden_mb = 0; // of its ep time, what runs behind the MoE layers' own compute (model/moe.cpp), s
  double memory_mb = 0;    // its memory-bound traffic per micro-batch, s
  double dp = 0;           // the step's dp + edp communication, s (the whole of it)
  double dp_exposed = 0;   // of it, what the step waits for (optim.overlap_grad_reduce, --overlap)
  int pace_stage = 0;      // the slowest stage (its time per micro-batch sets 1F1B's pace)
  double pace_ratio = 1;   // its time per micro-batch over the stages' mean
  double optimizer = 0;    // the step's AdamW and FP8 weight quantization, s
  double bubble = 0;       // s
  double weight_op_mb = 0; // ZB1P: a weight op's seconds per micro-batch on the slowest stage
  double pair_hidden = 0;  // parallel.pair_micro_batches: ep seconds each pair hides behind its other pass
  int pairs = 0;           // the pace stage's pairs (DualPipeV: its F&B ops)
  double step = 0;         // s
  std::array<double, 5> comm_s{};  // per group, per step, s (the slowest stage)
  // Every stage's micro-batch on one rank, as the slowest stage's above (s): the table of stages.
  struct StageTime {
    double compute = 0, memory = 0, comm = 0, ep_hidden = 0, t = 0;
    double paired = 0;  // parallel.pair_micro_batches: of t, what the stage's pairs hide, per micro-batch
  };
  std::vector<StageTime> stages;
  bool measured = false;   // the CPU's probes (compute_mb: a micro-batch; quantize, optimizer: per step)
  double quantize = 0;     // measured: the FP8 weights' quantization at their first use in a step, s
};

struct Plan {
  Config cfg;
  PlanLayout L;
  std::vector<StageMemory> mem;
  std::vector<StageFlops> flops;
  std::vector<std::array<double, 5>> comm;  // per stage: bytes one rank sends per step
  // Per stage: of comm's ep bytes, those that cross nodes, where the expert group spans nodes of
  // node_size GPUs (else empty): the relay's per-token rows once per token and other node
  // (runtime.node_dedup), every other exchange's rows whose expert is on another node.
  std::vector<double> ep_across;
  // Per stage (with the relay; else empty): of comm's ep bytes, the rows the relay forwards inside
  // its node (each relayed exchange's in-node exchange, which runs in line: ep_hidden_seconds).
  std::vector<double> ep_forwarded;
  // Per stage: the share of its MoE blocks that run their forward again (recomputed_moe_share).
  std::vector<double> moe_again;
  // Per token and MoE layer where ep spans nodes: its rows to other nodes' experts, and the other
  // nodes among its experts' (what the relay sends; 0 without it).
  double rows_across = 0, relay_nodes = 0;
  bool node_limited = false;  // relay_nodes from node-limited routing's groups (else from top_k)
  double worst_total() const {
    double w = 0;
    for (const StageMemory& s : mem) w = std::max(w, s.total());
    return w;
  }
};

// The layout, memory, FLOPs and communication bytes of config `c` on `world` ranks, nodes of
// node_size GPUs.
Plan make_plan(const Config& c, int world, int node_size = 8);

// How communication enters the step: as the options say (exposed, or with --overlap hidden behind
// compute where compute is longer), or not at all (compute only: every byte hidden, as DeepSeek-V3's
// DualPipe with its node-limited FP8 dispatch is reported to achieve).
enum class CommMode { options, exposed, overlapped, hidden };

// The step time of plan `p` on device `d` at efficiency `eff` of its peaks. balanced: every stage
// takes the stages' mean compute and memory time (stages of equal work, as a layout that balanced
// the head and the modules against blocks would have), else the slowest stage sets the pace.
Roofline roofline(const Plan& p, const Device& d, const PlanOptions& opts, double eff, CommMode mode = CommMode::options,
                  bool balanced = false);

// ---- the search (app/plan.cpp) -----------------------------------------------------------------

// A layout that fits: the --set arguments that make it, its worst rank's bytes and its step time.
struct Candidate {
  std::vector<std::string> sets;
  double memory = 0, step = 0;
};

// ---- the report (app/plan_report.cpp) ----------------------------------------------------------

// What the report of one plan prints from.
struct PlanReport {
  const PlanOptions& o;
  const Plan& p;
  const Device& d;
  int world = 0;
  double eff = 0;          // the efficiency of the device's peaks (--efficiency or its default)
  double baseline = 0;     // the CPU's bytes per rank besides the tensors (process and heap); 0 on a GPU
  double model_flops = 0;  // per token, forward + backward (the MFU's numerator)
  double step_tokens = 0;  // tokens per step
  Roofline r;              // the step as the options say
};
PlanReport make_report(const PlanOptions& o, const Plan& p, const Device& d, int world);

void print_layout(const PlanReport& rep);         // the run, its layout and the parameter counts
void print_flops(const PlanReport& rep);          // FLOPs per token
void print_memory(const PlanReport& rep);         // memory per rank, ZeRO-1, the device's limit
void print_communication(const PlanReport& rep);  // bytes per group and step, and their time
void print_bubble(const PlanReport& rep);         // the 1F1B bubble
void print_step_time(const PlanReport& rep);      // the step: measured (the CPU's probes) or the roofline
void print_tokens(const PlanReport& rep);         // device-hours for --tokens, against --target-gpu-hours
void print_summary(const PlanReport& rep);        // one line for scripts
// What FP8 changes in the memory of the worst rank, against recipe off and a BF16 model.
void print_fp8_savings(const Config& c, int world);
// A rank that does not fit: the warning; then (unless --no-search) what was searched and found.
void print_misfit(const PlanReport& rep);
void print_fits(const PlanReport& rep, const std::vector<Candidate>& fits, const std::string& searched);

}  // namespace fp8moe::plan_detail
