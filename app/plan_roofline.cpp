// The plan of one config on a layout (memory, FLOPs and communication bytes per stage, from
// model/plan_model.h) and its time model: the roofline of a step on a device (compute at a
// fraction of the peaks, memory-bound traffic, communication over NVLink or InfiniBand, the 1F1B
// bubble, the optimizer), or on the CPU the probe models' measured times.
#include <algorithm>
#include <array>
#include <cmath>
#include <map>
#include <tuple>

#include "app/plan_parts.h"
#include "model/placement.h"
#include "parallel/pipeline_schedule.h"

namespace fp8moe::plan_detail {
namespace {

// The link a group's traffic takes: NVLink when the group's ranks lie in one node (the grid orders
// ranks tensor fastest, then expert, then the rest of data, then pipeline: parallel/grid.h), else
// InfiniBand. ep's all-to-all: the share of its peers inside the node over NVLink, the rest over IB.
struct GroupLink {
  double span = 1, size = 1;
};
// across: of ep's bytes, those that cross nodes where the plan counted them (else < 0: by the share).
double comm_seconds(const Device& d, const PlanOptions& o, const PlanLayout& L, int group, double bytes,
                    double across = -1) {
  if (bytes <= 0) return 0;
  if (d.cpu) return bytes / d.hbm;  // ranks of one machine: MPI through shared memory
  const double node = o.node_size;
  GroupLink g;
  switch (group) {
    case 0: g = {double(L.tensor), double(L.tensor)}; break;
    case 1: g = {double(L.tensor) * L.expert, double(L.expert)}; break;
    case 2: g = {double(L.tensor) * L.data, double(L.data)}; break;
    case 3: g = {double(L.tensor) * L.data, double(L.expert_data)}; break;
    default: g = {double(L.world), double(L.pipeline)}; break;
  }
  if (g.span <= node) return bytes / d.nvlink;
  if (group == 1 && across >= 0) return (bytes - across) / d.nvlink + across / d.ib;
  if (group == 1) {
    const double in_node = std::max(0.0, node / L.tensor - 1) / std::max(1.0, g.size - 1);
    return bytes * in_node / d.nvlink + bytes * (1 - in_node) / d.ib;
  }
  return bytes / d.ib;
}

// The expected number of distinct nodes among a token's experts, of G nodes holding the experts in
// equal consecutive shares, under uniform routing: node-limited routing whose groups lie within
// nodes chooses topk_group groups of n_group (every chosen group given an expert, an upper bound);
// otherwise top_k experts of n_experts. 1 - C(a - b, t) / C(a, t) is the chance that one node is
// among them.
// Whether node-limited routing's groups lie within the G nodes (whole groups per node).
bool groups_within_nodes(const MoeConfig& moe, double G) {
  return moe.n_group > 1 && moe.topk_group < moe.n_group && G == std::floor(G) && moe.n_group % int(G) == 0;
}
double nodes_per_token(const MoeConfig& moe, double G) {
  auto missed = [](double a, double b, double t) {
    double r = 1;
    for (int i = 0; i < int(t); ++i) r *= std::max(0.0, a - b - i) / (a - i);
    return r;
  };
  return groups_within_nodes(moe, G) ? G * (1 - missed(moe.n_group, moe.n_group / G, moe.topk_group))
                                     : G * (1 - missed(moe.n_experts, moe.n_experts / G, moe.top_k));
}

// fp8moe's expert exchange behind the MoE layer's own compute (runtime.overlap_expert_comm,
// model/moe.cpp): the forward's
// dispatch posted while the shared experts' forward runs (again where train.recompute runs the
// layer again), the backward's dispatch while their backward runs, and its combine while the
// routed experts' weight-gradient GEMMs run; the forward's combine, and the relay's exchange inside
// the node (runtime.node_dedup: the rows it forwards), in line. Of ep_mb, the stage's ep seconds
// per micro-batch, the seconds hidden so: each exchange's share of the rows' bytes (the relay's
// forwarded rows taken out first), up to the compute behind it, per MoE layer. Not on the CPU:
// MPI moves a posted exchange there only inside MPI calls (no progress thread).
double ep_hidden_seconds(const Plan& p, size_t s, const Device& d, double eff, double ep_mb, double inline_mb) {
  const Config& c = p.cfg;
  const ModelConfig& m = c.model;
  const StageMemory& st = p.mem[s];
  const double moe_layers = stage_moe_blocks(m, st);
  if (d.cpu || !c.runtime.overlap_expert_comm || ep_mb <= 0 || moe_layers <= 0) return 0;
  const ExpertRowBytes rb = expert_row_bytes(m.d_model, c.fp8.recipe == Fp8Recipe::off ? nullptr : &c.fp8,
                                             c.train.activations, c.train.moe_gates);
  const double again = p.moe_again[s];  // the share of the stage's MoE layers run again
  const double rows = rb.per_step(again);
  // Per layer: each exchange's seconds (the gates' 4 bytes out go with the dispatch, their 8 back
  // with the backward's combine).
  const double posted = std::max(0.0, ep_mb - inline_mb) / moe_layers / rows;
  const double fwd_dispatch = posted * (rb.dispatch + rb.gates / 3), grad_dispatch = posted * rb.grad_dispatch,
               grad_combine = posted * (rb.grad_combine + 2 * rb.gates / 3);
  // The compute behind them, per layer on one rank: 2 x rows x 3 x D x width FLOPs a forward.
  const double N = double(p.L.tokens()), D = m.d_model, T = p.L.tensor;
  const bool fp8 = c.fp8.recipe != Fp8Recipe::off;
  const double shared_peak = eff * (fp8 && c.fp8.layers.shared_experts ? d.fp8 : d.fp32);
  const double routed_peak = eff * (fp8 && c.fp8.layers.experts ? d.fp8 : d.fp32);
  const double shared_fwd = 2 * N * 3 * D * double(m.moe.n_shared_experts) * m.moe.d_expert / T / shared_peak;
  const double routed_fwd = 2 * N * m.moe.top_k * 3 * D * double(m.moe.d_expert) / T / routed_peak;  // = its wgrad
  // (ZB1P leaves the experts' weight-gradient GEMMs here, behind the exchanges: zb1p_weight_op.)
  return moe_layers * ((1 + again) * std::min(fwd_dispatch, shared_fwd) + std::min(grad_dispatch, 2 * shared_fwd) +
                       std::min(grad_combine, routed_fwd));
}

// DualPipeV's idle time as fp8moe runs it, over a rank's time per micro-batch (its two chunks'
// forward and backward), the backward taking `backward` of it: simulated once per shape. hidden
// (parallel.pair_micro_batches): the share of it each F&B op hides, run as a pair (dualpipev()'s
// ops with W = 0: a deferred backward whole, a weight op empty, as dualpipev_as_run's paired ops).
double dualpipev_idle_share(int P, int M, double backward, double hidden = -1) {
  static std::map<std::tuple<int, int, double, double>, double> known;
  const auto key = std::make_tuple(P, M, backward, hidden);
  if (auto it = known.find(key); it != known.end()) return it->second;
  const double f = (1 - backward) / 2, b = backward / 2;
  return known[key] = dualpipev_idle(P, M, f, b, hidden >= 0, std::max(0.0, hidden));
}

}  // namespace

Plan make_plan(const Config& c, int world, int node_size) {
  Plan p;
  p.cfg = c;
  p.L = plan_layout(c, world);
  p.mem = plan_memory(c, p.L);
  p.flops = plan_flops(c, p.L);
  const ModelConfig& m = c.model;
  for (const StageMemory& s : p.mem) {
    CommShape sh;
    sh.model = &c.model;
    sh.tensor = p.L.tensor, sh.expert = p.L.expert, sh.data = p.L.data, sh.expert_data = p.L.expert_data;
    sh.pipeline = p.L.pipeline;
    sh.tokens = double(p.L.tokens()), sh.micro_batches = p.L.micro_batches;
    sh.first = s.first, sh.last = s.last, sh.layer_begin = s.layer_begin, sh.layer_end = s.layer_end;
    sh.mtp_alone = p.L.mtp_alone, sh.head = s.head, sh.head_alone = last_chunk_head_alone(p.L.split, p.L.mtp_alone);
    sh.v_shape = s.v_shape, sh.turn = s.v_shape && s.stage == p.L.pipeline - 1;
    sh.layer_begin2 = s.layer_begin2, sh.layer_end2 = s.layer_end2;
    sh.local_experts = m.moe.n_experts / p.L.expert;
    sh.dense_bytes = double(s.dense_trainable) * 4, sh.expert_bytes = double(s.expert_trainable) * 4;
    const double moe_layers = stage_moe_blocks(m, s);
    // Uniform routing: of a token's top_k rows, 1 / expert stay on this rank.
    sh.rows_off_rank = double(p.L.micro_batches) * moe_layers * sh.tokens * m.moe.top_k * (1.0 - 1.0 / p.L.expert);
    sh.fp8 = c.fp8.recipe == Fp8Recipe::off ? nullptr : &c.fp8, sh.activations = c.train.activations;
    sh.grad_reduce = c.optim.grad_reduce, sh.moe_gates = c.train.moe_gates, sh.recompute = c.train.recompute;
    sh.recompute_layers = &c.train.recompute_layers;
    // Nodes: the grid orders ranks tensor fastest, then expert (parallel/grid.h), so a node holds
    // node_size / tensor consecutive ranks of an expert group, and the group spans G nodes. Of a
    // token's rows (uniform routing), those to other nodes' experts cross; with the relay its
    // per-token exchanges cross once per other node among its experts', and go on in that node
    // unless the relay holds the expert.
    const double per_node = std::clamp(double(node_size / p.L.tensor), 1.0, double(p.L.expert));
    const double G = double(p.L.expert) / per_node, plans = double(p.L.micro_batches) * moe_layers;
    sh.rows_off_node = plans * sh.tokens * m.moe.top_k * (1.0 - per_node / p.L.expert);
    sh.relay = c.runtime.node_dedup && G > 1;
    if (G > 1) p.rows_across = m.moe.top_k * (1.0 - per_node / p.L.expert);
    if (sh.relay) {
      p.relay_nodes = nodes_per_token(m.moe, G) * (G - 1) / G, p.node_limited = groups_within_nodes(m.moe, G);
      sh.relay_across = plans * sh.tokens * p.relay_nodes;
      sh.relay_forwarded = sh.rows_off_node * (1 - 1 / per_node);
      sh.remote_ranks = int(p.L.expert - per_node);
    }
    p.comm.push_back(analytic_comm_bytes(sh));
    p.moe_again.push_back(recomputed_moe_share(sh));
    if (G > 1) {
      // The rows across nodes, and the counts to other nodes' ranks (with the relay's two numbers)
      // and its map.
      const double counts = plans * (p.L.expert - per_node) * (sh.local_experts + (sh.relay ? 2 : 0)) * 8;
      const double map = sh.relay ? 4 * (plans * sh.remote_ranks + sh.rows_off_node) : 0;
      p.ep_across.push_back(expert_rows_by_node(sh)[1] + counts + map);
      if (sh.relay) {
        const ExpertRowBytes rb = expert_row_bytes(m.d_model, sh.fp8, sh.activations, sh.moe_gates);
        p.ep_forwarded.push_back(sh.relay_forwarded * rb.relayed(p.moe_again.back()));
      }
    }
  }
  return p;
}

Roofline roofline(const Plan& p, const Device& d, const PlanOptions& opts, double eff, CommMode mode, bool balanced) {
  PlanOptions o = opts;
  if (mode == CommMode::exposed) o.overlap = false;
  if (mode == CommMode::overlapped) o.overlap = true;
  const bool hidden = mode == CommMode::hidden;
  const Config& c = p.cfg;
  const PlanLayout& L = p.L;
  const double hp = o.higher_precision == "bf16" ? d.bf16 : d.fp32;
  Roofline r;
  const CpuProbe& q = d.probe;
  // On the CPU: each stage's micro-batch, quantization and optimizer from the probes' times of its
  // blocks (the efficiency scales the micro-batches' work); its communication at the memory
  // bandwidth (comm_seconds).
  const bool probed = d.cpu && q.valid && c.train.recompute == q.recompute && c.train.recompute_layers.empty() &&
                      L.tokens() == q.tokens && L.tensor == q.tensor && (L.pipeline == 1 || q.per_block);
  r.measured = probed;
  // (The probes' optimizer and quantization: the whole model's, shared out by parameters.)
  double all_params = 0;
  for (const StageMemory& m : p.mem) all_params += double(m.dense_trainable) + double(m.expert_trainable) * L.expert;
  double slowest = -1, sum_compute = 0, sum_memory = 0, sum_t = 0, backward_share = 0, weight_s = 0;
  std::vector<OpTimes> stage_times;  // each stage's ops' times (ZB1P, pairs)
  // parallel.pair_micro_batches: the exchanges a micro-batch leaves exposed hidden behind the other
  // pass of a pair, up to its compute (a quarter of them per chunk pass under DualPipeV, half of
  // a micro-batch's in each F&B). Not on the CPU (MPI progresses a posted exchange only inside
  // its calls). Each stage's own pairs: the pace is the slowest stage after them.
  const bool pairs = c.parallel.pair_micro_batches && !d.cpu && !hidden && !o.overlap;
  auto pairs_of = [&](int s) {
    int n = 0;
    if (!L.v_shape) return L.micro_batches - 1;
    for (const DualOp& op : dualpipev(L.pipeline, s, L.micro_batches)) n += op.kind == DualOpKind::forward_backward ? 1 : 0;
    return n;
  };
  auto pair_hides = [&](double ep_exposed, double compute) {
    return L.v_shape ? std::min(ep_exposed / 2, compute / 2) : std::min(ep_exposed, compute);
  };
  double pace_pair_hidden = 0;
  int pace_pairs = 0;
  for (size_t s = 0; s < p.mem.size(); ++s) {
    const StageFlops& f = p.flops[s];
    // Memory-bound traffic (an estimate): every activation kept for backward is written in the
    // forward and read in the backward, and its gradient written and read once each. (The probes'
    // times hold their own.)
    const double compute = probed ? stage_seconds(c.model, p.mem[s], q.blocks(q.cached)) / eff
                                  : f.fp8_gemm / (eff * d.fp8) + f.hp_gemm / (eff * hp) + f.bf16_gemm / (eff * d.bf16) +
                                        f.attention / (eff * d.attention);
    const double memory = probed ? 0 : 4 * p.mem[s].saved_per_micro_batch / d.hbm;
    sum_compute += compute, sum_memory += memory;
    double comm = 0;
    std::array<double, 5> per_group{};
    for (int g = 0; g < 5; ++g)
      per_group[size_t(g)] = comm_seconds(d, o, L, g, p.comm[s][size_t(g)], p.ep_across.empty() ? -1 : p.ep_across[s]);
    for (int g : {0, 1, 4}) comm += per_group[size_t(g)] / L.micro_batches;
    // The relay's in-node forwarding runs in line (ep_hidden_seconds): its rows at NVLink.
    double ep_hidden = 0;
    if (!hidden && !o.overlap) {
      const double inline_mb = p.ep_forwarded.empty() ? 0 : p.ep_forwarded[s] / d.nvlink / L.micro_batches;
      ep_hidden = ep_hidden_seconds(p, s, d, eff, per_group[1] / L.micro_batches, inline_mb);
    }
    comm -= ep_hidden;
    if (hidden) comm = 0;
    const double t = o.overlap ? std::max(compute + memory, comm) : compute + memory + comm;
    // Its pairs' share of a micro-batch's time (each pair hides up to pair_hides).
    double hide = 0, paired = 0;
    int n_pairs = 0;
    if (pairs) {
      hide = pair_hides(std::max(0.0, per_group[1] / L.micro_batches - ep_hidden), compute);
      n_pairs = pairs_of(int(s));
      paired = n_pairs * hide / L.micro_batches;
    }
    sum_t += t - paired;
    r.stages.push_back({compute, memory, comm, ep_hidden, t, paired});
    // The backward's share of the stage's work (the forward is a third of what is not
    // recomputed), and ZB1P's weight op: its GEMMs' seconds.
    const double bs = f.total() > 0 ? 1 - (f.total() - f.recompute) / (3 * f.total()) : 0;
    const double wsec = f.wgrad_fp8 / (eff * d.fp8) + f.wgrad_hp / (eff * hp) + f.wgrad_bf16 / (eff * d.bf16);
    const double w = std::min(wsec, bs * t);
    stage_times.push_back({(1 - bs) * t, bs * t - w, w});
    if (t - paired > slowest) {
      slowest = t - paired, r.pace_stage = int(s);
      pace_pair_hidden = hide, pace_pairs = n_pairs;
      backward_share = bs, weight_s = wsec;
      r.compute_mb = compute, r.memory_mb = memory, r.comm_mb = comm, r.comm_s = per_group, r.ep_hidden_mb = ep_hidden;
      r.dp = hidden ? 0 : per_group[2] + per_group[3];
      // AdamW on the owned rows: parameter, gradient (read), m and v (read and written), the
      // parameter written; then every FP8 weight read in FP32 and written in FP8 once per step.
      const StageMemory& m = p.mem[s];
      const double mb = c.train.moments_dtype == MomentsDtype::fp32 ? 4 : 2;
      const double owned = double(m.owned_dense + m.owned_expert);
      r.optimizer = (owned * (4 + 4 + 4 + 4 * mb) + m.fp8_weights * 5) / d.hbm;
      if (probed) {
        // The probes' whole model (every expert, no ZeRO shard, no stage split): the optimizer's
        // share of the parameters this rank owns (zero_grads and the norm run over those it holds:
        // under ZeRO-1 this is low), the quantization's of those it holds.
        const ModelConfig& g = c.model;
        const int Ld = std::min(g.first_dense_layers, g.n_layers), Lm = g.n_layers - Ld;
        const double whole = std::max(1.0, all_params);
        r.optimizer = q.of(q.optimizer, Ld, Lm, g.mtp_depth) * owned / whole;
        r.quantize = std::max(0.0, q.of(q.first, Ld, Lm, g.mtp_depth) - q.of(q.cached, Ld, Lm, g.mtp_depth)) / eff *
                     double(m.dense_trainable + m.expert_trainable) / whole;
      }
    }
  }
  r.pace_ratio = sum_t > 0 ? slowest / (sum_t / double(p.mem.size())) : 1;
  if (balanced) r.compute_mb = sum_compute / double(p.mem.size()), r.memory_mb = sum_memory / double(p.mem.size());
  const double per_mb = o.overlap ? std::max(r.compute_mb + r.memory_mb, r.comm_mb) : r.compute_mb + r.memory_mb + r.comm_mb;
  // 1F1B: (P - 1) x a stage's time per micro-batch. DualPipeV as it runs, simulated
  // (parallel/pipeline_schedule.h): a rank's two chunks of a micro-batch take per_mb = 2(F + B),
  // B the backward's share.
  // ZB1P: simulated with each stage's own forward, backward input part and weight op (the
  // blocks' linear layers' weight-gradient GEMMs: zb1p_weight_op), the pace stage's idle time (on
  // equal stages (P - 1)(F + B - 2W) for W <= F and 2W <= B); balanced, the pace stage's times on
  // every stage.
  const bool zb = c.parallel.pipeline_schedule == PipelineSchedule::zb1p;
  const double wop = zb ? std::min(weight_s, backward_share * per_mb) : 0;
  r.weight_op_mb = wop;
  // (The pace stage's pairs, from the loop above.)
  if (pairs) r.pair_hidden = pace_pair_hidden, r.pairs = pace_pairs;
  if (pairs && L.v_shape) {
    r.bubble = dualpipev_idle_share(L.pipeline, L.micro_batches, backward_share, r.pair_hidden / per_mb) * per_mb;
  } else if (L.v_shape) {
    r.bubble = dualpipev_idle_share(L.pipeline, L.micro_batches, backward_share) * per_mb;
  } else if (zb && L.pipeline > 1 && (balanced || o.overlap)) {
    r.bubble = zb1p_idle(L.pipeline, L.micro_batches, (1 - backward_share) * per_mb, backward_share * per_mb - wop, wop);
  } else if (zb && L.pipeline > 1) {
    r.bubble = pipeline_idle(L.micro_batches, true, false, stage_times)[size_t(r.pace_stage)];
  } else {
    r.bubble = (L.pipeline - 1) * per_mb;
  }
  // (One stage, 1F1B or ZB1P: each of the M - 1 pairs hides a micro-batch's.)
  double busy = L.micro_batches * per_mb;
  busy -= r.pairs * r.pair_hidden;
  if (o.overlap) {
    r.dp_exposed = std::max(0.0, r.dp - busy);
  } else if (c.optim.overlap_grad_reduce && c.optim.grad_reduce == ReduceDtype::fp32) {
    // fp8moe's overlap (model/data_parallel.h): each layer's reduction posted once the step's last
    // backward has passed it, so it runs behind the rest of that backward, at most one
    // micro-batch's backward; ZeRO-1's all-gather of the weights (half the bytes) follows the
    // optimizer, exposed. Without ZeRO the all-reduce is all of it.
    // (ZB1P: posted from the last weight op, behind the rest of it.)
    const double behind = c.optim.zero == 1 ? r.dp / 2 : r.dp;
    r.dp_exposed = r.dp - behind + std::max(0.0, behind - (zb ? wop : backward_share * r.compute_mb));
  } else {
    r.dp_exposed = r.dp;
  }
  r.step = busy + r.bubble + r.dp_exposed + r.quantize + r.optimizer;
  return r;
}

}  // namespace fp8moe::plan_detail
