// The report of `fp8moe plan`: the layout and parameters, FLOPs per token, memory per rank (and
// what FP8 saves), communication per group, the pipeline bubble, the step time (measured on the
// CPU or the roofline), device-hours against a target, and for a rank that does not fit the
// layouts that would.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "app/plan_parts.h"
#include "app/step_report.h"
#include "model/param_table.h"
#include "parallel/pipeline_schedule.h"

namespace fp8moe::plan_detail {
namespace {

// What one routed row of the expert all-to-all is, by train.activations (model/plan_model.h
// expert_row_bytes).
std::string expert_rows_text(const Config& c) {
  const int64_t D = c.model.d_model;
  const ExpertRowBytes b =
      expert_row_bytes(D, c.fp8.recipe == Fp8Recipe::off ? nullptr : &c.fp8, c.train.activations, c.train.moe_gates);
  const std::string gates = b.gates > 0 ? "; the gate out and its FP64 gradient back, " + std::to_string(int64_t(b.gates)) +
                                              " bytes a row (train.moe_gates expert)"
                                        : "";
  if (c.train.activations == ActivationDtype::fp32)
    return "FP32 rows of D = " + std::to_string(D) + " values, " + std::to_string(int64_t(b.dispatch)) +
           " bytes each exchange (train.activations fp32)" + gates;
  const bool fp8 = b.dispatch < 2.0 * double(D);
  const std::string scales = c.fp8.recipe == Fp8Recipe::blockwise
                                 ? " (1 x " + std::to_string(c.fp8.tile) + " tiles and their scales)"
                                 : " (one scale per exchange, its amax all-reduced over the expert group)";
  return std::string(fp8 ? "FP8 dispatch, " : "BF16 dispatch, ") + std::to_string(int64_t(b.dispatch)) +
         " bytes a row" + (fp8 ? scales : "") +
         " both ways; BF16 combine, " + std::to_string(int64_t(b.combine)) + " bytes a row both ways; D = " +
         std::to_string(D) + " (train.activations bf16)" + gates;
}

std::string bytes_text(double b) {
  char s[32];
  if (b >= 1e12) std::snprintf(s, sizeof s, "%.2f TB", b / 1e12);
  else if (b >= 1e9) std::snprintf(s, sizeof s, "%.2f GB", b / 1e9);
  else if (b >= 1e6) std::snprintf(s, sizeof s, "%.1f MB", b / 1e6);
  else if (b >= 1e3) std::snprintf(s, sizeof s, "%.1f kB", b / 1e3);
  else std::snprintf(s, sizeof s, "%.0f B", b);
  return s;
}

std::string seconds_text(double s) {
  char b[32];
  if (s >= 1) std::snprintf(b, sizeof b, "%.3f s", s);
  else std::snprintf(b, sizeof b, "%.3f ms", s * 1e3);
  return b;
}

// A stage's blocks as the tables name them: "5-8", "57-60+mtp", "head+mtp" (the head and the
// modules alone); DualPipeV's two chunks "0-0,head+mtp". parallel.mtp_own_stage: "56-59+head" (the
// head with the last block), "mtp" (the modules alone), "1-1,59-60+head" and "0-0,mtp".
std::string stage_blocks_text(const StageMemory& s) {
  auto range = [](int b, int e) { return std::to_string(b) + "-" + std::to_string(e - 1); };
  const std::string mtp = s.mtp_blocks ? "+mtp" : "", head = s.head && !s.last ? "+head" : "";
  const std::string alone = s.head ? "head" + mtp : "mtp";  // a last chunk of no block
  if (s.v_shape)  // the V's way down and its way back (possibly empty)
    return range(s.layer_begin, s.layer_end) + "," +
           (s.layer_end2 > s.layer_begin2 ? range(s.layer_begin2, s.layer_end2) + head + mtp : alone);
  if (s.layer_end > s.layer_begin) return range(s.layer_begin, s.layer_end) + head + mtp;
  return alone;
}

void print_memory_table(const Plan& p, const Device& d, double baseline) {
  std::printf("memory per rank, by pipeline stage (every tensor/expert rank of a stage alike; bytes, 1 GB = 1e9):\n");
  // (DualPipeV: a rank's most activations at once over its schedule, as the mean of a chunk's
  // times the chunks in flight then.)
  std::printf("  stage  layers    weights     grads    moments  fp8 copies  %s  workspace      total%s\n",
              p.L.v_shape ? "act/chunk  x chunks in flight" : "act/micro-batch x in flight", d.cpu ? "   RSS (+ process, heap)" : "");
  for (const StageMemory& s : p.mem) {
    const std::string layers = stage_blocks_text(s);
    std::printf("  %5d  %-8s %9s %9s %10s %11s %14s x %-3d %9s %9s %10s", s.stage, layers.c_str(), bytes_text(s.weights).c_str(),
                bytes_text(s.grads).c_str(), bytes_text(s.moments).c_str(), bytes_text(s.fp8_weights + s.fp8_state).c_str(),
                bytes_text(s.v_shape ? s.activations / std::max(1, s.in_flight) : s.saved_per_micro_batch).c_str(),
                s.in_flight, "", bytes_text(s.workspace).c_str(),
                bytes_text(s.total()).c_str());
    if (d.cpu) std::printf("   %s", bytes_text(s.total() + baseline).c_str());
    std::printf("%s\n", s.total() + baseline > d.memory ? "  DOES NOT FIT" : "");
  }
  double copy = 0;
  int at = 0;
  for (const StageMemory& s : p.mem)
    if (s.checkpoint_copy > copy) copy = s.checkpoint_copy, at = s.stage;
  std::printf("  host memory for checkpoint.async's copy (what a rank writes of a checkpoint; pinned under CUDA): "
              "%s per rank (stage %d)\n", bytes_text(copy).c_str(), at);
}

// The efficiency in (0, 1] at which step_at(efficiency) takes `budget`, or -1 where even 1.0 is
// too slow. The step falls monotonically with the efficiency: bisect (geometrically, 200 times).
double solve_efficiency(const std::function<double(double)>& step_at, double budget) {
  if (step_at(1.0) > budget) return -1.0;
  double lo = 1e-6, hi = 1.0;
  for (int i = 0; i < 200; ++i) {
    const double mid = std::sqrt(lo * hi);
    (step_at(mid) > budget ? lo : hi) = mid;
  }
  return hi;
}

// The pipeline schedule as the roofline models it.
const char* schedule_text(const Config& c, const PlanLayout& L) {
  const bool pairs = c.parallel.pair_micro_batches;
  if (L.v_shape) return pairs ? "DualPipeV (its F&B ops as pairs, W = 0)" : "DualPipeV (its F&B not overlapped, W = 0)";
  if (c.parallel.pipeline_schedule == PipelineSchedule::zb1p) return pairs ? "ZB1P in pairs" : "ZB1P";
  return pairs ? "1F1B in pairs" : "1F1B";
}

const char* verdict(double e) {
  return e < 0.30 ? "below DeepSeek-V3's plausible 0.30-0.45" : e <= 0.45 ? "within the plausible 0.30-0.45"
                                                                            : "above the plausible 0.30-0.45";
}

// --target-gpu-hours (a): the efficiency that spends the budget with fp8moe's own communication
// exposed, and hidden behind compute where compute is longer (--overlap); where neither can reach
// it, what communication alone costs, and with expert parallelism why.
void print_target_communication(const PlanReport& rep, double budget) {
  const PlanOptions& o = rep.o;
  const Plan& p = rep.p;
  const Device& d = rep.d;
  const PlanLayout& L = p.L;
  const double ep_bytes = [&] {
    double b = 0;
    for (const auto& cs : p.comm) b = std::max(b, cs[1]);
    return b;
  }();
  bool unreachable = false;
  for (CommMode mode : {CommMode::exposed, CommMode::overlapped}) {
    const char* what = mode == CommMode::exposed ? "(a) fp8moe's communication exposed (as it runs)"
                                                 : "(a) fp8moe's communication hidden behind compute where shorter (--overlap)";
    const double e = solve_efficiency([&](double x) { return roofline(p, d, o, x, mode).step; }, budget);
    if (e >= 0) {
      const Roofline at = roofline(p, d, o, e, mode);
      std::printf("  %s: efficiency %.3f (%s); per step compute %s, communication %s, bubble %s\n", what, e, verdict(e),
                  seconds_text(at.compute_mb * L.micro_batches).c_str(),
                  seconds_text(at.comm_mb * L.micro_batches + at.dp).c_str(), seconds_text(at.bubble).c_str());
      continue;
    }
    // The step with the compute taking no time at all: what communication alone costs.
    const Roofline top = roofline(p, d, o, 1.0, mode), floor = roofline(p, d, o, 1e12, mode);
    const bool comm_bound = floor.step > budget;
    unreachable = unreachable || comm_bound;
    std::printf("  %s: cannot be reached at any efficiency: at 1.0 the step takes %s; with the compute taking no time "
                "at all %s (communication %s per micro-batch over %d micro-batches and the bubble of %s, dp/edp %s) %s %s%s\n",
                what, seconds_text(top.step).c_str(), seconds_text(floor.step).c_str(), seconds_text(floor.comm_mb).c_str(),
                L.micro_batches, schedule_text(p.cfg, L),
                mode == CommMode::overlapped ? "hidden" : seconds_text(floor.dp).c_str(), comm_bound ? ">" : "<=",
                seconds_text(budget).c_str(),
                comm_bound ? "" : rep.p.cfg.train.hp_gemm == GemmDtype::bf16
                                      ? ": the compute as configured (recomputation, the slowest stage setting the "
                                        "pace) is what does not fit; see (b)"
                                      : ": the compute as configured (recomputation, the FP32 router, eh_proj and "
                                        "head, the slowest stage setting the pace) is what does not fit; see (b)");
  }
  if (unreachable && L.expert > 1) {
    const Roofline top = roofline(p, d, o, 1.0, CommMode::exposed);
    std::printf("      why: the expert all-to-all alone sends %s per rank per step (%s; 4 exchanges per MoE layer and "
                "micro-batch: dispatch and combine, forward and backward; uniform routing%s): %s at %s/s of NVLink "
                "to the peers inside a node and %s/s of InfiniBand to the rest, %.2fx the budget of a whole step\n",
                bytes_text(ep_bytes).c_str(), expert_rows_text(p.cfg).c_str(),
                p.relay_nodes > 0 ? ", a token's row across to each other node once (runtime.node_dedup)" : "",
                seconds_text(top.comm_s[1]).c_str(),
                bytes_text(d.nvlink).c_str(), bytes_text(d.ib).c_str(), top.comm_s[1] / budget);
  }
}

// --target-gpu-hours (b): compute only (every byte hidden), the GEMMs not in FP8 in BF16 or FP32,
// the slowest stage setting the pace or the stages balanced.
void print_target_compute(const PlanReport& rep, double budget) {
  const PlanOptions& o = rep.o;
  const Plan& p = rep.p;
  const Device& d = rep.d;
  const PlanLayout& L = p.L;
  const bool configured_bf16 = p.cfg.train.hp_gemm == GemmDtype::bf16;
  for (const char* hp : {"bf16", "fp32"}) {
    const bool bf16 = std::string(hp) == "bf16";
    // The plan with the router, eh_proj and head at this precision whatever train.hp_gemm says.
    Plan q = p;
    for (StageFlops& f : q.flops)
      if (!bf16) f.hp_gemm += f.bf16_gemm, f.bf16_gemm = 0;
    for (bool balanced : {false, true}) {
      PlanOptions oo = o;
      oo.higher_precision = hp;
      auto step_at = [&](double e) { return roofline(q, d, oo, e, CommMode::hidden, balanced).step; };
      const double e = solve_efficiency(step_at, budget);
      std::printf("  (b) compute only, the router, eh_proj and head in %s%s, %s: ", bf16 ? "BF16" : "FP32",
                  bf16 ? (configured_bf16 ? " (as DeepSeek-V3 and as configured)" : " (as DeepSeek-V3)")
                       : (configured_bf16 ? "" : " (as configured)"),
                  balanced ? "stages balanced (each the stages' mean work)" : "the slowest stage setting the pace");
      if (e < 0) {
        std::printf("cannot be reached at any efficiency: at 1.0 the step takes %s\n", seconds_text(step_at(1.0)).c_str());
        continue;
      }
      const Roofline at = roofline(q, d, oo, e, CommMode::hidden, balanced);
      std::printf("efficiency %.3f (%s); per step %d x %s per micro-batch (compute %s, memory-bound %s) + bubble %s "
                  "(%s, as configured) + optimizer %s\n",
                  e, verdict(e), L.micro_batches, seconds_text(at.compute_mb + at.memory_mb).c_str(),
                  seconds_text(at.compute_mb).c_str(), seconds_text(at.memory_mb).c_str(), seconds_text(at.bubble).c_str(),
                  L.v_shape || q.cfg.parallel.pipeline_schedule == PipelineSchedule::zb1p
                      ? schedule_text(q.cfg, L)
                      : (std::to_string(L.pipeline - 1) + " / " + std::to_string(L.micro_batches + L.pipeline - 1)).c_str(),
                  seconds_text(at.optimizer).c_str());
    }
  }
}

// --target-gpu-hours: the efficiency (of the device's peaks, all GEMMs and attention alike) at which
// the roofline's step time spends the target device-hours on --tokens, three ways: with fp8moe's
// own communication exposed, the same hidden behind compute where compute is longer (--overlap),
// and compute only (every byte hidden), the bubble always as configured. Where a way cannot reach
// the target at any efficiency, the parts the efficiency does not scale are printed instead.
void print_target(const PlanReport& rep) {
  const PlanOptions& o = rep.o;
  const Plan& p = rep.p;
  const Device& d = rep.d;
  const int world = rep.world;
  const double step_tokens = rep.step_tokens;
  const double steps = o.tokens / step_tokens;
  const double budget = step_budget_seconds(o.target_hours, o.tokens, step_tokens, world);
  std::printf("\nagainst %.4g %s-hours for %.4g tokens: %.6g steps of %.4g tokens on %d ranks leave %s per step\n",
              o.target_hours, d.name.c_str(), o.tokens, steps, step_tokens, world, seconds_text(budget).c_str());
  print_target_communication(rep, budget);
  print_target_compute(rep, budget);
  std::printf("  assumptions: the roofline above (one efficiency for every GEMM and the attention core, each at its own "
              "peak; the slowest stage sets the pipeline's pace unless `stages balanced`); train.recompute %s as configured "
              "(the recomputed forwards are compute; DeepSeek-V3 recomputed only selected cheap ops: --set "
              "train.recompute=none for that bound); (b) hides all tp/ep/pp/dp/edp bytes (DeepSeek-V3 reports DualPipe "
              "overlapping its all-to-all, FP8 dispatch and node-limited routing); this config's tokens per step for "
              "the whole run (DeepSeek-V3 ramped its batch up).\n",
              to_string(p.cfg.train.recompute).data());
}

// Which stage sets the pace, and every stage's time per micro-batch on one rank beside the stages'
// mean: what the others would need to lose or could take on.
void print_stage_times(const PlanReport& rep) {
  const Plan& p = rep.p;
  const Roofline& r = rep.r;
  const StageSplit split = p.cfg.parallel.stage_layers.split;
  if (p.mem.size() < 2 || r.stages.size() != p.mem.size()) return;
  std::printf("  stage %d sets the pace: %.2fx the stages' mean time per micro-batch (parallel.stage_layers %s)\n",
              r.pace_stage, r.pace_ratio,
              split == StageSplit::even ? "even" : split == StageSplit::balanced ? "balanced" : "given");
  // (parallel.pair_micro_batches: each stage's total less what its pairs hide, per micro-batch.)
  bool paired = false;
  double mean = 0;
  for (const Roofline::StageTime& t : r.stages) mean += (t.t - t.paired) / double(r.stages.size()), paired |= t.paired > 0;
  std::printf("  per stage, a micro-batch on one rank (ms; communication %s, ep's hidden part apart%s):\n",
              rep.o.overlap ? "all of it, the total its larger of compute + memory and it (--overlap)" : "exposed",
              paired ? "; pairs: what the stage's pairs hide of it, on average" : "");
  std::printf("    stage  blocks          compute   memory    comm   ep hidden%s     total  / mean\n", paired ? "    pairs" : "");
  for (size_t s = 0; s < r.stages.size(); ++s) {
    const Roofline::StageTime& t = r.stages[s];
    char pairs_col[32] = "";
    if (paired) std::snprintf(pairs_col, sizeof pairs_col, " %8.3f", -t.paired * 1e3);
    std::printf("    %5zu  %-14s %8.3f %8.3f %7.3f %11.3f%s %9.3f  %5.2f%s\n", s, stage_blocks_text(p.mem[s]).c_str(),
                t.compute * 1e3, t.memory * 1e3, t.comm * 1e3, t.ep_hidden * 1e3, pairs_col,
                (t.t - t.paired) * 1e3, mean > 0 ? (t.t - t.paired) / mean : 1.0, int(s) == r.pace_stage ? "  the pace" : "");
  }
}

// The step as the CPU's probe models measured it.
void print_measured_step(const PlanReport& rep) {
  const Plan& p = rep.p;
  const Device& d = rep.d;
  const Config& c = p.cfg;
  const PlanLayout& L = p.L;
  const Roofline& r = rep.r;
  const double eff = rep.eff, step_tokens = rep.step_tokens;
  const CpuProbe& q = d.probe;
  const ModelConfig& g = c.model;
  const int Ld = std::min(g.first_dense_layers, g.n_layers), Lm = g.n_layers - Ld;
  std::printf("\nstep time (measured on this CPU: %d probe models of this config's blocks, trained 1 + 7 steps "
              "of two micro-batches each, interleaved, on `train`'s backend; each probe's fastest step):\n", q.probes);
  if (L.world == 1) {
    std::printf("  per micro-batch (forward + backward, the FP8 weights already quantized): probe A (%d dense + %d MoE "
                "block%s, embedding, head, loss) %s",
                q.dense_in_a, q.moe_in_a, q.dense_in_a + q.moe_in_a == 1 ? "" : "s", seconds_text(q.cached.a).c_str());
    if (Ld > q.dense_in_a) std::printf(" + %d x dense block %s", Ld - q.dense_in_a, seconds_text(q.cached.dense).c_str());
    if (Lm > q.moe_in_a) std::printf(" + %d x MoE block %s", Lm - q.moe_in_a, seconds_text(q.cached.moe).c_str());
    if (g.mtp_depth > 0) std::printf(" + %d x MTP module %s", g.mtp_depth, seconds_text(q.cached.mtp).c_str());
    std::printf(" = %s%s\n", seconds_text(r.compute_mb).c_str(), eff != 1 ? " (/ --efficiency)" : "");
    std::printf("  x %d micro-batches + the FP8 weights' quantization at first use %s + optimizer (zero_grads, norm, "
                "AdamW) %s = %s per step\n",
                L.micro_batches, seconds_text(r.quantize).c_str(), seconds_text(r.optimizer).c_str(),
                seconds_text(r.step).c_str());
  } else {
    // Several ranks: the pace stage's blocks at the probes' times, its messages at the memory
    // bandwidth (ranks of one machine).
    const std::string head =
        p.mem[size_t(r.pace_stage)].head
            ? std::string(", with the work outside the blocks (embedding, head, loss: all of it on the head's stage)") +
                  (c.model.mtp_depth > 0 && p.mem[size_t(r.pace_stage)].last ? " and the modules" : "")
            : "";
    const std::string shards =
        L.tensor > 1 ? ", a tensor-parallel rank's shards: 1/" + std::to_string(L.tensor) +
                           " of the heads, the MLP and expert widths and the vocabulary"
                     : "";
    std::printf("  per micro-batch on %s%d (forward + backward, the FP8 weights already quantized; its blocks at the "
                "probes' times per block%s%s): %s%s; communication %s (tp, ep and pp bytes at the memory bandwidth%s)\n",
                p.mem.size() > 1 ? "stage " : "every rank, as on stage ", r.pace_stage, shards.c_str(),
                head.c_str(),
                seconds_text(r.compute_mb).c_str(), eff != 1 ? " (/ --efficiency)" : "", seconds_text(r.comm_mb).c_str(),
                rep.o.overlap ? ", behind compute: --overlap" : ", exposed");
    std::printf("  x %d micro-batches + bubble %s (%s) + dp/edp %s exposed of %s + the FP8 weights' quantization at "
                "first use %s + optimizer (zero_grads, norm, AdamW; its owned share) %s = %s per step\n",
                L.micro_batches, seconds_text(r.bubble).c_str(), schedule_text(c, L), seconds_text(r.dp_exposed).c_str(),
                seconds_text(r.dp).c_str(), seconds_text(r.quantize).c_str(), seconds_text(r.optimizer).c_str(),
                seconds_text(r.step).c_str());
    print_stage_times(rep);
  }
  std::printf("  %.0f tokens/s. The probes' tokens: %s. Not in it: the step's data loading, loss and load "
              "read-backs and logging\n",
              step_tokens / r.step, q.real_data ? "the config's data.path (routed as training routes them)"
                                                : "uniformly random (data.path unreadable: real text routes less evenly)");
}

// The step as the roofline models it, and what it assumes.
void print_roofline_step(const PlanReport& rep) {
  const PlanOptions& o = rep.o;
  const Plan& p = rep.p;
  const Device& d = rep.d;
  const Config& c = p.cfg;
  const PlanLayout& L = p.L;
  const Roofline& r = rep.r;
  const int world = rep.world;
  const double eff = rep.eff, step_tokens = rep.step_tokens, model_flops = rep.model_flops;
  std::printf("\nstep time (roofline, %s):\n", d.name.c_str());
  std::printf("  per micro-batch on the slowest stage: compute %s, memory-bound %s, communication %s%s\n",
              seconds_text(r.compute_mb).c_str(), seconds_text(r.memory_mb).c_str(), seconds_text(r.comm_mb).c_str(),
              o.overlap             ? " (hidden behind compute: --overlap)"
              : r.ep_hidden_mb > 0 ? (" (exposed; ep's " + seconds_text(r.ep_hidden_mb) +
                                      " more behind the MoE layers' shared experts and the experts' weight gradients)").c_str()
                                   : " (exposed)");
  if (r.pair_hidden > 0)
    std::printf("  parallel.pair_micro_batches: each of the %d pairs hides %s of ep behind its other pass\n",
                r.pairs, seconds_text(r.pair_hidden).c_str());
  std::printf("  x %d micro-batches%s + bubble %s + dp/edp %s%s + optimizer %s = %s per step\n", L.micro_batches,
              r.pair_hidden > 0 ? " (less the pairs')" : "", seconds_text(r.bubble).c_str(), seconds_text(r.dp_exposed).c_str(),
              o.overlap ? " (the rest overlapped: --overlap)"
              : r.dp_exposed < r.dp ? (" exposed of " + seconds_text(r.dp) + " (optim.overlap_grad_reduce: the reduce-scatter behind the last backward)").c_str()
                                    : "",
              seconds_text(r.optimizer).c_str(), seconds_text(r.step).c_str());
  print_stage_times(rep);
  const double tps = step_tokens / r.step;
  std::printf("  %.0f tokens/s, MFU %.3f of the %s peak\n", tps, tps * model_flops / (world * (c.fp8.recipe != Fp8Recipe::off ? d.fp8 : d.fp32)),
              c.fp8.recipe != Fp8Recipe::off ? "FP8" : "FP32");
  const bool hp16 = c.train.hp_gemm == GemmDtype::bf16;
  std::printf("  assumptions: GEMMs at %.2f of %s: FP8 %.4g FLOP/s for the linear layers fp8.layers runs in FP8, %s %.4g "
              "for the others (%severy linear layer with recipe off), attention core %.4g "
              "(%s); memory-bound traffic 4 x the activations kept per micro-batch plus AdamW's and the FP8 "
              "weights' bytes, at %.4g B/s; communication at %s; uniform routing; %s with the slowest stage "
              "setting the pace; no kernel-launch or host overhead%s.\n",
              eff, d.cpu ? "the rates measured here" : "the peaks", d.fp8, o.higher_precision.c_str(),
              o.higher_precision == "bf16" ? d.bf16 : d.fp32,
              hp16 ? "" : "router, eh_proj, head; ", d.attention, d.cpu ? "measured" : "the BF16 peak", d.hbm,
              d.cpu ? "the memory bandwidth (ranks of one machine)"
                    : ("NVLink " + bytes_text(d.nvlink) + "/s inside a node of " + std::to_string(o.node_size) +
                       ", InfiniBand " + bytes_text(d.ib) + "/s per GPU across nodes")
                          .c_str(),
              schedule_text(c, L), hp16 ? "; the router, eh_proj and head at the BF16 peak (train.hp_gemm bf16)" : "");
}

}  // namespace

PlanReport make_report(const PlanOptions& o, const Plan& p, const Device& d, int world) {
  const Config& c = p.cfg;
  const double eff = o.efficiency > 0 ? o.efficiency : d.cpu ? 1.0 : 0.4;
  const double baseline = d.cpu ? (o.baseline_bytes >= 0 ? o.baseline_bytes : kCpuProcessBaseline) + kCpuLibraryHeap : 0;
  return PlanReport{.o = o,
                    .p = p,
                    .d = d,
                    .world = world,
                    .eff = eff,
                    .baseline = baseline,
                    .model_flops = model_flops_per_token(c.model, c.train.seq_len),
                    .step_tokens = double(c.train.global_batch) * double(p.L.seq_len),
                    .r = roofline(p, d, o, eff)};
}

void print_layout(const PlanReport& rep) {
  const PlanOptions& o = rep.o;
  const Device& d = rep.d;
  const Config& c = rep.p.cfg;
  const PlanLayout& L = rep.p.L;
  const int world = rep.world;
  std::printf("fp8moe plan: %s on %d rank%s%s (device %s)\n", o.config_path.c_str(), world, world == 1 ? "" : "s",
              o.world > 0 ? "" : " (the config's tensor x pipeline x expert: --world sets more)", d.name.c_str());
  std::printf("layout: tensor %d, pipeline %d, expert %d, data %d (expert-data %d), %d micro-batches of %lld sequence%s "
              "x %lld tokens per replica; %lld tokens per step\n\n",
              L.tensor, L.pipeline, L.expert, L.data, L.expert_data, L.micro_batches, (long long)L.sequences,
              L.sequences == 1 ? "" : "s", (long long)L.seq_len, (long long)c.train.global_batch * L.seq_len);
  std::printf("%s\n", param_count_table(c.model).c_str());
}

void print_flops(const PlanReport& rep) {
  const Plan& p = rep.p;
  const PlanLayout& L = p.L;
  double executed = 0;
  for (const StageFlops& f : p.flops) executed += f.total();
  executed *= double(L.tensor) * L.data * L.micro_batches;  // every rank of every stage
  std::printf("\nFLOPs per token (forward + backward, attention included): %.4g model (the MFU's numerator); "
              "%.4g run (recomputation, tensor-parallel replicated work, %s router and head included)\n",
              rep.model_flops, executed / rep.step_tokens, p.cfg.train.hp_gemm == GemmDtype::bf16 ? "BF16" : "FP32");
}

void print_memory(const PlanReport& rep) {
  const PlanOptions& o = rep.o;
  const Plan& p = rep.p;
  const Device& d = rep.d;
  const Config& c = p.cfg;
  const PlanLayout& L = p.L;
  const int world = rep.world;
  const double baseline = rep.baseline;
  std::printf("\n");
  print_memory_table(p, d, baseline);
  const StageMemory* worst = &p.mem[0];
  for (const StageMemory& s : p.mem)
    if (s.total() > worst->total()) worst = &s;
  std::printf("  ZeRO-1 (optim.zero %d): moments of %lld dense elements over %d data replica%s and %lld expert elements "
              "over %d expert-data replica%s; moments %s; recompute %s; fp8.recipe %s; activations %s\n",
              c.optim.zero, (long long)worst->dense_trainable, L.data, L.data == 1 ? "" : "s",
              (long long)worst->expert_trainable, L.expert_data, L.expert_data == 1 ? "" : "s",
              to_string(c.train.moments_dtype).data(), to_string(c.train.recompute).data(), to_string(c.fp8.recipe).data(),
              to_string(c.train.activations).data());
  std::printf("  %s limit: %s%s\n", d.cpu ? "RAM" : "device memory", bytes_text(d.memory).c_str(),
              d.cpu ? " (processes of one machine share it: all ranks' RSS together count)" : "");
  if (d.cpu) {
    double all = 0;
    for (const StageMemory& s : p.mem) all += (s.total() + baseline) * L.tensor * L.data;
    std::printf("  RSS = tensors + the process %s (%s) + the libraries' heap %s (measured: app/plan_devices.cpp); not "
                "modelled: the freed tensor memory glibc's heap keeps, which takes the peak RSS 1.4-1.8x above this "
                "after 10-15 steps (README \"Planning a run\")\n",
                bytes_text(baseline - kCpuLibraryHeap).c_str(), o.baseline_bytes >= 0 ? "--baseline-bytes" : "measured",
                bytes_text(kCpuLibraryHeap).c_str());
    std::printf("  all %d ranks together: %s\n", world, bytes_text(all).c_str());
  }
}

void print_communication(const PlanReport& rep) {
  const Plan& p = rep.p;
  const PlanLayout& L = p.L;
  const Roofline& r = rep.r;
  std::printf("\ncommunication per step (the slowest stage's rank; the analytical formulas of README \"Communication\"):\n"
              "  group  bytes/rank   all ranks       time\n");
  for (int g = 0; g < 5; ++g) {
    double all = 0;
    for (size_t s = 0; s < p.comm.size(); ++s) all += p.comm[s][size_t(g)] * L.tensor * L.data;
    double rank = 0;
    for (const auto& cs : p.comm) rank = std::max(rank, cs[size_t(g)]);
    if (all > 0)
      std::printf("  %-5s  %10s  %10s  %9s\n", kCommGroupNames[g], bytes_text(rank).c_str(), bytes_text(all).c_str(),
                  seconds_text(r.comm_s[size_t(g)]).c_str());
  }
  if (L.expert > 1)
    std::printf("  ep: uniform routing, tokens x top_k x (1 - 1/%d) rows leave each rank; %s\n", L.expert,
                expert_rows_text(p.cfg).c_str());
  if (!p.ep_across.empty()) {
    double across = 0;
    for (double a : p.ep_across) across = std::max(across, a);
    if (p.relay_nodes > 0)
      std::printf("  ep across nodes (InfiniBand): %s per rank; the relay (runtime.node_dedup) sends a token's row "
                  "to each other node among its experts' once and sums their rows there before they cross back: %.2f "
                  "other nodes per token%s, against %.2f rows per token one row per expert\n",
                  bytes_text(across).c_str(), p.relay_nodes,
                  p.node_limited ? " (node-limited routing: model.moe.topk_group groups)" : "",
                  p.rows_across);
    else
      std::printf("  ep across nodes (InfiniBand): %s per rank, one row per expert on another node (%.2f per token; "
                  "runtime.node_dedup false)\n",
                  bytes_text(across).c_str(), p.rows_across);
  }
  if (L.data > 1)
    std::printf("  dp, edp: %s\n", p.cfg.optim.grad_reduce == ReduceDtype::bf16
                                        ? "the gradients' reduce-scatter in BF16 (optim.grad_reduce bf16), the "
                                          "all-gather in FP32: 0.75 of the FP32 bytes"
                                        : "the gradients' reduction and the all-gather in FP32 (optim.grad_reduce fp32)");
}

void print_bubble(const PlanReport& rep) {
  const PlanLayout& L = rep.p.L;
  if (L.v_shape) {
    const bool paired = rep.p.cfg.parallel.pair_micro_batches;
    const double idle = dualpipev_idle(L.pipeline, L.micro_batches, 1, 2, paired);
    std::printf("\npipeline bubble (DualPipeV as fp8moe runs it: %s, W = 0; simulated in chunk times with B = 2F): "
                "%.0f F idle against 2m(F + B) = %d F busy = %.3f (the step time below simulates the pace rank's own "
                "forward and backward%s)\n",
                paired ? "its F&B ops as pairs, here hiding nothing" : "its F&B's backward, then its forward", idle,
                6 * L.micro_batches, idle / (idle + 6.0 * L.micro_batches),
                paired ? ", and what its pairs hide" : "");
    return;
  }
  if (rep.p.cfg.parallel.pipeline_schedule == PipelineSchedule::zb1p) {
    const double idle = zb1p_idle(L.pipeline, L.micro_batches, 1, 1, 1);
    std::printf("\npipeline bubble (ZB1P): (p - 1)(F + B - 2W), B a whole backward, W its weight part: with F = 1, "
                "B = 2, W = 1, %.0f idle against 3m = %d busy = %.3f (the step time below simulates the pace stage's "
                "own: its weight op %.3f ms a micro-batch, the blocks' linear layers' weight-gradient GEMMs)\n",
                idle, 3 * L.micro_batches, idle / (idle + 3.0 * L.micro_batches), rep.r.weight_op_mb * 1e3);
    return;
  }
  const double bubble = one_f_one_b_bubble(L.pipeline, L.micro_batches);
  std::printf("\npipeline bubble (1F1B): (p - 1) / (m + p - 1) = %d / %d = %.3f\n", L.pipeline - 1,
              L.micro_batches + L.pipeline - 1, bubble);
}

void print_step_time(const PlanReport& rep) {
  if (rep.r.measured) print_measured_step(rep);
  else print_roofline_step(rep);
  std::printf("  device: %s\n", rep.d.basis.c_str());
}

void print_tokens(const PlanReport& rep) {
  const PlanOptions& o = rep.o;
  const int world = rep.world;
  const double step_tokens = rep.step_tokens;
  const double hours = o.tokens / step_tokens * rep.r.step * world / 3600;
  std::printf("\n%.4g tokens: %.4g steps, %.4g %s-hours (%.4g days on %d)\n", o.tokens, o.tokens / step_tokens, hours,
              rep.d.name.c_str(), hours / world / 24, world);
  if (o.target_hours > 0) print_target(rep);
}

void print_summary(const PlanReport& rep) {
  // One line for scripts (bench/plan-vs-measured.sh): the worst rank's tensors, with the
  // process baseline (cpu), and the step time.
  std::printf("\nsummary: rank_bytes %.6g  rss_bytes %.6g  step_s %.6g\n", rep.p.worst_total(), rep.p.worst_total() + rep.baseline,
              rep.r.step);
}

// What FP8 changes in the memory of the worst rank: the config's recipe, fp8moe with recipe off
// (FP32 GEMMs and FP32 activations: what it runs without FP8), and a model of BF16 mixed-precision
// training (Megatron-style: BF16 weights beside FP32 master weights and FP32 gradients, the
// activations of the recipe-off run in BF16, no FP8 copies).
void print_fp8_savings(const Config& c, int world) {
  Config off = c;
  off.fp8.recipe = Fp8Recipe::off;
  off.train.activations = ActivationDtype::fp32;  // the FP32 run; the BF16 model halves its activations
  const Plan a = make_plan(c, world), b = make_plan(off, world);
  size_t worst = 0;
  for (size_t s = 0; s < a.mem.size(); ++s)
    if (a.mem[s].total() > a.mem[worst].total()) worst = s;
  const StageMemory &x = a.mem[worst], &y = b.mem[worst];
  std::printf("\nwhat FP8 saves, rank of stage %zu (GB per rank; the claim to check: FP8 halves the memory):\n", worst);
  std::printf("  component                 %-12s  recipe off (FP32)  BF16 model  FP8 vs BF16\n", to_string(c.fp8.recipe).data());
  auto row = [](const char* name, double fp8, double fp32, double bf16) {
    std::printf("  %-24s  %10.2f  %17.2f  %10.2f  %+10.2f\n", name, fp8 / 1e9, fp32 / 1e9, bf16 / 1e9, (fp8 - bf16) / 1e9);
  };
  const double w16 = double(x.held) * 2;
  row("weights (FP32 master)", x.weights, y.weights, y.weights);
  row("weights (BF16 copy)", 0, 0, w16);
  row("FP8 weight copies", x.fp8_weights + x.fp8_state, 0, 0);
  row("gradients (FP32)", x.grads, y.grads, y.grads);
  row("Adam moments", x.moments, y.moments, y.moments);
  row("activations (in flight)", x.activations, y.activations, y.activations / 2);
  row("workspace", x.workspace, y.workspace, y.workspace / 2);
  const double bf16 = y.weights + w16 + y.grads + y.moments + (y.activations + y.workspace) / 2;
  row("total", x.total(), y.total(), bf16);
  std::printf("  FP8 / recipe off: %.2f; FP8 / BF16 model: %.2f. FP8 changes the activations a linear layer keeps\n"
              "  (its input in FP8 instead of FP32) and adds the step's FP8 weight copies; train.activations %s\n"
              "  keeps the other activations in %s; the master weights, gradients and moments are the\n"
              "  optimizer's and stay as they are; the step's temporaries stay FP32.\n",
              x.total() / y.total(), x.total() / bf16, to_string(c.train.activations).data(),
              c.train.activations == ActivationDtype::bf16 ? "BF16" : "FP32");
}

void print_misfit(const PlanReport& rep) {
  const double need = rep.p.worst_total() + rep.baseline;
  std::printf("\nWARNING: a rank needs %s, more than the %s of %s.\n", bytes_text(need).c_str(),
              bytes_text(rep.d.memory).c_str(), rep.d.name.c_str());
}

void print_fits(const PlanReport& rep, const std::vector<Candidate>& fits, const std::string& searched) {
  const int world = rep.world;
  std::printf("searched, on the same %d ranks, one key changed, then two (each candidate validated as `train` would):\n%s",
              world, searched.c_str());
  if (fits.empty()) {
    std::printf("no layout within two changes fits\n");
  } else {
    std::printf("nearest layouts that fit (fewest changes, then the fastest step):\n");
    for (size_t i = 0; i < std::min<size_t>(5, fits.size()); ++i) {
      std::printf("  ");
      for (const std::string& s : fits[i].sets) std::printf("--set %s ", s.c_str());
      std::printf(" -> %s per rank, %s per step\n", bytes_text(fits[i].memory).c_str(), seconds_text(fits[i].step).c_str());
    }
  }
}

}  // namespace fp8moe::plan_detail
