// This CPU as a device of `fp8moe plan`, measured when the plan runs: the rates of the CPU
// backend's FP8 GEMM, SGEMM and attention at the config's shapes, the memory bandwidth and RAM,
// and the step from probe models of the config's blocks trained on `train`'s backend (the trainer
// assembly of app/trainer.h, as `train` builds it; the modules' inputs from model/mtp.h).
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "app/plan_parts.h"
#include "app/trainer.h"
#include "io/token_data.h"
#include "kernels/attention.h"
#include "kernels/backend.h"
#include "kernels/elementwise.h"
#include "kernels/gemm_fp8.h"
#include "kernels/quantize.h"
#include "model/mtp.h"
#include "model/transformer.h"
#include "parallel/cpu_binding.h"

namespace fp8moe::plan_detail {
namespace {

// ---- the CPU, measured --------------------------------------------------------------------------

double seconds_of(const std::function<void()>& fn, int reps) {
  fn();  // warm-up: page faults, oneDNN's primitive creation and buffers
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

// The CPU attention kernels (kernels/cpu/attention.cpp; their BF16 forms under train.activations
// bf16) forward and backward on one micro-batch's shape, as FLOP/s of the causal count the plan
// uses (3 x forward).
double measure_attention(const ModelConfig& m, bool bf16, int64_t B, int64_t T, int64_t H) {
  const int64_t qk = m.qk_head_dim(), vd = m.v_dim(), KVH = m.mla() ? H : std::max<int64_t>(1, m.n_kv_heads * H / m.n_heads);
  const int64_t N = B * T;
  const std::vector<float> q = filled(N * H * qk, 1.0f), k = filled(N * KVH * qk, 1.0f), v = filled(N * KVH * vd, 1.0f),
                           dout = filled(N * H * vd, 1.0f);
  std::vector<uint16_t> q16, k16, v16;  // the BF16 form's operands (only when it is the one timed)
  if (bf16) {
    q16.resize(q.size()), k16.resize(k.size()), v16.resize(v.size());
    cpu::to_bf16(q.data(), q16.data(), int64_t(q.size()));
    cpu::to_bf16(k.data(), k16.data(), int64_t(k.size()));
    cpu::to_bf16(v.data(), v16.data(), int64_t(v.size()));
  }
  std::vector<float> out(size_t(N * H * vd)), lse(size_t(N * H)), dq(q.size()), dk(k.size()), dv(v.size());
  const double s = seconds_of([&] {
    if (bf16) {
      cpu::attention_forward_bf16(q16.data(), k16.data(), v16.data(), B, T, H, KVH, qk, vd, out.data(), lse.data());
      cpu::attention_backward_bf16(q16.data(), k16.data(), v16.data(), out.data(), lse.data(), dout.data(), B, T, H,
                                   KVH, qk, vd, dq.data(), dk.data(), dv.data());
      return;
    }
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

// One probe model of `dense` dense blocks then `moe` MoE blocks and `mtp` modules, at the widths
// one rank of the config's `tp`-way tensor parallelism holds (model/plan_model.h
// tensor_rank_model), on its own backend. step() times one training step of it: its first
// micro-batch (the step's FP8 weights quantized at first use), a second micro-batch (reusing them)
// and the optimizer.
struct ProbeTimes { double first = 0, cached = 0, optimizer = 0; };
class ProbeModel {
 public:
  ProbeModel(const Config& c, int tp, int dense, int moe, int mtp, int64_t B, int64_t T) : B_(B), T_(T), depth_(mtp) {
    pc_ = c;
    pc_.parallel.tensor = pc_.parallel.pipeline = pc_.parallel.expert = 1;
    pc_.parallel.micro_batches = 1;
    pc_.model.n_layers = dense + moe;
    pc_.model.first_dense_layers = dense;
    pc_.model.mtp_depth = mtp;
    pc_.model = tensor_rank_model(pc_.model, tp);
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
      DataBlend data(c.data.path, TokenCheck{c.model.vocab_size, 0, 1});
      for (int64_t b = 0; b < B; ++b) data.sample(c.train.seed, b, T, tok.data() + b * T, tgt.data() + b * T);
      real_data_ = true;
    } catch (const std::exception&) {
      uint32_t seed = 777;
      for (int64_t i = 0; i < N; ++i) seed = seed * 1664525u + 1013904223u, tok[size_t(i)] = int32_t((seed >> 8) % uint32_t(m.vocab_size));
      for (int64_t i = 0; i < N; ++i) tgt[size_t(i)] = (i + 1) % T ? tok[size_t(i + 1)] : tok[size_t(i)];
    }
    // (A tensor-parallel rank's vocabulary slice: the tokens folded into it.)
    if (tp > 1) {
      for (int32_t* t : {tok.data(), tgt.data()})
        for (int64_t i = 0; i < N; ++i) t[i] %= m.vocab_size;
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
  // Several ranks: each stage's blocks at the probes' times (model/plan_model.h stage_seconds),
  // each rank with the threads `train` gives it, while no two ranks share a CPU. Under tensor
  // parallelism the probes are a tensor-parallel rank's shards of the blocks (ProbeModel), and the
  // group's all-reduces are the plan's communication.
  p.tensor = L.tensor;
  if (L.world > 1 && L.world > omp_get_num_procs()) {
    p.why_not = std::to_string(L.world) + " ranks on " + std::to_string(omp_get_num_procs()) +
                " CPUs: the ranks take turns on them";
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
    big.train.global_batch = int(L.sequences) * big.parallel.micro_batches;  // the probes' micro-batch
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
  probes.push_back(std::make_unique<ProbeModel>(c, L.tensor, ad, am, 0, L.sequences, L.seq_len));
  // (Split into pipeline stages, each kind's time per block places probe A's blocks too; several
  // ranks may be split so by the layout search's candidates.)
  const bool split = L.world > 1;
  const int with_moe = Lm > am || (split && am > 0) ? int(probes.size()) : -1;
  if (with_moe >= 0) probes.push_back(std::make_unique<ProbeModel>(c, L.tensor, ad, am + 1, 0, L.sequences, L.seq_len));
  const int with_dense = Ld > ad || (split && ad > 0) ? int(probes.size()) : -1;
  if (with_dense >= 0) probes.push_back(std::make_unique<ProbeModel>(c, L.tensor, ad + 1, am, 0, L.sequences, L.seq_len));
  p.per_block = (ad == 0 || with_dense >= 0) && (am == 0 || with_moe >= 0);
  const int with_mtp = m.mtp_depth > 0 ? int(probes.size()) : -1;
  if (with_mtp >= 0) probes.push_back(std::make_unique<ProbeModel>(c, L.tensor, ad, am, 1, L.sequences, L.seq_len));
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

}  // namespace

Device cpu_device(const Config& c, const PlanLayout& L, bool probe) {
  Device d;
  d.name = "cpu";
  d.cpu = true;
  // The threads a rank of `train` runs with when the config's ranks on this machine share its CPUs
  // (parallel/cpu_binding.h), unless OMP_NUM_THREADS says.
  set_shared_binding_threads(L.world);
  const ModelConfig& m = c.model;
  const int64_t N = std::min<int64_t>(L.tokens(), 2048), D = m.d_model;
  const int64_t F = 2 * int64_t(m.moe.d_expert) / L.tensor;
  std::string impl = "-";
  d.fp8 = c.fp8.recipe != Fp8Recipe::off ? measure_fp8_gemm(c, N, D, F, &impl) : 0;
  d.fp32 = measure_sgemm(N, D, F);
  if (c.fp8.recipe == Fp8Recipe::off) d.fp8 = d.fp32;  // no FP8 GEMM runs: every linear layer is an SGEMM
  d.bf16 = d.fp32;
  d.attention = measure_attention(m, c.train.activations == ActivationDtype::bf16, std::max<int64_t>(1, N / L.seq_len),
                                  std::min<int64_t>(L.seq_len, N), m.n_heads / L.tensor);
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

}  // namespace fp8moe::plan_detail
