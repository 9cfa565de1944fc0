#include "app/step_report.h"

#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <vector>

#include "kernels/gemm_fp8.h"

namespace fp8moe {
namespace {

// FP32 GEMM throughput of this machine, measured once (the MFU denominator).
double measured_sgemm_flops() {
  using Clock = std::chrono::steady_clock;
  const int64_t n = 1024;
  std::vector<float> a(size_t(n * n), 0.5f), b(size_t(n * n), 0.25f), c(size_t(n * n));
  sgemm(false, false, n, n, n, 1.0f, a.data(), n, b.data(), n, 0.0f, c.data(), n);  // warm-up
  double best = 0;
  for (int rep = 0; rep < 3; ++rep) {
    const auto t0 = Clock::now();
    sgemm(false, false, n, n, n, 1.0f, a.data(), n, b.data(), n, 0.0f, c.data(), n);
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();
    best = std::max(best, 2.0 * double(n) * n * n / s);
  }
  return best;
}

int64_t peak_rss_bytes() {
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  return int64_t(ru.ru_maxrss) * 1024;
}

}  // namespace

double model_flops_per_token(const ModelConfig& m, int64_t T) {
  const double D = m.d_model, H = m.n_heads;
  // Projections; then QK^T and PV, causal: T/2 keys per query on average.
  double per_layer = 0;
  if (m.mla()) {
    const double qk = m.qk_head_dim(), v = m.v_head_dim, ql = m.q_lora_rank, kvl = m.kv_lora_rank;
    const double q_proj = ql > 0 ? D * ql + ql * H * qk : D * H * qk;
    per_layer = 2 * (q_proj + D * (kvl + m.qk_rope_head_dim) + kvl * H * (m.qk_nope_head_dim + v) + H * v * D) +
                H * (qk + v) * double(T);
  } else {
    const double q = H * m.head_dim, kv = double(m.n_kv_heads) * m.head_dim;
    per_layer = 2 * (D * q + 2 * D * kv + q * D) + 2.0 * q * double(T);
  }
  const double moe_ffn = 2 * 3 * D * m.moe.d_expert * double(m.moe.top_k + m.moe.n_shared_experts) + 2 * D * m.moe.n_experts;
  double total = 0;
  for (int l = 0; l < m.n_layers; ++l) total += per_layer + (l < m.first_dense_layers ? 2 * 3 * D * m.d_ff_dense : moe_ffn);
  total += 2 * D * m.vocab_size;  // head
  // Each multi-token prediction module: eh_proj, an MoE block, the head.
  total += m.mtp_depth * (2 * 2 * D * D + per_layer + moe_ffn + 2 * D * m.vocab_size);
  return 3.0 * total;
}

double load_imbalance(const std::vector<std::vector<int64_t>>& expert_load) {
  double imbalance = NAN;
  for (const auto& layer : expert_load) {
    const double mean = double(std::accumulate(layer.begin(), layer.end(), int64_t(0))) / double(layer.size());
    if (mean > 0)
      imbalance = std::max(std::isnan(imbalance) ? 0.0 : imbalance, double(*std::max_element(layer.begin(), layer.end())) / mean);
  }
  return imbalance;
}

Peak training_peak(const Config& cfg, const Backend& be, int ranks) {
  if (be.kind() != DeviceKind::cuda) return {measured_sgemm_flops() * double(ranks), "the measured FP32 SGEMM peak"};
  const bool fp8_gemms = cfg.fp8.recipe != Fp8Recipe::off;
  return {be.dense_peak_flops(fp8_gemms) * double(ranks),
          fp8_gemms ? "the GPU's dense FP8 peak" : "the GPU's FP32 peak (no TF32)"};
}

StepReporter::StepReporter(const Config& cfg, const Backend& be, Communicator& world, MetricsLog& log, const Peak& peak)
    : cfg_(cfg), be_(be), world_(world), log_(log), peak_(peak),
      flops_per_token_(model_flops_per_token(cfg.model, cfg.train.seq_len)) {}

void StepReporter::report(const StepSummary& s) {
  const bool on_device = be_.kind() != DeviceKind::cpu, pipeline = !std::isnan(s.bubble);
  // The maxima over the ranks: host and device memory, host synchronisations and bytes each way.
  double most[5] = {double(peak_rss_bytes()), double(be_.memory_stats().peak), double(s.transfers.host_syncs),
                    double(s.transfers.h2d_bytes), double(s.transfers.d2h_bytes)};
  world_.allreduce_max(most, 5);
  const double mem = most[0], dmem = most[1];
  const double tokens_per_s = double(cfg_.train.global_batch) * double(cfg_.train.seq_len) / s.step_s;
  const double mfu = tokens_per_s * flops_per_token_ / peak_.flops;
  if (world_.rank() == 0) {
    char dmem_text[48] = "";
    if (on_device) std::snprintf(dmem_text, sizeof dmem_text, "  dmem %.0f MB", dmem / 1e6);
    char val[32] = "  -   ";
    if (!std::isnan(s.last_val_loss)) std::snprintf(val, sizeof val, "%.4f", s.last_val_loss);
    char mtp[32] = "";
    if (!std::isnan(s.mtp_loss)) std::snprintf(mtp, sizeof mtp, "  mtp %.4f", s.mtp_loss);
    char bubble[64] = "";
    if (pipeline) std::snprintf(bubble, sizeof bubble, "  bubble %.2f (ideal %.2f)", s.bubble, s.bubble_ideal);
    // The loss also as its exact bits (%a): resumed and uninterrupted runs are compared bitwise.
    char comm[48] = "";
    if (world_.size() > 1) std::snprintf(comm, sizeof comm, "  comm %.3f s", s.comm_exposed_s);
    std::printf("step %5lld/%lld  loss %.4f%s  val %s  lr %.3e  gnorm %.3f  %6.0f tok/s  %.2f s/step  mfu %.2f  "
                "mem %.0f MB%s  syncs %.0f  load %.2f  sat %lld  under %lld  skipped %lld%s%s  eta %.0f s  [%a]\n",
                (long long)s.step, (long long)cfg_.train.steps, s.loss, mtp, val, s.lr, s.grad_norm, tokens_per_s, s.step_s,
                mfu, mem / 1e6, dmem_text, most[2], s.expert_load_imbalance, (long long)s.fp8_saturated,
                (long long)s.fp8_underflowed, (long long)s.skipped_steps, bubble, comm, s.eta_s, s.loss);
    std::fflush(stdout);
  }
  StepMetrics m;
  m.step = s.step, m.loss = s.loss, m.mtp_loss = s.mtp_loss, m.val_loss = s.val_loss, m.lr = s.lr;
  m.grad_norm = s.grad_norm, m.tokens_per_s = tokens_per_s, m.step_time_s = s.step_s, m.mfu = mfu;
  m.peak_mem_bytes = int64_t(mem);
  if (on_device) m.peak_device_mem_bytes = int64_t(dmem);
  m.expert_load_imbalance = s.expert_load_imbalance, m.fp8_saturated = s.fp8_saturated;
  m.fp8_underflowed = s.fp8_underflowed, m.skipped_steps = s.skipped_steps, m.loss_scale = s.loss_scale;
  m.pipeline_bubble = s.bubble, m.pipeline_bubble_ideal = s.bubble_ideal, m.comm_exposed_s = s.comm_exposed_s;
  m.host_syncs = int64_t(most[2]), m.h2d_bytes = int64_t(most[3]), m.d2h_bytes = int64_t(most[4]);
  log_.write(m);
}

}  // namespace fp8moe
