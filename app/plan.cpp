#include "app/plan.h"

#include <omp.h>

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
#include "app/trainer.h"
#include "io/config.h"
#include "io/token_data.h"
#include "kernels/attention.h"
#include "kernels/backend.h"
#include "kernels/gemm_fp8.h"
#include "kernels/quantize.h"
#include "model/param_table.h"
#include "model/plan_model.h"
#include "model/transformer.h"

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
// The CPU's step, measured on fp8moe's own code: small models of the config's blocks (the same
// widths, micro-batch, recipe and recompute mode; one or two blocks of each kind) trained one
// micro-batch at a time on the backend `train` would use, their times split by block kind. Seconds.
struct CpuProbe {
  bool valid = false;
  std::string why_not;             // when not valid
  Recompute recompute = Recompute::none;
  int64_t tokens = 0;              // the micro-batch the probes ran
  // Each as probe A's time (`a`: embedding, final norm, head, cross-entropy, the fixed work, and
  // A's one dense and one MoE block) + each further block's.
  struct Part { double a = 0, dense = 0, moe = 0, mtp = 0; };
  int dense_in_a = 0, moe_in_a = 0;
  // A part for a model of `dense` + `moe` blocks and `mtp` modules on one rank.
  double of(const Part& q, int dense, int moe, int mtp) const {
    return q.a + (dense - dense_in_a) * q.dense + (moe - moe_in_a) * q.moe + mtp * q.mtp;
  }
  Part cached;     // a micro-batch's forward + backward with the step's FP8 weights already quantized
  Part first;      // the first micro-batch of a step: with the FP8 weights' quantization
  Part optimizer;  // zero_grads, the gradient norm and AdamW's step
  int probes = 0;
  bool real_data = false;          // the probes trained on the config's data.path (else random tokens)
  double probe_seconds = 0;        // the measurement's own wall time
};

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

// The resident memory of an `fp8moe train` process besides the backend's tensors, in two measured
// parts (measured, not derived; this repository's 2-core development machine, AMD EPYC, Debian 12,
// Open MPI 4.1.4, OpenBLAS 0.3.21, oneDNN 2.6 (libdnnl.so.2.6), the CUDA release build, 2 OpenMP
// threads):
// - the process: bench/plan-vs-measured.sh's `minimal` run (45K parameters, its tensors < 1 MB)
//   peaks at 201-203 MB of RSS (the log's mem, OMP_NUM_THREADS 1, 2 and 4). Of it, by
//   /proc/PID/smaps: 84 MB of anonymous memory that OpenBLAS's GEMM buffers fill (the 1024^3
//   SGEMM app/step_report.cpp times at start-up), ~60 MB of libcublasLt's pages (linked by the
//   CUDA build even on the CPU), the other libraries' pages, a 7 MB heap; ru_maxrss also keeps the
//   12.6 MB of that SGEMM's operands. A CPU-only build has no libcublasLt (--baseline-bytes);
// - the libraries' heap beside the tensors: heaptrack over tiny.yaml on one rank (10 steps) peaks
//   at 221.8 MB of heap, of which 171.8 MB are the backend's tensors (HostBackend::allocate) and
//   50.0 MB the rest: 38.2 MB oneDNN's (its primitives' scratchpads and JIT code), the CPU FP8
//   GEMM's thread-local BF16 operand copies (kernels/cpu/gemm_fp8.cpp), the host copies of losses
//   and loads. The ~200M-parameter bench config run with glibc's retention off (see below) leaves
//   52 MB beside its tensors and the process baseline: the same 50 MB within 2 MB.
// Not modelled: the freed tensor memory glibc's heap keeps resident. Its dynamic mmap threshold
// rises to 32 MB after the first large free, so every later tensor below that comes from the
// heap, which returns pages only at its top: the peak RSS grows for 10-15 steps and then stays
// 1.4-1.8x the modelled figure (bench/plan-vs-measured.sh's RSS column; with
// MALLOC_MMAP_THRESHOLD_=262144 it stays 1.00-1.21x, the RSS/thr column).
constexpr double kCpuProcessBaseline = 202e6;
constexpr double kCpuLibraryHeap = 50e6;


