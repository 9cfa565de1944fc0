#include "app/plan.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "app/exit_codes.h"
#include "app/step_report.h"
#include "io/config.h"
#include "kernels/attention.h"
#include "kernels/gemm_fp8.h"
#include "kernels/quantize.h"
#include "model/param_table.h"
#include "model/plan_model.h"

namespace fp8moe {
namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

// A device's peaks and memory. GPUs: dense (no sparsity) tensor-core peaks of the SXM parts.
// Sources: NVIDIA H100 datasheet (H100 SXM: FP8 1,979 TFLOPS, BF16 989, FP32 67, 80 GB HBM3 at
// 3.35 TB/s, NVLink 900 GB/s bidirectional); H200 datasheet (the same compute, 141 GB HBM3e at
// 4.8 TB/s); H800 SXM: the H100's compute and memory with NVLink cut to 400 GB/s bidirectional,
// of which DeepSeek-V3's report (arXiv 2412.19437, section 3.2) measures 160 GB/s per GPU, and
// 50 GB/s of InfiniBand per GPU; B200 (DGX B200 datasheet / Blackwell architecture brief: FP8
// 4.5 PFLOPS dense, BF16 2.25, FP32 75 TFLOPS, 180 GB HBM3e at 8 TB/s, NVLink 5 1.8 TB/s
// bidirectional). InfiniBand: one 400 Gb/s NDR port per GPU (50 GB/s), B200 one 800 Gb/s
// ConnectX-8 port (100 GB/s). Capacities in GiB: what a process can hold, not the marketing GB
// (an H100 80GB reports 81,559 MiB; the H200 lent to this project reports about 139 GiB free).
struct Device {
  std::string name, basis;
  double fp8 = 0, bf16 = 0, fp32 = 0;  // FLOP/s
  double attention = 0;                // the attention core's FLOP/s
  double memory = 0;                   // bytes one rank may hold
  double hbm = 0;                      // bytes/s
  double nvlink = 0, ib = 0;           // bytes/s per GPU and direction
  bool cpu = false;
};

Device gpu(const std::string& name) {
  Device d;
  d.name = name;
  if (name == "h100" || name == "h800" || name == "h200") {
    d.fp8 = 1979e12, d.bf16 = 989e12, d.fp32 = 66.9e12;
    d.memory = name == "h200" ? 139 * kGiB : 79.6 * kGiB;
    d.hbm = name == "h200" ? 4.8e12 : 3.35e12;
    d.nvlink = name == "h800" ? 160e9 : 450e9;
    d.ib = 50e9;
  } else if (name == "b200") {
    d.fp8 = 4.5e15, d.bf16 = 2.25e15, d.fp32 = 75e12;
    d.memory = 180e9, d.hbm = 8e12, d.nvlink = 900e9, d.ib = 100e9;
  }
  d.attention = d.bf16;
  d.basis = "datasheet dense peaks (see app/plan.cpp)";
  return d;
}

// ---- the CPU, measured --------------------------------------------------------------------------

double seconds_of(const std::function<void()>& fn, int reps) {
  fn();  // warm-up: page faults, oneDNN's primitive creation, OpenBLAS's buffers
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return best;
}

std::vector<float> filled(int64_t n, float scale) {
  std::vector<float> v(static_cast<size_t>(n));
  uint32_t s = 12345;
  for (float& x : v) s = s * 1664525u + 1013904223u, x = scale * (float(s >> 8) / float(1u << 24) - 0.5f);
  return v;
}

// The CPU backend's FP8 GEMM as the recipe runs it (kernels/cpu/gemm_fp8.cpp: oneDNN BF16 where the
// CPU has BF16 hardware, else SGEMM), at an (M, K) x (N, K)^T shape of the config.
double measure_fp8_gemm(const Config& c, int64_t M, int64_t K, int64_t N, std::string* impl) {
  const std::vector<float> a = filled(M * K, 1.0f), b = filled(N * K, 0.1f);
  QuantTensor qa, qb;
  if (c.fp8.recipe == Fp8Recipe::blockwise) {
    quantize_tiled(a.data(), M, K, Tiling::rows_1xT, c.fp8.tile, Fp8Dtype::e4m3, {c.fp8.margin, c.fp8.power_of_two_scales}, &qa);
    quantize_tiled(b.data(), N, K, Tiling::blocks_TxT, c.fp8.tile, Fp8Dtype::e4m3, {c.fp8.margin, c.fp8.power_of_two_scales}, &qb);
  } else {
    // Per-tensor recipes: a power-of-two scale, as the default scale options give.
    quantize_with_scale(a.data(), M, K, Fp8Dtype::e4m3, 256.0f, &qa);
    quantize_with_scale(b.data(), N, K, Fp8Dtype::e4m3, 2048.0f, &qb);
  }
  std::vector<float> out(size_t(M * N));
  GemmInfo info;
  const double s = seconds_of([&] { gemm_fp8(qa, false, qb, true, 1.0f, 0.0f, out.data(), N, GemmPath::automatic, &info); }, 3);
  *impl = std::string(to_string(info.path)) + " (" + info.impl + ")";
  return 2.0 * double(M) * double(N) * double(K) / s;
}

double measure_sgemm(int64_t M, int64_t K, int64_t N) {
  const std::vector<float> a = filled(M * K, 1.0f), b = filled(N * K, 0.1f);
  std::vector<float> out(size_t(M * N));
  const double s = seconds_of([&] { sgemm(false, true, M, N, K, 1.0f, a.data(), K, b.data(), K, 0.0f, out.data(), N); }, 3);
  return 2.0 * double(M) * double(N) * double(K) / s;
}

// The CPU attention kernels (kernels/cpu/attention.cpp) forward and backward on one micro-batch's
// shape, as FLOP/s of the causal count the plan uses (3 x forward).
double measure_attention(const ModelConfig& m, int64_t B, int64_t T, int64_t H) {
  const int64_t qk = m.qk_head_dim(), vd = m.v_dim(), KVH = m.mla() ? H : std::max<int64_t>(1, m.n_kv_heads * H / m.n_heads);
  const int64_t N = B * T;
  const std::vector<float> q = filled(N * H * qk, 1.0f), k = filled(N * KVH * qk, 1.0f), v = filled(N * KVH * vd, 1.0f),
                           dout = filled(N * H * vd, 1.0f);
  std::vector<float> out(size_t(N * H * vd)), lse(size_t(N * H)), dq(q.size()), dk(k.size()), dv(v.size());
  const double s = seconds_of([&] {
    cpu::attention_forward(q.data(), k.data(), v.data(), B, T, H, KVH, qk, vd, out.data(), lse.data());
    cpu::attention_backward(q.data(), k.data(), v.data(), out.data(), lse.data(), dout.data(), B, T, H, KVH, qk, vd,
                            dq.data(), dk.data(), dv.data());
  }, 2);
  return 3.0 * double(N) * double(H) * double(qk + vd) * double(T) / s;
}

double measure_bandwidth() {
  const size_t n = size_t(1) << 26;  // 256 MiB of floats: beyond any cache
  std::vector<float> a(n, 1.0f), b(n);
  const double s = seconds_of([&] { std::memcpy(b.data(), a.data(), n * sizeof(float)); }, 3);
  return 2.0 * double(n) * sizeof(float) / s;  // read + write
}

double ram_bytes() {
  std::ifstream f("/proc/meminfo");
  std::string key;
  double kb = 0;
  while (f >> key >> kb)
    if (key == "MemTotal:") return kb * 1024;
  return NAN;
}

// The resident memory of an `fp8moe train` process besides the backend's tensors: the
// executable and its libraries (Open MPI, OpenBLAS, oneDNN, HDF5), MPI's and OpenMP's buffers,
// OpenBLAS's per-thread GEMM buffers, the token data's pages, the metrics and the host copies of
// losses and loads. NOTE: measured, not derived: bench/plan-vs-measured.sh's `minimal` run (a
// model of 45K parameters on 1 rank, 3 steps, its tensors < 1 MB) peaks at 43.5-44.0 MB of RSS
// (/usr/bin/time -v, 3 runs) on this repository's 2-core development machine (AMD EPYC, Debian
// 12, Open MPI 4.1.4, OpenBLAS 0.3.21, oneDNN 3.x).
constexpr double kCpuProcessBaseline = 44e6;

Device cpu_device(const Config& c, const PlanLayout& L) {
  Device d;
  d.name = "cpu";
  d.cpu = true;
  const ModelConfig& m = c.model;
  const int64_t N = std::min<int64_t>(L.tokens(), 2048), D = m.d_model;
  const int64_t F = 2 * int64_t(m.moe.d_expert) / L.tensor;
  std::string impl = "-";
  d.fp8 = c.fp8.recipe != Fp8Recipe::off ? measure_fp8_gemm(c, N, D, F, &impl) : 0;
  d.fp32 = measure_sgemm(N, D, F);
  if (c.fp8.recipe == Fp8Recipe::off) d.fp8 = d.fp32;  // no FP8 GEMM runs: every linear layer is an SGEMM
  d.bf16 = d.fp32;
  d.attention = measure_attention(m, std::max<int64_t>(1, N / L.seq_len), std::min<int64_t>(L.seq_len, N), m.n_heads / L.tensor);
  d.hbm = measure_bandwidth();
  d.memory = ram_bytes();
  char b[400];
  std::snprintf(b, sizeof b,
                "measured now at the config's shapes: FP8 GEMM %.1f GFLOP/s [%s] at (%lld x %lld) x (%lld x %lld)^T, "
                "SGEMM %.1f GFLOP/s, attention %.1f GFLOP/s, memory %.1f GB/s; RAM from /proc/meminfo",
                d.fp8 / 1e9, impl.c_str(), (long long)N, (long long)D, (long long)F, (long long)D, d.fp32 / 1e9,
                d.attention / 1e9, d.hbm / 1e9);
  d.basis = b;
  return d;
}

// ---- the plan of one config -----------------------------------------------------------------------

struct Roofline {
  double compute_mb = 0;   // the slowest stage's compute per micro-batch, s
  double comm_mb = 0;      // its tp, ep and pp communication per micro-batch, s
  double memory_mb = 0;    // its memory-bound traffic per micro-batch, s
  double dp = 0;           // the step's dp + edp communication, s
  double optimizer = 0;    // the step's AdamW and FP8 weight quantization, s
  double bubble = 0;       // s
  double step = 0;         // s
  std::array<double, 5> comm_s{};  // per group, per step, s (the slowest stage)
};

struct Plan {
  Config cfg;
  PlanLayout L;
  std::vector<StageMemory> mem;
  std::vector<StageFlops> flops;
  std::vector<std::array<double, 5>> comm;  // per stage: bytes one rank sends per step
  double worst_total() const {
    double w = 0;
    for (const StageMemory& s : mem) w = std::max(w, s.total());
    return w;
  }
};

Plan make_plan(const Config& c, int world) {
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
    sh.tokens = double(p.L.tokens()), sh.micro_batches = p.L.micro_batches;
    sh.first = s.first, sh.last = s.last, sh.layer_begin = s.layer_begin, sh.layer_end = s.layer_end;
    sh.local_experts = m.moe.n_experts / p.L.expert;
    sh.dense_bytes = double(s.dense_trainable) * 4, sh.expert_bytes = double(s.expert_trainable) * 4;
    const double moe_layers = std::max(0, s.layer_end - std::max(s.layer_begin, m.first_dense_layers)) + s.mtp_blocks;
    // Uniform routing: of a token's top_k rows, 1 / expert stay on this rank.
    sh.rows_off_rank = double(p.L.micro_batches) * moe_layers * sh.tokens * m.moe.top_k * (1.0 - 1.0 / p.L.expert);
    p.comm.push_back(analytic_comm_bytes(sh));
  }
  return p;
}

