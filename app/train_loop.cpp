#include "app/train_loop.h"

#include <sys/resource.h>

#include <csignal>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "app/exit_codes.h"
#include "kernels/check.h"
#include "kernels/device.h"
#include "io/config.h"
#include "io/token_data.h"
#include "io/checkpoint.h"
#include "io/metrics.h"
#include "parallel/pipeline_schedule.h"
#include "kernels/gemm_fp8.h"
#include "model/data_parallel.h"
#include "model/optimizer.h"
#include "model/transformer.h"
#include "parallel/mpi_communicator.h"
#include "parallel/grid.h"
#include "parallel/mpi_session.h"

namespace fp8moe {
namespace {

volatile std::sig_atomic_t g_stop_signal = 0;  // the signal that asked for a stop, 0 = none
extern "C" void on_stop_signal(int sig) { g_stop_signal = sig; }

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

void install_stop_handlers() {
  struct sigaction sa {};
  sa.sa_handler = on_stop_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;  // MPI and file calls carry on; the flag is read between steps
  sigaction(SIGUSR1, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
}

int train(const Config& cfg, const ProcessGrid& grid) {
  const ParallelConfig& p = cfg.parallel;

  MpiCommunicator world(grid.world());
  // The groups' collectives over MPI or NCCL (runtime.comm, resolved by app/train.cpp).
  const bool nccl = cfg.runtime.comm == CommChoice::nccl;
  const auto dp_comm = make_group_communicator(grid.data(), nccl), tp_comm = make_group_communicator(grid.tensor(), nccl),
             ep_comm = make_group_communicator(grid.expert(), nccl),
             edp_comm = make_group_communicator(grid.expert_data(), nccl);
  Communicator& dp = *dp_comm;  // the data-parallel replicas of this rank's (tp, pp) position
  Communicator &tp = *tp_comm, &ep = *ep_comm, &edp = *edp_comm;
  const bool root = world.rank() == 0;
  // Bad input is found on every rank alike (the same files, the same config): every rank returns
  // the same status, only rank 0 speaks.
  auto fail = [&](const std::string& message) { return root ? usage_error(message) : kExitUsage; };
  if (cfg.data.path.empty())
    return fail("data.path: empty; prepare a data set with `fp8moe prepare-data` or scripts/tokenize-data.py");

  // Every data set is validated on open; each rank checks the token ids of its own part of every
  // data set. A problem on any rank (its part, or files that differ between nodes) stops every
  // rank with exit 2, and rank 0 prints the lowest failing rank's message.
  const TokenCheck check{cfg.model.vocab_size, world.rank(), world.size()};
  // Each step's global batch is micro_batches micro-batches; the data-parallel replicas split each
  // micro-batch: replica r computes its sequences [r * mbs, (r + 1) * mbs). Sample positions are
  // global, so the step sees the same sequences on any number of replicas.
  const int64_t T = cfg.train.seq_len, R = dp.size(), mbs = cfg.train.global_batch / (p.micro_batches * R);
  std::unique_ptr<DataBlend> train_data, val_data;
  std::string data_error;
  try {
    train_data = std::make_unique<DataBlend>(cfg.data.path, check);
    for (const auto& set : train_data->sets())
      if (set->size() < T + 1)
        throw DataError(set->prefix() + ": " + std::to_string(set->size()) +
                        " tokens, fewer than one sequence of train.seq_len + 1 = " + std::to_string(T + 1));
  } catch (const DataError& e) {
    data_error = std::string("data.path: ") + e.what();
  }
  try {
    if (data_error.empty() && !cfg.data.valid_path.empty())
      val_data = std::make_unique<DataBlend>(cfg.data.valid_path, check);
  } catch (const DataError& e) {
    data_error = std::string("data.valid_path: ") + e.what();
  }
  data_error = first_error(grid.world(), data_error);
  if (!data_error.empty()) return fail(data_error);
  bool eval_on = cfg.eval.every > 0 && val_data != nullptr;
  if (cfg.eval.every > 0 && !val_data && root) std::printf("note: no data.valid_path: no validation loss\n");
  if (eval_on && val_data->min_size() < T + 1) {
    eval_on = false;
    if (root) std::printf("note: a data.valid_path data set has fewer than %lld tokens: no validation loss\n", (long long)T + 1);
  }

  MetricsLog jsonl;  // log.jsonl, written by rank 0 (io/metrics.h)
  std::string jsonl_error;
  if (root && !cfg.log.jsonl.empty()) {
    try {
      jsonl = MetricsLog(cfg.log.jsonl);
    } catch (const std::runtime_error& e) {
      jsonl_error = e.what();
    }
  }
  if (any_rank(grid.world(), !jsonl_error.empty())) return fail(jsonl_error);

  MpiCommunicator pipe(grid.pipeline());  // NOTE: MPI also under NCCL: see runtime.comm's documentation
  Transformer model(cfg, ModelGroups{.pipeline = &pipe, .tensor = &tp, .data = &dp, .expert = &ep, .expert_data = &edp});
  std::vector<Shard> shards;
  for (size_t i = 0; i < model.table().params.size(); ++i) shards.push_back(model.shard(i));
  ReplicaSync sync(model.table(), shards, dp, edp, world, tp.rank(), cfg.optim.zero == 1);
  AdamW opt(sync.local_table(), cfg.train, sync.owned());
  LossScaler scaler(cfg.train);
  TrainProgress progress;
  const GridDims& gd = grid.dims();
  const TrainerState state{&cfg, &model, &opt, &scaler, &progress,
                           "tensor " + std::to_string(gd.tensor) + " x pipeline " + std::to_string(gd.pipeline) +
                               " x expert " + std::to_string(gd.expert) + " x data " + std::to_string(gd.data) + " (" +
                               std::to_string(gd.world) + std::string(gd.world == 1 ? " rank)" : " ranks)"),
                           sync.write_rows(), sync.moment_write_rows()};
  std::string resumed;
  try {
    resumed = resume_from_checkpoint(grid.world(), state);
  } catch (const CheckpointError& e) {
    return fail(std::string("checkpoint.resume: ") + e.what());
  }
  const int64_t first_step = progress.step;
  if (resumed.empty() && !jsonl.restart())  // a fresh run: a fresh log
    std::fprintf(stderr, "fp8moe: warning: log.jsonl: cannot empty %s: no metrics log\n", cfg.log.jsonl.c_str());
  if (root && !resumed.empty())
    std::printf("resumed from %s: step %lld, %lld tokens consumed\n", resumed.c_str(), (long long)progress.step,
                (long long)progress.tokens);
  if (first_step >= cfg.train.steps) {
    if (root) std::printf("nothing to train: the checkpoint is at step %lld, train.steps is %lld\n",
                          (long long)first_step, (long long)cfg.train.steps);
    return kExitOk;
  }
  const bool on_gpu = cfg.runtime.device == DeviceChoice::cuda;
  const bool fp8_gemms = cfg.fp8.recipe != Fp8Recipe::off;
  std::string peak_basis = "the measured FP32 SGEMM peak";
  double peak = 0;
  if (on_gpu) {  // NaN (MFU not reported) on a GPU whose peak we do not know
    peak = gpu_dense_peak_flops(fp8_gemms) * double(world.size());
    peak_basis = fp8_gemms ? "the GPU's dense FP8 peak" : "the GPU's FP32 peak (no TF32)";
  } else {
    peak = measured_sgemm_flops() * double(world.size());
  }
  const double flops_per_token = model_flops_per_token(cfg.model, T);
  if (root)
    std::printf("training %lld parameters for steps %lld..%lld of %d x %lld tokens on %s: %lld micro-batches of "
                "%lld sequences per data-parallel rank, recipe %s; %s\n",
                (long long)model.table().trainable_numel(), (long long)first_step + 1, (long long)cfg.train.steps,
                cfg.train.global_batch, (long long)T, state.layout.c_str(), (long long)p.micro_batches, (long long)mbs,
                std::string(to_string(cfg.fp8.recipe)).c_str(),
                std::isnan(peak) ? "no MFU: fp8moe does not know this GPU's peak"
                                 : ("MFU against " + peak_basis + " of " + std::to_string(int64_t(peak * 1e-9)) + " GFLOP/s").c_str());

  {
    double state[2] = {double(opt.state_bytes()), double(opt.state_bytes())};  // max, sum over ranks
    world.allreduce_max(&state[0], 1);
    world.allreduce_sum(&state[1], 1);
    if (root)
      std::printf("optimizer state (Adam moments): %.1f MB per rank, %.1f MB in all (%s)\n", state[0] / 1e6,
                  state[1] / 1e6, sync.zero() ? "optim.zero 1: sharded over the data-parallel replicas" : "full copies");
  }

  auto checkpoint = [&]() -> bool {
    try {
      const std::string dir = save_checkpoint(grid.world(), state);
      if (root) std::printf("checkpoint %s committed\n", dir.c_str());
      std::fflush(stdout);
      return true;
    } catch (const CheckpointError& e) {
      if (root) std::fprintf(stderr, "fp8moe: error: checkpoint save failed: %s (the previous checkpoint is intact)\n", e.what());
      return false;
    }
  };

  std::vector<int32_t> tokens(size_t(mbs * T)), targets(size_t(mbs * T));
  // Pipeline parallelism: stage s receives activations from s - 1 and gradients from s + 1; sends
  // are non-blocking (collected once a step), receives block, and the time they block is the
  // stage's share of the pipeline bubble.
  const int P = pipe.size(), stage = pipe.rank(), M = p.micro_batches;
  const bool first = model.first_stage(), last = model.last_stage();
  const int64_t act = mbs * T * cfg.model.d_model;
  std::vector<float> x_in(first ? 0 : size_t(act)), dy_in(last ? 0 : size_t(act));
  double waited = 0;  // seconds blocked in pipeline receives this step
  auto pipe_recv = [&](float* buf, int peer, int tag) {
    const auto t0 = Clock::now();
    pipe.recv(buf, act, peer, tag);
    waited += std::chrono::duration<double>(Clock::now() - t0).count();
  };

  auto validation_loss = [&]() {
    double sums[2] = {0, 0};  // sum of CE over tokens, tokens (the last stage's)
    for (int b = 0; b < cfg.eval.batches; ++b) {
      for (int64_t i = 0; i < mbs; ++i)  // fixed sequences: their own seed, the same set on any layout
        val_data->sample(uint64_t(cfg.train.seed) ^ 0x76616cull, (b * R + dp.rank()) * mbs + i, T, &tokens[i * T],
                         &targets[i * T]);
      if (!first) pipe_recv(x_in.data(), stage - 1, 0);
      const StageRun run = model.stage_forward(tokens.data(), targets.data(), mbs, T, first ? nullptr : x_in.data(), false);
      if (!last) {
        pipe.isend(run.output(), act, stage + 1, 0);
        pipe.wait_sends();
      } else {
        sums[0] += run.result().ce * double(run.result().tokens), sums[1] += double(run.result().tokens);
      }
    }
    dp.allreduce_sum(sums, 2);
    pipe.allreduce_sum(sums, 2);
    return sums[1] > 0 ? sums[0] / sums[1] : NAN;
  };

  // Communication accounting: bytes each group's communicator sent in the last step (summed over
  // the ranks), beside the analytical count of the layout (README "Communication"):
  //   tp  per micro-batch: (4 L_s + first + last) all-reduces of N x D floats, MoE layers' gate
  //       gradients (N x k doubles), the cross-entropy's 3 vectors of N; each all-reduce of B bytes
  //       sends 2 (T - 1) / T x B.
  //   ep  per MoE layer and micro-batch: 4 x (routed rows whose expert is on another rank) x D
  //       floats (dispatch and combine, forward and backward) + the counts (P - 1) x L x 8.
  //   dp, edp  the bucket of the dense (expert) trainable parameters this rank holds, B bytes:
  //       ZeRO-1 reduce-scatter + all-gather, or an all-reduce: 2 (R - 1) / R x B.
  //   pp  per micro-batch: N x D floats to the next stage (not the last) and to the previous one
  //       (not the first).
  // The measured counts also hold the small collectives (token counts, loss, loads): ratio >= 1.
  std::vector<Communicator*> groups = {&tp, &ep, &dp, &edp, &pipe};
  const char* group_names[] = {"tp", "ep", "dp", "edp", "pp"};
  double comm_measured[5] = {}, comm_expected[5] = {};
  auto account_communication = [&](double rows_off) {
    const ModelConfig& m = cfg.model;
    const double N = double(mbs * T), D = m.d_model, Mb = M;
    const auto [l0, l1] = stage_layers(m.n_layers, stage, P);
    const double Ls = l1 - l0, Lm = std::max(0, l1 - std::max(l0, m.first_dense_layers));
    auto ring = [](int n) { return n > 1 ? 2.0 * (n - 1) / n : 0.0; };
    double local[10] = {};
    for (int g = 0; g < 5; ++g) local[g] = double(groups[size_t(g)]->bytes_sent());
    local[5] = ring(tp.size()) * Mb *
               ((4 * Ls + (first ? 1 : 0) + (last ? 1 : 0)) * N * D * 4 + Lm * N * m.moe.top_k * 8 + (last ? N * 20 : 0));
    const int Pe = ep.size(), Le = m.moe.n_experts / Pe;
    local[6] = Pe > 1 ? 4 * rows_off * D * 4 + Mb * Lm * (Pe - 1) * Le * 8 : 0;
    double dense = 0, experts = 0;
    for (size_t i = 0; i < model.table().params.size(); ++i)
      if (model.holds(i) && model.table().params[i].trainable)
        (model.table().params[i].expert >= 0 ? experts : dense) += double(model.shard(i).numel()) * 4;
    local[7] = ring(dp.size()) * dense;
    local[8] = ring(edp.size()) * experts;
    local[9] = Mb * N * D * 4 * ((last ? 0 : 1) + (first ? 0 : 1));
    world.allreduce_sum(local, 10);
    for (int g = 0; g < 5; ++g) comm_measured[g] = local[g], comm_expected[g] = local[5 + g];
  };

  const auto t_start = Clock::now();
  int64_t steps_run = 0;
  for (int64_t step = first_step; step < cfg.train.steps; ++step) {
    const auto t0 = Clock::now();
    model.zero_grads();
    double loss_sum = 0, fp8[2] = {0, 0};  // loss; FP8 saturated, underflowed
    const int moe_layers = cfg.model.n_layers - cfg.model.first_dense_layers;
    std::vector<int64_t> load_flat(static_cast<size_t>(moe_layers * cfg.model.moe.n_experts), 0);
    std::vector<StageRun> runs(static_cast<size_t>(M));
    waited = 0;
    for (Communicator* c : groups) c->reset_bytes_sent();
    double rows_off_rank = 0;  // routed rows whose expert lives on another expert-parallel rank
    auto forward = [&](int mb) {
      for (int64_t i = 0; i < mbs; ++i)
        train_data->sample(uint64_t(cfg.train.seed), progress.samples + (mb * R + dp.rank()) * mbs + i, T,
                           &tokens[i * T], &targets[i * T]);
      // The micro-batch's counted tokens over all replicas: each replica's loss is its share of
      // the micro-batch's mean, so gradients have the 1-rank magnitudes and sum over the replicas.
      int64_t counted = std::count_if(targets.begin(), targets.end(), [&](int32_t t) { return t != cfg.model.pad_id; });
      if (R > 1) dp.allreduce_sum(&counted, 1);
      if (!first) pipe_recv(x_in.data(), stage - 1, 2 * mb);
      runs[size_t(mb)] = model.stage_forward(tokens.data(), targets.data(), mbs, T, first ? nullptr : x_in.data(), true,
                                             scaler.scale(), counted, 1.0 / double(R));
      if (!last) pipe.isend(runs[size_t(mb)].output(), act, stage + 1, 2 * mb);
      const StepResult& r = runs[size_t(mb)].result();
      loss_sum += r.loss / double(M);
      for (size_t l = 0; l < r.expert_load.size(); ++l)
        for (size_t e = 0; e < r.expert_load[l].size(); ++e) {
          load_flat[l * r.expert_load[l].size() + e] += r.expert_load[l][e];
          const int owner = int(e) / (cfg.model.moe.n_experts / ep.size());
          if (owner != ep.rank()) rows_off_rank += double(r.expert_load[l][e]);
        }
    };
    auto backward = [&](int mb) {
      if (!last) pipe_recv(dy_in.data(), stage + 1, 2 * mb + 1);
      model.stage_backward(runs[size_t(mb)], last ? nullptr : dy_in.data());
      if (!first) pipe.isend(runs[size_t(mb)].input_grad(), act, stage - 1, 2 * mb + 1);
      fp8[0] += double(runs[size_t(mb)].result().fp8_saturated), fp8[1] += double(runs[size_t(mb)].result().fp8_underflowed);
    };
    for (const PipelineOp& op : one_f_one_b(P, stage, M)) op.forward ? forward(op.micro_batch) : backward(op.micro_batch);
    pipe.wait_sends();
    runs.clear();
    // The loss (last stage; aux losses from every stage) and expert loads: summed over the replicas
    // and the stages; FP8 counts over every rank.
    double counts[3] = {loss_sum, 0, 0};
    dp.allreduce_sum(counts, 1);
    pipe.allreduce_sum(counts, 1);
    world.allreduce_sum(fp8, 2);
    dp.allreduce_sum(load_flat.data(), int64_t(load_flat.size()));
    pipe.allreduce_sum(load_flat.data(), int64_t(load_flat.size()));
    counts[1] = fp8[0], counts[2] = fp8[1];
    std::vector<std::vector<int64_t>> load(static_cast<size_t>(moe_layers));
    for (int l = 0; l < moe_layers; ++l)
      load[size_t(l)].assign(load_flat.begin() + l * cfg.model.moe.n_experts,
                             load_flat.begin() + (l + 1) * cfg.model.moe.n_experts);
    // Each micro-batch's gradient is of its (scaled) mean loss, summed over the replicas: average
    // over the micro-batches and divide the scale out.
    const float unscale = 1.0f / (float(p.micro_batches) * scaler.scale());
    sync.reduce_gradients(model.grads());
    if (unscale != 1.0f)
      for (auto& g : model.grads())
        for (float& x : g) x *= unscale;
    const float used_scale = scaler.scale();
    const OptimizerStats st = opt.step(model.params(), model.grads(), step, sync.norm());
    if (!st.skipped) sync.gather_weights(model.params());
    account_communication(rows_off_rank);
    scaler.update(!st.skipped);
    if (!st.skipped && !load.empty()) model.update_router_biases(load);
    progress.step = step + 1;
    progress.samples += cfg.train.global_batch;
    progress.tokens += int64_t(cfg.train.global_batch) * T;
    ++steps_run;
    const double loss = counts[0];
    const auto saturated = int64_t(counts[1]), underflowed = int64_t(counts[2]);

    // The step's time (and so tokens/s and MFU) excludes the evaluation that may follow it.
    double step_s = std::chrono::duration<double>(Clock::now() - t0).count();
    world.allreduce_max(&step_s, 1);
    // The pipeline bubble: the stages' mean fraction of the step spent waiting for a neighbour,
    // beside the 1F1B ideal (P - 1) / (M + P - 1).
    double bubble = step_s > 0 ? waited / step_s : 0;
    pipe.allreduce_sum(&bubble, 1);
    bubble /= double(P);
    const double bubble_ideal = double(P - 1) / double(M + P - 1);
    const bool final_step = step + 1 == cfg.train.steps;
    const bool evaluated = eval_on && ((step + 1) % cfg.eval.every == 0 || final_step);
    if (evaluated) progress.last_val_loss = validation_loss();
    const double last_val = progress.last_val_loss;
    if ((step + 1) % cfg.log.every == 0 || final_step) {
      double imbalance = NAN;  // max over MoE layers of max load / mean load
      for (const auto& layer : load) {
        const double mean = double(std::accumulate(layer.begin(), layer.end(), int64_t(0))) / double(layer.size());
        if (mean > 0)
          imbalance = std::max(std::isnan(imbalance) ? 0.0 : imbalance,
                               double(*std::max_element(layer.begin(), layer.end())) / mean);
      }
      double mems[2] = {double(peak_rss_bytes()), double(device_memory_stats().peak)};  // host, device
      world.allreduce_max(mems, 2);
      const double mem = mems[0], dmem = mems[1];
      char dmem_text[48] = "";
      if (on_gpu) std::snprintf(dmem_text, sizeof dmem_text, "  dmem %.0f MB", dmem / 1e6);
      const double tokens_per_s = double(cfg.train.global_batch) * double(T) / step_s;
      const double mfu = tokens_per_s * flops_per_token / peak;
      const double elapsed = std::chrono::duration<double>(Clock::now() - t_start).count();
      const double eta = elapsed / double(steps_run) * double(cfg.train.steps - step - 1);
      char val[32] = "  -   ";
      if (!std::isnan(last_val)) std::snprintf(val, sizeof val, "%.4f", last_val);
      char pipeline[64] = "";
      if (P > 1) std::snprintf(pipeline, sizeof pipeline, "  bubble %.2f (ideal %.2f)", bubble, bubble_ideal);
      if (root) {
        // The loss also as its exact bits (%a): resumed and uninterrupted runs are compared bitwise.
        std::printf("step %5lld/%lld  loss %.4f  val %s  lr %.3e  gnorm %.3f  %6.0f tok/s  %.2f s/step  mfu %.2f  "
                    "mem %.0f MB%s  load %.2f  sat %lld  under %lld  skipped %lld%s  eta %.0f s  [%a]\n",
                    (long long)step + 1, (long long)cfg.train.steps, loss, val, st.lr, st.grad_norm, tokens_per_s,
                    step_s, mfu, mem / 1e6, dmem_text, imbalance, (long long)saturated, (long long)underflowed,
                    (long long)opt.skipped(), pipeline, eta, loss);
        std::fflush(stdout);
      }
      StepMetrics m;
      m.step = step + 1, m.loss = loss, m.val_loss = evaluated ? last_val : NAN, m.lr = st.lr;
      m.grad_norm = st.grad_norm, m.tokens_per_s = tokens_per_s, m.step_time_s = step_s, m.mfu = mfu;
      m.peak_mem_bytes = int64_t(mem);
      if (on_gpu) m.peak_device_mem_bytes = int64_t(dmem);
      m.expert_load_imbalance = imbalance, m.fp8_saturated = saturated, m.fp8_underflowed = underflowed;
      m.skipped_steps = opt.skipped(), m.loss_scale = used_scale;
      m.pipeline_bubble = P > 1 ? bubble : NAN, m.pipeline_bubble_ideal = P > 1 ? bubble_ideal : NAN;
      jsonl.write(m);
    }
    const bool periodic = cfg.checkpoint.every > 0 && (step + 1) % cfg.checkpoint.every == 0;
    const bool exit_now = cfg.train.exit_interval > 0 && (step + 1) % cfg.train.exit_interval == 0 && !final_step;
    if ((periodic || final_step || exit_now) && !checkpoint()) return kExitFailure;
    if (exit_now) {
      if (root) std::printf("exit: step %lld is a multiple of train.exit_interval\n", (long long)step + 1);
      break;
    }
    // A stop signal on any rank: every rank stops after this same step, with a checkpoint.
    int signal = int(g_stop_signal);
    MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, &signal, 1, MPI_INT, MPI_MAX, grid.world()));
    if (signal != 0 && !final_step) {
      if (root)
        std::printf("signal %d (%s): stopping after step %lld with a checkpoint\n", signal,
                    signal == SIGUSR1 ? "SIGUSR1" : signal == SIGTERM ? "SIGTERM" : "?", (long long)step + 1);
      if (!periodic && !checkpoint()) return kExitFailure;
      if (root) std::printf("exit %d: checkpointed at step %lld; requeue to continue\n", kExitRequeue, (long long)step + 1);
      std::fflush(stdout);
      return kExitRequeue;
    }
  }
  if (root) {
    std::printf("communication of the last step, bytes summed over the ranks (README \"Communication\"):\n"
                "  group      measured    analytical  ratio\n");
    for (int g = 0; g < 5; ++g)
      if (comm_expected[g] > 0 || comm_measured[g] > 0)
        std::printf("  %-5s  %12.0f  %12.0f  %5.3f\n", group_names[g], comm_measured[g], comm_expected[g],
                    comm_expected[g] > 0 ? comm_measured[g] / comm_expected[g] : NAN);
  }
  if (root)
    std::printf("done: %lld steps in %.1f s; final validation loss %s; sample with: fp8moe generate --checkpoint %s "
                "--prompt ...\n",
                (long long)steps_run, std::chrono::duration<double>(Clock::now() - t_start).count(),
                json_number(progress.last_val_loss).c_str(), cfg.checkpoint.dir.c_str());
  return kExitOk;
}

}  // namespace fp8moe
