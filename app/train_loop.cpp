#include "app/train_loop.h"

#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "app/exit_codes.h"
#include "kernels/check.h"
#include "io/config.h"
#include "io/token_data.h"
#include "io/weights.h"
#include "kernels/gemm_fp8.h"
#include "model/optimizer.h"
#include "model/transformer.h"

namespace fp8moe {
namespace {

using Clock = std::chrono::steady_clock;

// FP32 GEMM throughput of this machine, measured once (the MFU denominator).
double measured_sgemm_flops() {
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

// Model FLOPs per token of one training step (forward + backward = 3x forward): 2 per weight of
// every matrix a token goes through (its k routed experts, not all of them) plus causal attention.
double model_flops_per_token(const ModelConfig& m, int64_t T) {
  const double D = m.d_model, q = double(m.n_heads) * m.head_dim, kv = double(m.n_kv_heads) * m.head_dim;
  double per_layer = 2 * (D * q + 2 * D * kv + q * D) + 2.0 * q * double(T);  // projections; QK^T and PV (causal: T/2 each)
  double total = 0;
  for (int l = 0; l < m.n_layers; ++l) {
    const double ffn = l < m.first_dense_layers
                           ? 2 * 3 * D * m.d_ff_dense
                           : 2 * 3 * D * m.moe.d_expert * double(m.moe.top_k + m.moe.n_shared_experts) + 2 * D * m.moe.n_experts;
    total += per_layer + ffn;
  }
  total += 2 * D * m.vocab_size;  // head
  return 3.0 * total;
}

int64_t peak_rss_bytes() {
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  return int64_t(ru.ru_maxrss) * 1024;
}

std::string json_number(double v) {
  if (!std::isfinite(v)) return "null";
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.9g", v);
  return buf;
}

}  // namespace

int train_one_rank(const Config& cfg) {
  const ParallelConfig& p = cfg.parallel;
  FP8MOE_ASSERT(p.tensor * p.pipeline * p.expert == 1, "train_one_rank with a parallel layout (refused by the caller)");
  if (cfg.data.path.empty()) return usage_error("data.path: empty; prepare a data set with `fp8moe prepare-data`");
  if (cfg.model.vocab_size < 256) return usage_error("model.vocab_size: the byte-level data needs at least 256");

  std::unique_ptr<TokenFile> train_data, val_data;
  try {
    train_data = std::make_unique<TokenFile>(cfg.data.path + ".train.tok");
    val_data = std::make_unique<TokenFile>(cfg.data.path + ".val.tok");
  } catch (const DataError& e) {
    return usage_error(std::string("data.path: ") + e.what());
  }
  const int64_t T = cfg.train.seq_len, mbs = cfg.train.global_batch / p.micro_batches;
  if (train_data->size() < T + 1) return usage_error(train_data->path() + ": fewer tokens than one sequence");
  const bool eval_on = cfg.eval.every > 0 && val_data->size() >= T + 1;
  if (cfg.eval.every > 0 && !eval_on)
    std::printf("note: %s has fewer than %lld tokens: no validation loss\n", val_data->path().c_str(), (long long)T + 1);

  std::FILE* jsonl = nullptr;
  if (!cfg.log.jsonl.empty()) {
    std::error_code ec;
    const auto parent = std::filesystem::path(cfg.log.jsonl).parent_path();
    if (!parent.empty()) std::filesystem::create_directories(parent, ec);
    jsonl = std::fopen(cfg.log.jsonl.c_str(), "w");
    if (!jsonl) return usage_error("log.jsonl: cannot write " + cfg.log.jsonl);
  }

  Transformer model(cfg);
  AdamW opt(model.table(), cfg.train);
  LossScaler scaler(cfg.train);
  const double peak = measured_sgemm_flops();
  const double flops_per_token = model_flops_per_token(cfg.model, T);
  std::printf("training %lld parameters for %lld steps of %d x %lld tokens (%lld micro-batches), recipe %s; "
              "MFU against the measured FP32 SGEMM peak of %.0f GFLOP/s\n",
              (long long)model.table().trainable_numel(), (long long)cfg.train.steps, cfg.train.global_batch,
              (long long)T, (long long)p.micro_batches, std::string(to_string(cfg.fp8.recipe)).c_str(), peak * 1e-9);
  if (cfg.checkpoint.every > 0)
    std::printf("note: periodic checkpoints are not written yet in this build; the final weights are\n");

  std::vector<int32_t> tokens(size_t(mbs * T)), targets(size_t(mbs * T));
  auto validation_loss = [&]() {
    double sum = 0;
    int64_t n = 0;
    for (int b = 0; b < cfg.eval.batches; ++b) {
      for (int64_t i = 0; i < mbs; ++i)  // fixed sequences: their own seed, samples 0 .. batches * mbs - 1
        val_data->sample(uint64_t(cfg.train.seed) ^ 0x76616cull, b * mbs + i, T, &tokens[i * T], &targets[i * T]);
      const StepResult r = model.forward_backward(tokens.data(), targets.data(), mbs, T, false);
      sum += r.ce * double(r.tokens), n += r.tokens;
    }
    return n > 0 ? sum / double(n) : NAN;
  };

  const auto t_start = Clock::now();
  double last_val = NAN;
  for (int64_t step = 0; step < cfg.train.steps; ++step) {
    const auto t0 = Clock::now();
    model.zero_grads();
    double loss = 0;
    int64_t saturated = 0, underflowed = 0;
    std::vector<std::vector<int64_t>> load;
    for (int mb = 0; mb < p.micro_batches; ++mb) {
      for (int64_t i = 0; i < mbs; ++i)
        train_data->sample(uint64_t(cfg.train.seed), step * cfg.train.global_batch + mb * mbs + i, T, &tokens[i * T],
                           &targets[i * T]);
      const StepResult r = model.forward_backward(tokens.data(), targets.data(), mbs, T, true, scaler.scale());
      loss += r.loss / p.micro_batches;
      saturated += r.fp8_saturated, underflowed += r.fp8_underflowed;
      if (load.empty()) load = r.expert_load;
      else
        for (size_t l = 0; l < load.size(); ++l)
          for (size_t e = 0; e < load[l].size(); ++e) load[l][e] += r.expert_load[l][e];
    }
    // Each micro-batch's gradient is of its (scaled) mean loss: average them and divide the scale out.
    const float unscale = 1.0f / (float(p.micro_batches) * scaler.scale());
    if (unscale != 1.0f)
      for (auto& g : model.grads())
        for (float& x : g) x *= unscale;
    const float used_scale = scaler.scale();
    const OptimizerStats st = opt.step(model.params(), model.grads(), step);
    scaler.update(!st.skipped);
    if (!st.skipped && !load.empty()) model.update_router_biases(load);

    // The step's time (and so tokens/s and MFU) excludes the evaluation that may follow it.
    const double step_s = std::chrono::duration<double>(Clock::now() - t0).count();
    const bool last = step + 1 == cfg.train.steps;
    const bool evaluated = eval_on && ((step + 1) % cfg.eval.every == 0 || last);
    if (evaluated) last_val = validation_loss();
    if ((step + 1) % cfg.log.every != 0 && !last) continue;

    double imbalance = NAN;  // max over MoE layers of max load / mean load
    for (const auto& layer : load) {
      const double mean = double(std::accumulate(layer.begin(), layer.end(), int64_t(0))) / double(layer.size());
      if (mean > 0) imbalance = std::max(std::isnan(imbalance) ? 0.0 : imbalance, double(*std::max_element(layer.begin(), layer.end())) / mean);
    }
    const double tokens_per_s = double(cfg.train.global_batch) * double(T) / step_s;
    const double mfu = tokens_per_s * flops_per_token / peak;
    const double elapsed = std::chrono::duration<double>(Clock::now() - t_start).count();
    const double eta = elapsed / double(step + 1) * double(cfg.train.steps - step - 1);
    char val[32] = "  -   ";
    if (!std::isnan(last_val)) std::snprintf(val, sizeof val, "%.4f", last_val);
    std::printf("step %5lld/%lld  loss %.4f  val %s  lr %.3e  gnorm %.3f  %6.0f tok/s  %.2f s/step  mfu %.2f  "
                "mem %.0f MB  load %.2f  sat %lld  under %lld  skipped %lld  eta %.0f s\n",
                (long long)step + 1, (long long)cfg.train.steps, loss, val, st.lr, st.grad_norm,
                tokens_per_s, step_s, mfu, double(peak_rss_bytes()) / 1e6, imbalance, (long long)saturated,
                (long long)underflowed, (long long)opt.skipped(), eta);
    std::fflush(stdout);
    if (jsonl) {
      std::fprintf(jsonl,
                   "{\"step\":%lld,\"loss\":%s,\"val_loss\":%s,\"lr\":%s,\"grad_norm\":%s,\"tokens_per_s\":%s,"
                   "\"step_time_s\":%s,\"mfu\":%s,\"peak_mem_bytes\":%lld,\"expert_load_imbalance\":%s,"
                   "\"fp8_saturated\":%lld,\"fp8_underflowed\":%lld,\"skipped_steps\":%lld,\"loss_scale\":%s}\n",
                   (long long)step + 1, json_number(loss).c_str(), json_number(evaluated ? last_val : NAN).c_str(),
                   json_number(st.lr).c_str(),
                   json_number(st.grad_norm).c_str(), json_number(tokens_per_s).c_str(), json_number(step_s).c_str(),
                   json_number(mfu).c_str(), (long long)peak_rss_bytes(), json_number(imbalance).c_str(),
                   (long long)saturated, (long long)underflowed, (long long)opt.skipped(), json_number(used_scale).c_str());
      std::fflush(jsonl);
    }
  }
  if (jsonl) std::fclose(jsonl);
  std::printf("done: %lld steps in %.1f s; final validation loss %s\n", (long long)cfg.train.steps,
              std::chrono::duration<double>(Clock::now() - t_start).count(), json_number(last_val).c_str());
  // The weights for `fp8moe generate` (a plain file until the HDF5 checkpoints land).
  std::error_code ec;
  std::filesystem::create_directories(cfg.checkpoint.dir, ec);
  const std::string weights = cfg.checkpoint.dir + "/final.weights";
  try {
    save_weights(weights, config_to_yaml(cfg), model.table(), model.params());
  } catch (const WeightsError& e) {
    return usage_error(std::string("checkpoint.dir: ") + e.what());
  }
  std::printf("weights written to %s (fp8moe generate --checkpoint %s --prompt ...)\n", weights.c_str(),
              cfg.checkpoint.dir.c_str());
  return kExitOk;
}

}  // namespace fp8moe