// The link a group's traffic takes: NVLink when the group's ranks lie in one node (the grid orders
// ranks tensor fastest, then expert, then the rest of data, then pipeline: parallel/grid.h), else
// InfiniBand. ep's all-to-all: the share of its peers inside the node over NVLink, the rest over IB.
struct GroupLink {
  double span = 1, size = 1;
};
double comm_seconds(const Device& d, const PlanOptions& o, const PlanLayout& L, int group, double bytes) {
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
  if (group == 1) {
    const double in_node = std::max(0.0, node / L.tensor - 1) / std::max(1.0, g.size - 1);
    return bytes * in_node / d.nvlink + bytes * (1 - in_node) / d.ib;
  }
  return bytes / d.ib;
}

Roofline roofline(const Plan& p, const Device& d, const PlanOptions& o, double eff) {
  const Config& c = p.cfg;
  const PlanLayout& L = p.L;
  const double hp = o.higher_precision == "bf16" ? d.bf16 : d.fp32;
  Roofline r;
  double slowest = -1;
  for (size_t s = 0; s < p.mem.size(); ++s) {
    const StageFlops& f = p.flops[s];
    const double compute = f.fp8_gemm / (eff * d.fp8) + f.hp_gemm / (eff * hp) + f.attention / (eff * d.attention);
    // Memory-bound traffic (an estimate): every activation kept for backward is written in the
    // forward and read in the backward, and its gradient written and read once each.
    const double memory = 4 * p.mem[s].saved_per_micro_batch / d.hbm;
    double comm = 0;
    std::array<double, 5> per_group{};
    for (int g = 0; g < 5; ++g) per_group[size_t(g)] = comm_seconds(d, o, L, g, p.comm[s][size_t(g)]);
    for (int g : {0, 1, 4}) comm += per_group[size_t(g)] / L.micro_batches;
    const double t = o.overlap ? std::max(compute + memory, comm) : compute + memory + comm;
    if (t > slowest) {
      slowest = t;
      r.compute_mb = compute, r.memory_mb = memory, r.comm_mb = comm, r.comm_s = per_group;
      r.dp = per_group[2] + per_group[3];
      // AdamW on the owned rows: parameter, gradient (read), m and v (read and written), the
      // parameter written; then every FP8 weight read in FP32 and written in FP8 once per step.
      const StageMemory& m = p.mem[s];
      const double mb = c.train.moments_dtype == MomentsDtype::fp32 ? 4 : 2;
      const double owned = double(m.owned_dense + m.owned_expert);
      r.optimizer = (owned * (4 + 4 + 4 + 4 * mb) + m.fp8_weights * 5) / d.hbm;
    }
  }
  const double per_mb = o.overlap ? std::max(r.compute_mb + r.memory_mb, r.comm_mb) : r.compute_mb + r.memory_mb + r.comm_mb;
  r.bubble = (L.pipeline - 1) * per_mb;
  const double busy = L.micro_batches * per_mb;
  const double dp = o.overlap ? std::max(0.0, r.dp - busy) : r.dp;
  r.step = busy + r.bubble + dp + r.optimizer;
  return r;
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

// ---- loading and the search ---------------------------------------------------------------------

struct Loaded {
  Config cfg;
  int world = 0;
  std::string error;
};

Loaded load(const PlanOptions& o, const std::string& text, const std::vector<std::string>& extra, int world) {
  Loaded l;
  std::vector<std::string> sets = o.overrides;
  sets.insert(sets.end(), extra.begin(), extra.end());
  try {
    const Config unchecked = load_config(ConfigSource{o.config_path, text, sets}, 0);
    l.world = world > 0 ? world : unchecked.parallel.tensor * unchecked.parallel.pipeline * unchecked.parallel.expert;
    l.cfg = load_config(ConfigSource{o.config_path, text, sets}, l.world);
  } catch (const ConfigError& e) {
    l.error = e.what();
  }
  return l;
}

// The nearest layouts that fit: changes of one key first, then of two; each candidate validated
// by load_config for the same world size, ranked by the number of keys changed, then step time.
struct Candidate {
  std::vector<std::string> sets;
  double memory = 0, step = 0;
};

std::vector<Candidate> search_fits(const PlanOptions& o, const std::string& text, const Config& base, int world,
                                   const Device& d, double eff, std::string* searched) {
  std::map<std::string, std::vector<std::string>> options;
  auto add = [&](const std::string& key, const std::string& value) { options[key].push_back(key + "=" + value); };
  for (int v = 1; v <= world && v <= base.model.n_layers; v *= 2)
    if (v != base.parallel.pipeline) add("parallel.pipeline", std::to_string(v));
  for (int v = 1; v <= world && v <= base.model.moe.n_experts; v *= 2)
    if (v != base.parallel.expert) add("parallel.expert", std::to_string(v));
  for (int v = 1; v <= o.node_size && v <= world; v *= 2)
    if (v != base.parallel.tensor) add("parallel.tensor", std::to_string(v));
  for (int v = base.parallel.micro_batches * 2; v <= base.train.global_batch; v *= 2) add("parallel.micro_batches", std::to_string(v));
  for (const char* v : {"moe", "full"})
    if (to_string(base.train.recompute) != v) add("train.recompute", v);
  if (base.optim.zero != 1) add("optim.zero", "1");
  if (base.train.moments_dtype != MomentsDtype::bf16) add("train.moments_dtype", "bf16");
  std::vector<std::string> keys;
  for (const auto& [k, v] : options) keys.push_back(k);
  {
    std::ostringstream s;
    for (const auto& [k, v] : options) {
      s << "  " << k << ":";
      for (const std::string& x : v) s << " " << x.substr(x.find('=') + 1);
      s << "\n";
    }
    *searched = s.str();
  }
  std::vector<Candidate> fits;
  auto consider = [&](const std::vector<std::string>& sets) {
    const Loaded l = load(o, text, sets, world);
    if (!l.error.empty()) return;
    const Plan p = make_plan(l.cfg, l.world);
    if (p.worst_total() > d.memory) return;
    fits.push_back({sets, p.worst_total(), roofline(p, d, o, eff).step});
  };
  for (const std::string& k : keys)
    for (const std::string& v : options[k]) consider({v});
  if (fits.empty())
    for (size_t i = 0; i < keys.size(); ++i)
      for (size_t j = i + 1; j < keys.size(); ++j)
        for (const std::string& a : options[keys[i]])
          for (const std::string& b : options[keys[j]]) consider({a, b});
  std::sort(fits.begin(), fits.end(), [](const Candidate& a, const Candidate& b) {
    return a.sets.size() != b.sets.size() ? a.sets.size() < b.sets.size() : a.step < b.step;
  });
  return fits;
}

// ---- the report -----------------------------------------------------------------------------------

void print_memory_table(const Plan& p, const Device& d, double baseline) {
  std::printf("memory per rank, by pipeline stage (every tensor/expert rank of a stage alike; bytes, 1 GB = 1e9):\n");
  std::printf("  stage  layers    weights     grads    moments  fp8 copies  act/micro-batch x in flight  workspace      total%s\n",
              d.cpu ? "   RSS (+ baseline)" : "");
  for (const StageMemory& s : p.mem) {
    char layers[32];
    std::snprintf(layers, sizeof layers, "%d-%d%s", s.layer_begin, s.layer_end - 1, s.mtp_blocks ? "+mtp" : "");
    std::printf("  %5d  %-8s %9s %9s %10s %11s %14s x %-3d %9s %9s %10s", s.stage, layers, bytes_text(s.weights).c_str(),
                bytes_text(s.grads).c_str(), bytes_text(s.moments).c_str(), bytes_text(s.fp8_weights + s.fp8_state).c_str(),
                bytes_text(s.saved_per_micro_batch).c_str(), s.in_flight, "", bytes_text(s.workspace).c_str(),
                bytes_text(s.total()).c_str());
    if (d.cpu) std::printf("   %s", bytes_text(s.total() + baseline).c_str());
    std::printf("%s\n", s.total() + baseline > d.memory ? "  DOES NOT FIT" : "");
  }
}

// What FP8 changes in the memory of the worst rank: the config's recipe, fp8moe with recipe off
// (FP32 GEMMs and FP32 activations: what it runs without FP8), and a model of BF16 mixed-precision
// training (Megatron-style: BF16 weights beside FP32 master weights and FP32 gradients, the
// activations of the recipe-off run in BF16, no FP8 copies).
void print_fp8_savings(const Config& c, int world) {
  Config off = c;
  off.fp8.recipe = Fp8Recipe::off;
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
  std::printf("  FP8 / recipe off: %.2f; FP8 / BF16 model: %.2f. FP8 changes only the activations a linear layer keeps\n"
              "  (its input in FP8 instead of FP32) and adds the step's FP8 weight copies; the master weights,\n"
              "  gradients and moments are the optimizer's and stay as they are.\n",
              x.total() / y.total(), x.total() / bf16);
}

}  // namespace