// One probe model of `dense` dense blocks then `moe` MoE blocks and `mtp` modules, at the config's
// widths on one rank, on its own backend. step() times one training step of it: its first
// micro-batch (the step's FP8 weights quantized at first use), a second micro-batch (reusing them)
// and the optimizer.
struct ProbeTimes { double first = 0, cached = 0, optimizer = 0; };
class ProbeModel {
 public:
  ProbeModel(const Config& c, int dense, int moe, int mtp, int64_t B, int64_t T) : B_(B), T_(T), depth_(mtp) {
    pc_ = c;
    pc_.parallel.tensor = pc_.parallel.pipeline = pc_.parallel.expert = 1;
    pc_.parallel.micro_batches = 1;
    pc_.model.n_layers = dense + moe;
    pc_.model.first_dense_layers = dense;
    pc_.model.mtp_depth = mtp;
    const DeviceKind kind = c.runtime.device == DeviceChoice::emulated ? DeviceKind::emulated : DeviceKind::cpu;
    BackendOptions bo;
    bo.grouped_gemm = c.runtime.grouped_gemm;
    be_ = make_backend(kind, 0, bo);
    comms_ = std::make_unique<TrainComms>(*be_);
    trainer_ = std::make_unique<Trainer>(pc_, *be_, *comms_, "probe");
    const ModelConfig& m = pc_.model;
    const int64_t N = B * T;
    std::vector<int32_t> tok(static_cast<size_t>(N)), tgt(static_cast<size_t>(N));
    // The config's own training data where it can be read (its tokens route as training's do),
    // else uniformly random tokens.
    try {
      DataBlend data(c.data.path, TokenCheck{m.vocab_size, 0, 1});
      for (int64_t b = 0; b < B; ++b) data.sample(c.train.seed, b, T, tok.data() + b * T, tgt.data() + b * T);
      real_data_ = true;
    } catch (const std::exception&) {
      uint32_t seed = 777;
      for (int64_t i = 0; i < N; ++i) seed = seed * 1664525u + 1013904223u, tok[size_t(i)] = int32_t((seed >> 8) % uint32_t(m.vocab_size));
      for (int64_t i = 0; i < N; ++i) tgt[size_t(i)] = (i + 1) % T ? tok[size_t(i + 1)] : tok[size_t(i)];
    }
    ids_ = tensor_from(*be_, tok, {N}), targets_ = tensor_from(*be_, tgt, {N});
    losses_ = Tensor::zeros(*be_, DType::f64, {1 + m.moe_layers() + mtp});
    sq_ = Tensor::zeros(*be_, DType::f64, {1});
    if (mtp > 0) mtp_ = mtp_inputs(*be_, tok.data(), tgt.data(), B, T, mtp, m.pad_id);
  }
  bool real_data() const { return real_data_; }

  ProbeTimes step() {
    const ModelConfig& m = pc_.model;
    const int64_t N = B_ * T_;
    const LossSlots slots{losses_.data<double>(), losses_.data<double>() + 1, losses_.data<double>() + 1 + m.moe_layers()};
    auto micro_batch = [&] {
      StageRun run = trainer_->model.stage_forward(ids_.data<int32_t>(), targets_.data<int32_t>(), N, B_, T_, nullptr, true,
                                           slots, 1.0f, N, 1.0, depth_ > 0 ? &mtp_.batch : nullptr);
      trainer_->model.stage_backward(run, nullptr);
      be_->sync();
    };
    auto seconds = [](const auto& fn) {
      const auto t0 = std::chrono::steady_clock::now();
      fn();
      return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    };
    trainer_->model.zero_grads();
    trainer_->model.begin_step();
    ProbeTimes t;
    t.first = seconds(micro_batch);
    t.cached = seconds(micro_batch);
    t.optimizer = seconds([&] {
      trainer_->model.zero_grads();
      trainer_->opt.grad_sq(trainer_->model.store(), 0.5f, {}, sq_.data<double>());
      double host = 0;
      be_->download(&host, sq_.data<double>(), sizeof host);
      trainer_->opt.step(trainer_->model.store(), pc_.train.warmup_steps, host, 0.5f);
      be_->sync();
    });
    return t;
  }