CLI::App* add_plan_command(CLI::App& app, PlanOptions* o) {
  CLI::App* cmd = app.add_subcommand(
      "plan", "What CONFIG needs on a layout (parameters, FLOPs, memory per rank, communication, bubble, a roofline "
              "step time), without allocating the model");
  cmd->add_option("config", o->config_path, "YAML config file (see `fp8moe defaults`)")->required();
  cmd->add_option("--set", o->overrides, "Override one key: --set parallel.pipeline=4 (repeatable)")
      ->type_name("KEY=VALUE")
      ->allow_extra_args(false)
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  cmd->add_option("--world", o->world,
                  "World size (ranks) to validate and plan for (default: tensor x pipeline x expert, one data replica "
                  "per expert group)");
  cmd->add_option("--device", o->device, "h100 | h200 | h800 | b200 | cpu (this machine, measured); default: cpu for "
                                         "runtime.device cpu or emulated, else h100");
  cmd->add_option("--efficiency", o->efficiency,
                  "Fraction of the peak the GEMMs and attention reach (default 0.4 on a GPU; 1.0 of the rates measured "
                  "on the CPU)");
  cmd->add_option("--node-size", o->node_size, "GPUs per node: groups within a node use NVLink (default 8)");
  cmd->add_flag("--overlap", o->overlap,
                "Model communication hidden behind compute (as DeepSeek-V3's DualPipe does); fp8moe itself does not "
                "overlap, so the default is communication exposed");
  cmd->add_option("--higher-precision", o->higher_precision,
                  "The GEMMs not run in FP8: fp32 (what fp8moe runs: FP32, no TF32) or bf16 (a model of a BF16 engine)")
      ->check(CLI::IsMember({"fp32", "bf16"}));
  cmd->add_option("--tokens", o->tokens, "Print the device-hours to train this many tokens (e.g. 1e12)");
  cmd->add_option("--target-gpu-hours", o->target_hours,
                  "With --tokens: solve for the efficiency that takes this many device-hours (e.g. 180000, DeepSeek-V3's "
                  "H800 GPU-hours per trillion tokens)");
  cmd->add_flag("!--no-search", o->search, "Do not search for a layout that fits when a rank does not");
  cmd->add_option("--baseline-bytes", o->baseline_bytes,
                  "cpu: the process's resident memory besides its tensors (default: the constant measured here, see "
                  "app/plan.cpp)");
  return cmd;
}

int run_plan(const PlanOptions& o) {
  std::string text;
  try {
    text = read_config_file(o.config_path);
  } catch (const ConfigError& e) {
    return usage_error(e.what());
  }
  if (o.world < 0) return usage_error("--world " + std::to_string(o.world) + ": expected a positive number of ranks");
  const Loaded l = load(o, text, {}, o.world);
  if (!l.error.empty()) return usage_error(l.error);
  const Config& c = l.cfg;
  const int world = l.world;
  if (o.node_size < 1) return usage_error("--node-size " + std::to_string(o.node_size) + ": expected >= 1");
  if (o.tokens < 0 || o.target_hours < 0) return usage_error("--tokens and --target-gpu-hours: expected positive numbers");
  if (o.target_hours > 0 && o.tokens <= 0) return usage_error("--target-gpu-hours needs --tokens");
  std::string name = o.device;
  if (name.empty())
    name = c.runtime.device == DeviceChoice::cpu || c.runtime.device == DeviceChoice::emulated ? "cpu" : "h100";
  if (name != "cpu" && name != "h100" && name != "h200" && name != "h800" && name != "b200")
    return usage_error("--device " + name + ": expected h100, h200, h800, b200 or cpu");
  if (o.efficiency < 0 || o.efficiency > 1) return usage_error("--efficiency: expected a fraction in (0, 1]");

  Plan p = make_plan(c, world);
  const PlanLayout& L = p.L;
  const Device d = name == "cpu" ? cpu_device(c, L) : gpu(name);
  const double eff = o.efficiency > 0 ? o.efficiency : d.cpu ? 1.0 : 0.4;
  const double baseline = d.cpu ? (o.baseline_bytes >= 0 ? o.baseline_bytes : kCpuProcessBaseline) : 0;

  std::printf("fp8moe plan: %s on %d rank%s%s (device %s)\n", o.config_path.c_str(), world, world == 1 ? "" : "s",
              o.world > 0 ? "" : " (the config's tensor x pipeline x expert: --world sets more)", name.c_str());
  std::printf("layout: tensor %d, pipeline %d, expert %d, data %d (expert-data %d), %d micro-batches of %lld sequence%s "
              "x %lld tokens per replica; %lld tokens per step\n\n",
              L.tensor, L.pipeline, L.expert, L.data, L.expert_data, L.micro_batches, (long long)L.sequences,
              L.sequences == 1 ? "" : "s", (long long)L.seq_len, (long long)c.train.global_batch * L.seq_len);
  std::printf("%s\n", param_count_table(c.model).c_str());

  const double model_flops = model_flops_per_token(c.model, c.train.seq_len);
  double executed = 0;
  for (const StageFlops& f : p.flops) executed += f.total();
  executed *= double(L.tensor) * L.data * L.micro_batches;  // every rank of every stage
  const double step_tokens = double(c.train.global_batch) * double(L.seq_len);
  std::printf("\nFLOPs per token (forward + backward, attention included): %.4g model (the MFU's numerator); "
              "%.4g run (recomputation, tensor-parallel replicated work, FP32 router and head included)\n",
              model_flops, executed / step_tokens);

  std::printf("\n");
  print_memory_table(p, d, baseline);
  const StageMemory* worst = &p.mem[0];
  for (const StageMemory& s : p.mem)
    if (s.total() > worst->total()) worst = &s;
  std::printf("  ZeRO-1 (optim.zero %d): moments of %lld dense elements over %d data replica%s and %lld expert elements "
              "over %d expert-data replica%s; moments %s; recompute %s; fp8.recipe %s\n",
              c.optim.zero, (long long)worst->dense_trainable, L.data, L.data == 1 ? "" : "s",
              (long long)worst->expert_trainable, L.expert_data, L.expert_data == 1 ? "" : "s",
              to_string(c.train.moments_dtype).data(), to_string(c.train.recompute).data(), to_string(c.fp8.recipe).data());
  std::printf("  %s limit: %s%s\n", d.cpu ? "RAM" : "device memory", bytes_text(d.memory).c_str(),
              d.cpu ? " (processes of one machine share it: all ranks' RSS together count)" : "");
  if (d.cpu) {
    double all = 0;
    for (const StageMemory& s : p.mem) all += (s.total() + baseline) * L.tensor * L.data;
    std::printf("  all %d ranks together: %s (the process baseline %s each%s)\n", world, bytes_text(all).c_str(),
                bytes_text(baseline).c_str(), o.baseline_bytes >= 0 ? ", --baseline-bytes" : ", measured: app/plan.cpp");
  }

  const Roofline r = roofline(p, d, o, eff);
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
    std::printf("  ep: uniform routing, tokens x top_k x (1 - 1/%d) rows leave each rank, FP32 rows as fp8moe sends them\n",
                L.expert);

  const double bubble = bubble_fraction(L.pipeline, L.micro_batches);
  std::printf("\npipeline bubble (1F1B): (p - 1) / (m + p - 1) = %d / %d = %.3f\n", L.pipeline - 1,
              L.micro_batches + L.pipeline - 1, bubble);

  std::printf("\nstep time (roofline, %s):\n", d.name.c_str());
  std::printf("  per micro-batch on the slowest stage: compute %s, memory-bound %s, communication %s%s\n",
              seconds_text(r.compute_mb).c_str(), seconds_text(r.memory_mb).c_str(), seconds_text(r.comm_mb).c_str(),
              o.overlap ? " (hidden behind compute: --overlap)" : " (exposed)");
  std::printf("  x %d micro-batches + bubble %s + dp/edp %s%s + optimizer %s = %s per step\n", L.micro_batches,
              seconds_text(r.bubble).c_str(), seconds_text(r.dp).c_str(), o.overlap ? " (overlapped)" : "",
              seconds_text(r.optimizer).c_str(), seconds_text(r.step).c_str());
  const double tps = step_tokens / r.step;
  std::printf("  %.0f tokens/s, MFU %.3f of the %s peak\n", tps, tps * model_flops / (world * (c.fp8.recipe != Fp8Recipe::off ? d.fp8 : d.fp32)),
              c.fp8.recipe != Fp8Recipe::off ? "FP8" : "FP32");
  std::printf("  assumptions: GEMMs at %.2f of %s: FP8 %.4g FLOP/s for the linear layers fp8.layers runs in FP8, %s %.4g "
              "for the others (router, eh_proj, head; every linear layer with recipe off), attention core %.4g "
              "(%s); memory-bound traffic 4 x the activations kept per micro-batch plus AdamW's and the FP8 "
              "weights' bytes, at %.4g B/s; communication at %s; uniform routing; 1F1B with the slowest stage "
              "setting the pace; no kernel-launch or host overhead.\n",
              eff, d.cpu ? "the rates measured here" : "the peaks", d.fp8, o.higher_precision.c_str(),
              o.higher_precision == "bf16" ? d.bf16 : d.fp32, d.attention, d.cpu ? "measured" : "the BF16 peak", d.hbm,
              d.cpu ? "the memory bandwidth (ranks of one machine)"
                    : ("NVLink " + bytes_text(d.nvlink) + "/s inside a node of " + std::to_string(o.node_size) +
                       ", InfiniBand " + bytes_text(d.ib) + "/s per GPU across nodes")
                          .c_str());
  std::printf("  device: %s\n", d.basis.c_str());

  if (o.tokens > 0) {
    const double hours = o.tokens / step_tokens * r.step * world / 3600;
    std::printf("\n%.4g tokens: %.4g steps, %.4g %s-hours (%.4g days on %d)\n", o.tokens, o.tokens / step_tokens, hours,
                name.c_str(), hours / world / 24, world);
    if (o.target_hours > 0) {
      // The step time falls monotonically with the efficiency: bisect for the target.
      auto hours_at = [&](double e) { return o.tokens / step_tokens * roofline(p, d, o, e).step * world / 3600; };
      double lo = 1e-4, hi = 1.0;
      if (hours_at(hi) > o.target_hours) {
        std::printf("  %.4g hours is out of reach even at efficiency 1.0 (%.4g hours): the parts the efficiency does not "
                    "scale (communication, memory-bound, bubble) take more\n",
                    o.target_hours, hours_at(hi));
      } else {
        for (int i = 0; i < 100; ++i) {
          const double mid = std::sqrt(lo * hi);
          (hours_at(mid) > o.target_hours ? lo : hi) = mid;
        }
        const Roofline at = roofline(p, d, o, hi);
        std::printf("  matching %.4g hours takes a GEMM efficiency of %.3f (of the peaks above): per step %s, of it "
                    "compute %s, communication %s%s, bubble %s\n",
                    o.target_hours, hi, seconds_text(at.step).c_str(),
                    seconds_text(at.compute_mb * L.micro_batches).c_str(),
                    seconds_text((at.comm_mb * L.micro_batches) + at.dp).c_str(), o.overlap ? " (hidden)" : " (exposed)",
                    seconds_text(at.bubble).c_str());
      }
    }
  }

  // One line for scripts (bench/plan-vs-measured.sh): the worst rank's tensors, with the
  // process baseline (cpu), and the step time.
  std::printf("\nsummary: rank_bytes %.6g  rss_bytes %.6g  step_s %.6g\n", p.worst_total(), p.worst_total() + baseline,
              r.step);

  if (!d.cpu || c.model.d_model >= 1024) print_fp8_savings(c, world);

  if (p.worst_total() + baseline > d.memory) {
    std::printf("\nWARNING: a rank needs %s, more than the %s of %s.\n", bytes_text(p.worst_total() + baseline).c_str(),
                bytes_text(d.memory).c_str(), name.c_str());
    if (o.search) {
      std::string searched;
      const std::vector<Candidate> fits = search_fits(o, text, c, world, d, eff, &searched);
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
  }
  return kExitOk;
}

}  // namespace fp8moe