 private:
  Config pc_;
  int64_t B_, T_;
  int depth_;
  bool real_data_ = false;
  std::unique_ptr<Backend> be_;
  std::unique_ptr<TrainComms> comms_;
  std::unique_ptr<Trainer> trainer_;
  Tensor ids_, targets_, losses_, sq_;
  MtpInputs mtp_;
};

// The probes for a config on one rank: A (one block of each kind the model has), A plus one MoE
// block, A plus one dense block, A plus one module (each only where the model has more); each
// kind's time per block is its probe's difference from A.
CpuProbe probe_cpu(const Config& c, const PlanLayout& L, double ram) {
  CpuProbe p;
  const ModelConfig& m = c.model;
  p.recompute = c.train.recompute, p.tokens = L.tokens();
  if (L.world != 1) {
    p.why_not = "more than one rank: the probes time one rank holding every block";
    return p;
  }
  const int Ld = std::min(m.first_dense_layers, m.n_layers), Lm = m.n_layers - Ld;
  const int ad = Ld > 0 ? 1 : 0, am = Lm > 0 ? 1 : 0;
  // The probes (up to 4, alive together) must leave room: 4 x the largest one's memory, from the
  // plan's own model, within half the RAM.
  {
    Config big = c;
    big.parallel.tensor = big.parallel.pipeline = big.parallel.expert = 1;
    big.model.n_layers = ad + am + 1, big.model.first_dense_layers = ad + 1;
    const double need = plan_memory(big, plan_layout(big, 1))[0].total();
    if (4 * need > ram / 2) {
      p.why_not = "its probe models would need " + std::to_string(int64_t(4 * need / 1e9)) + " GB";
      return p;
    }
  }
  // Every probe is built first, then their steps interleave, each probe's fastest step kept: a
  // slow spell of the machine (its other work only ever adds) falls on all of them alike, not on
  // one kind's difference.
  const auto t0 = std::chrono::steady_clock::now();
  p.dense_in_a = ad, p.moe_in_a = am;
  std::vector<std::unique_ptr<ProbeModel>> probes;
  probes.push_back(std::make_unique<ProbeModel>(c, ad, am, 0, L.sequences, L.seq_len));
  const int with_moe = Lm > am ? int(probes.size()) : -1;
  if (with_moe >= 0) probes.push_back(std::make_unique<ProbeModel>(c, ad, am + 1, 0, L.sequences, L.seq_len));
  const int with_dense = Ld > ad ? int(probes.size()) : -1;
  if (with_dense >= 0) probes.push_back(std::make_unique<ProbeModel>(c, ad + 1, am, 0, L.sequences, L.seq_len));
  const int with_mtp = m.mtp_depth > 0 ? int(probes.size()) : -1;
  if (with_mtp >= 0) probes.push_back(std::make_unique<ProbeModel>(c, ad, am, 1, L.sequences, L.seq_len));
  p.probes = int(probes.size());
  p.real_data = probes[0]->real_data();
  const double inf = 1e30;
  std::vector<ProbeTimes> best(probes.size(), ProbeTimes{inf, inf, inf});
  const int reps = 7;
  for (int r = -1; r < reps; ++r)  // r = -1: the warm-up (allocations, oneDNN's primitives)
    for (size_t i = 0; i < probes.size(); ++i) {
      const ProbeTimes t = probes[i]->step();
      if (r < 0) continue;
      best[i].first = std::min(best[i].first, t.first);
      best[i].cached = std::min(best[i].cached, t.cached);
      best[i].optimizer = std::min(best[i].optimizer, t.optimizer);
    }
  const ProbeTimes a = best[0];
  auto minus = [&](int i) {
    if (i < 0) return ProbeTimes{};
    return ProbeTimes{best[size_t(i)].first - a.first, best[size_t(i)].cached - a.cached,
                      best[size_t(i)].optimizer - a.optimizer};
  };
  const ProbeTimes dm = minus(with_moe), dd = minus(with_dense), dt = minus(with_mtp);
  p.probe_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  auto part = [&](double ProbeTimes::*f) { return CpuProbe::Part{a.*f, dd.*f, dm.*f, dt.*f}; };
  p.cached = part(&ProbeTimes::cached), p.first = part(&ProbeTimes::first), p.optimizer = part(&ProbeTimes::optimizer);
  p.valid = true;
  return p;
}

Device cpu_device(const Config& c, const PlanLayout& L, bool probe) {
  Device d;
  d.name = "cpu";
  d.cpu = true;
  // The threads a rank of `train` runs with (app/train.cpp set_threads_per_rank): the cores over
  // the ranks of this machine, unless OMP_NUM_THREADS says.
  if (!std::getenv("OMP_NUM_THREADS")) omp_set_num_threads(std::max(1, omp_get_num_procs() / L.world));
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
  if (!probe) {
    d.probe.why_not = "--no-probe";
  } else {
    d.probe = probe_cpu(c, L, d.memory);
  }
  if (d.probe.valid) {
    std::snprintf(b, sizeof b,
                  "; the step from %d probe models of this config's blocks trained here on %d thread%s (%.1f s): "
                  "see below",
                  d.probe.probes, omp_get_max_threads(), omp_get_max_threads() == 1 ? "" : "s", d.probe.probe_seconds);
  } else {
    std::snprintf(b, sizeof b, "; no probe models (%s): the step from the rates above", d.probe.why_not.c_str());
  }
  d.basis += b;
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
  bool measured = false;   // the CPU's probes (compute_mb: a micro-batch; quantize, optimizer: per step)
  double quantize = 0;     // measured: the FP8 weights' quantization at their first use in a step, s
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

// How communication enters the step: as the options say (exposed, or with --overlap hidden behind
// compute where compute is longer), or not at all (compute only: every byte hidden, as DeepSeek-V3's
// DualPipe with its node-limited FP8 dispatch is reported to achieve).
enum class CommMode { options, exposed, overlapped, hidden };

// balanced: every stage takes the stages' mean compute and memory time (stages of equal work, as
// a layout that balanced the head and the modules against blocks would have), else the slowest
// stage sets the pace.
Roofline roofline(const Plan& p, const Device& d, const PlanOptions& opts, double eff, CommMode mode = CommMode::options,
                  bool balanced = false) {
  PlanOptions o = opts;
  if (mode == CommMode::exposed) o.overlap = false;
  if (mode == CommMode::overlapped) o.overlap = true;
  const bool hidden = mode == CommMode::hidden;
  const Config& c = p.cfg;
  const PlanLayout& L = p.L;
  const double hp = o.higher_precision == "bf16" ? d.bf16 : d.fp32;
  Roofline r;
  const CpuProbe& q = d.probe;
  if (d.cpu && q.valid && L.world == 1 && c.train.recompute == q.recompute && L.tokens() == q.tokens) {
    // One rank on the CPU: the probes' times (the efficiency scales the micro-batches' work).
    const ModelConfig& g = c.model;
    const int Ld = std::min(g.first_dense_layers, g.n_layers), Lm = g.n_layers - Ld;
    const double cached = q.of(q.cached, Ld, Lm, g.mtp_depth), first = q.of(q.first, Ld, Lm, g.mtp_depth);
    r.measured = true;
    r.compute_mb = cached / eff;
    r.quantize = std::max(0.0, first - cached) / eff;
    r.optimizer = q.of(q.optimizer, Ld, Lm, g.mtp_depth);
    r.step = L.micro_batches * r.compute_mb + r.quantize + r.optimizer;
    return r;
  }
  double slowest = -1, sum_compute = 0, sum_memory = 0;
  for (size_t s = 0; s < p.mem.size(); ++s) {
    const StageFlops& f = p.flops[s];
    const double compute = f.fp8_gemm / (eff * d.fp8) + f.hp_gemm / (eff * hp) + f.attention / (eff * d.attention);
    // Memory-bound traffic (an estimate): every activation kept for backward is written in the
    // forward and read in the backward, and its gradient written and read once each.
    const double memory = 4 * p.mem[s].saved_per_micro_batch / d.hbm;
    sum_compute += compute, sum_memory += memory;
    double comm = 0;
    std::array<double, 5> per_group{};
    for (int g = 0; g < 5; ++g) per_group[size_t(g)] = comm_seconds(d, o, L, g, p.comm[s][size_t(g)]);
    for (int g : {0, 1, 4}) comm += per_group[size_t(g)] / L.micro_batches;
    if (hidden) comm = 0;
    const double t = o.overlap ? std::max(compute + memory, comm) : compute + memory + comm;
    if (t > slowest) {
      slowest = t;
      r.compute_mb = compute, r.memory_mb = memory, r.comm_mb = comm, r.comm_s = per_group;
      r.dp = hidden ? 0 : per_group[2] + per_group[3];
      // AdamW on the owned rows: parameter, gradient (read), m and v (read and written), the
      // parameter written; then every FP8 weight read in FP32 and written in FP8 once per step.
      const StageMemory& m = p.mem[s];
      const double mb = c.train.moments_dtype == MomentsDtype::fp32 ? 4 : 2;
      const double owned = double(m.owned_dense + m.owned_expert);
      r.optimizer = (owned * (4 + 4 + 4 + 4 * mb) + m.fp8_weights * 5) / d.hbm;
    }
  }
  if (balanced) r.compute_mb = sum_compute / double(p.mem.size()), r.memory_mb = sum_memory / double(p.mem.size());
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
              d.cpu ? "   RSS (+ process, heap)" : "");
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


// --target-gpu-hours: the efficiency (of the device's peaks, all GEMMs and attention alike) at which
// the roofline's step time spends the target device-hours on --tokens, three ways: with fp8moe's
// own communication exposed, the same hidden behind compute where compute is longer (--overlap),
// and compute only (every byte hidden), the bubble always as configured. Where a way cannot reach
// the target at any efficiency, the parts the efficiency does not scale are printed instead.
void print_target(const Plan& p, const Device& d, const PlanOptions& o, int world, double step_tokens) {
  const PlanLayout& L = p.L;
  const double steps = o.tokens / step_tokens;
  const double budget = step_budget_seconds(o.target_hours, o.tokens, step_tokens, world);
  std::printf("\nagainst %.4g %s-hours for %.4g tokens: %.6g steps of %.4g tokens on %d ranks leave %s per step\n",
              o.target_hours, d.name.c_str(), o.tokens, steps, step_tokens, world, seconds_text(budget).c_str());
  // The efficiency at which the step takes `budget`, or < 0 where even 1.0 is too slow.
  auto solve = [&](const PlanOptions& oo, CommMode mode) {
    auto step_at = [&](double e) { return roofline(p, d, oo, e, mode).step; };
    if (step_at(1.0) > budget) return -1.0;
    double lo = 1e-6, hi = 1.0;  // the step falls monotonically with the efficiency: bisect
    for (int i = 0; i < 200; ++i) {
      const double mid = std::sqrt(lo * hi);
      (step_at(mid) > budget ? lo : hi) = mid;
    }
    return hi;
  };
  auto verdict = [](double e) {
    return e < 0.30 ? "below DeepSeek-V3's plausible 0.30-0.45" : e <= 0.45 ? "within the plausible 0.30-0.45"
                                                                              : "above the plausible 0.30-0.45";
  };
  const double ep_bytes = [&] {
    double b = 0;
    for (const auto& cs : p.comm) b = std::max(b, cs[1]);
    return b;
  }();
  bool unreachable = false;
  for (CommMode mode : {CommMode::exposed, CommMode::overlapped}) {
    const char* what = mode == CommMode::exposed ? "(a) fp8moe's communication exposed (as it runs)"
                                                 : "(a) fp8moe's communication hidden behind compute where shorter (--overlap)";
    const double e = solve(o, mode);
    if (e >= 0) {
      const Roofline at = roofline(p, d, o, e, mode);
      std::printf("  %s: efficiency %.3f (%s); per step compute %s, communication %s, bubble %s\n", what, e, verdict(e),
                  seconds_text(at.compute_mb * L.micro_batches).c_str(),
                  seconds_text(at.comm_mb * L.micro_batches + at.dp).c_str(), seconds_text(at.bubble).c_str());
      continue;
    }
    unreachable = true;
    // The step with the compute taking no time at all: what communication alone costs.
    const Roofline top = roofline(p, d, o, 1.0, mode), floor = roofline(p, d, o, 1e12, mode);
    std::printf("  %s: cannot be reached at any efficiency: at 1.0 the step takes %s; with the compute taking no time "
                "at all still %s (communication %s per micro-batch over %d micro-batch slots of 1F1B, dp/edp %s) > %s\n",
                what, seconds_text(top.step).c_str(), seconds_text(floor.step).c_str(), seconds_text(floor.comm_mb).c_str(),
                L.micro_batches + L.pipeline - 1,
                mode == CommMode::overlapped ? "hidden" : seconds_text(floor.dp).c_str(), seconds_text(budget).c_str());
  }
  if (unreachable && L.expert > 1) {
    const Roofline top = roofline(p, d, o, 1.0, CommMode::exposed);
    std::printf("      why: the expert all-to-all alone sends %s per rank per step (FP32 rows of D = %d floats, 4 "
                "exchanges per MoE layer and micro-batch: dispatch and combine, forward and backward; uniform routing, "
                "no node-limited deduplication): %s at %s/s of NVLink to the peers inside a node and %s/s of InfiniBand "
                "to the rest, %.2fx the budget of a whole step\n",
                bytes_text(ep_bytes).c_str(), p.cfg.model.d_model, seconds_text(top.comm_s[1]).c_str(),
                bytes_text(d.nvlink).c_str(), bytes_text(d.ib).c_str(), top.comm_s[1] / budget);
  }
  for (const char* hp : {"bf16", "fp32"}) {
    for (bool balanced : {false, true}) {
      PlanOptions oo = o;
      oo.higher_precision = hp;
      auto step_at = [&](double e) { return roofline(p, d, oo, e, CommMode::hidden, balanced).step; };
      double e = -1;
      if (step_at(1.0) <= budget) {
        double lo = 1e-6, hi = 1.0;
        for (int i = 0; i < 200; ++i) {
          const double mid = std::sqrt(lo * hi);
          (step_at(mid) > budget ? lo : hi) = mid;
        }
        e = hi;
      }
      std::printf("  (b) compute only, the router, eh_proj and head in %s%s, %s: ",
                  std::string(hp) == "bf16" ? "BF16" : "FP32", std::string(hp) == "bf16" ? " (as DeepSeek-V3)" : " (as fp8moe)",
                  balanced ? "stages balanced (each the stages' mean work)" : "the slowest stage setting the pace");
      if (e < 0) {
        std::printf("cannot be reached at any efficiency: at 1.0 the step takes %s\n", seconds_text(step_at(1.0)).c_str());
        continue;
      }
      const Roofline at = roofline(p, d, oo, e, CommMode::hidden, balanced);
      std::printf("efficiency %.3f (%s); per step %d x %s per micro-batch (compute %s, memory-bound %s) + bubble %s "
                  "(%d / %d, as configured) + optimizer %s\n",
                  e, verdict(e), L.micro_batches, seconds_text(at.compute_mb + at.memory_mb).c_str(),
                  seconds_text(at.compute_mb).c_str(), seconds_text(at.memory_mb).c_str(), seconds_text(at.bubble).c_str(),
                  L.pipeline - 1, L.micro_batches + L.pipeline - 1, seconds_text(at.optimizer).c_str());
    }
  }
  std::printf("  assumptions: the roofline above (one efficiency for every GEMM and the attention core, each at its own "
              "peak; the slowest stage sets the 1F1B pace unless `stages balanced`); train.recompute %s as configured "
              "(the recomputed forwards are compute; DeepSeek-V3 recomputed only selected cheap ops: --set "
              "train.recompute=none for that bound); (b) hides all tp/ep/pp/dp/edp bytes (DeepSeek-V3 reports DualPipe "
              "overlapping its all-to-all, FP8 dispatch and node-limited routing); this config's tokens per step for "
              "the whole run (DeepSeek-V3 ramped its batch up).\n",
              to_string(p.cfg.train.recompute).data());
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
  cmd->add_flag("!--no-probe", o->probe,
                "cpu: do not train the probe models of the config's blocks (seconds); the step time then comes from the "
                "measured GEMM, attention and memory rates alone (about 2-4x optimistic for small configs)");
  cmd->add_option("--baseline-bytes", o->baseline_bytes,
                  "cpu: the process's resident memory besides its tensors and the libraries' heap (default: the 202 MB "
                  "measured here, see app/plan.cpp)");
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
  const Device d = name == "cpu" ? cpu_device(c, L, o.probe) : gpu(name);
  const double eff = o.efficiency > 0 ? o.efficiency : d.cpu ? 1.0 : 0.4;
  const double baseline = d.cpu ? (o.baseline_bytes >= 0 ? o.baseline_bytes : kCpuProcessBaseline) + kCpuLibraryHeap : 0;

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
    std::printf("  RSS = tensors + the process %s (%s) + the libraries' heap %s (measured: app/plan.cpp); not "
                "modelled: the freed tensor memory glibc's heap keeps, which takes the peak RSS 1.4-1.8x above this "
                "after 10-15 steps (README \"Planning a run\")\n",
                bytes_text(baseline - kCpuLibraryHeap).c_str(), o.baseline_bytes >= 0 ? "--baseline-bytes" : "measured",
                bytes_text(kCpuLibraryHeap).c_str());
    std::printf("  all %d ranks together: %s\n", world, bytes_text(all).c_str());
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

  if (r.measured) {
    const CpuProbe& q = d.probe;
    const ModelConfig& g = c.model;
    const int Ld = std::min(g.first_dense_layers, g.n_layers), Lm = g.n_layers - Ld;
    std::printf("\nstep time (measured on this CPU: %d probe models of this config's blocks, trained 1 + 7 steps "
                "of two micro-batches each, interleaved, on `train`'s backend; each probe's fastest step):\n", q.probes);
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
    std::printf("  %.0f tokens/s. The probes' tokens: %s. Not in it: the step's data loading, loss and load "
                "read-backs and logging\n",
                step_tokens / r.step, q.real_data ? "the config's data.path (routed as training routes them)"
                                                  : "uniformly random (data.path unreadable: real text routes less evenly)");
  } else {
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
}
  std::printf("  device: %s\n", d.basis.c_str());

  if (o.tokens > 0) {
    const double hours = o.tokens / step_tokens * r.step * world / 3600;
    std::printf("\n%.4g tokens: %.4g steps, %.4g %s-hours (%.4g days on %d)\n", o.tokens, o.tokens / step_tokens, hours,
                name.c_str(), hours / world / 24, world);
    if (o.target_hours > 0) print_target(p, d, o, world, step_tokens);
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
