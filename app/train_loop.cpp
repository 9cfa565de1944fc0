#include "app/train_loop.h"

#include <csignal>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <memory>
#include <string>

#include "app/comm_accounting.h"
#include "app/exit_codes.h"
#include "app/stage_runner.h"
#include "app/step_report.h"
#include "io/checkpoint.h"
#include "io/config.h"
#include "io/metrics.h"
#include "io/token_data.h"
#include "kernels/check.h"
#include "model/data_parallel.h"
#include "model/optimizer.h"
#include "model/transformer.h"
#include "parallel/device_communicator.h"
#include "parallel/mpi_communicator.h"
#include "parallel/mpi_session.h"
#include "parallel/watchdog.h"

namespace fp8moe {
namespace {

volatile std::sig_atomic_t g_stop_signal = 0;  // the signal that asked for a stop, 0 = none
extern "C" void on_stop_signal(int sig) { g_stop_signal = sig; }

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// The training and validation data. Every data set is validated on open; each rank checks the
// token ids of its own part of every data set. A problem on any rank (its part, or files that
// differ between nodes) is every rank's: the lowest failing rank's message, the same on all.
struct TrainData {
  std::unique_ptr<DataBlend> train, val;  // val: none without data.valid_path
};
std::string open_data(const Config& cfg, const TokenCheck& check, MPI_Comm world, TrainData* d) {
  const int64_t T = cfg.train.seq_len;
  std::string error;
  if (cfg.data.path.empty())
    return "data.path: empty; prepare a data set with `fp8moe prepare-data` or scripts/tokenize-data.py";
  try {
    d->train = std::make_unique<DataBlend>(cfg.data.path, check);
    for (const auto& set : d->train->sets())
      if (set->size() < T + 1)
        throw DataError(set->prefix() + ": " + std::to_string(set->size()) +
                        " tokens, fewer than one sequence of train.seq_len + 1 = " + std::to_string(T + 1));
  } catch (const DataError& e) {
    error = std::string("data.path: ") + e.what();
  }
  try {
    if (error.empty() && !cfg.data.valid_path.empty()) d->val = std::make_unique<DataBlend>(cfg.data.valid_path, check);
  } catch (const DataError& e) {
    error = std::string("data.valid_path: ") + e.what();
  }
  return first_error(world, error);
}

// Whether validation runs: eval.every > 0 and a validation set that holds a sequence (rank 0 says
// why not).
bool evaluation_on(const Config& cfg, const TrainData& d, bool root) {
  if (cfg.eval.every <= 0) return false;
  if (!d.val) {
    if (root) std::printf("note: no data.valid_path: no validation loss\n");
    return false;
  }
  if (d.val->min_size() < cfg.train.seq_len + 1) {
    if (root)
      std::printf("note: a data.valid_path data set has fewer than %lld tokens: no validation loss\n",
                  (long long)cfg.train.seq_len + 1);
    return false;
  }
  return true;
}

std::string number_or_null(double v) {
  if (!std::isfinite(v)) return "null";
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.9g", v);
  return buf;
}

// The run's start-up lines (rank 0): what is trained on which layout, the MFU basis, and the
// optimizer state per rank and in all (collective: the state sizes are reduced over the world).
void announce_run(const Config& cfg, const Transformer& model, const AdamW& opt, const ReplicaSync& sync,
                  const StageRunner& runner, const std::string& layout, int64_t first_step, const Peak& peak,
                  Communicator& world) {
  const bool root = world.rank() == 0;
  if (root)
    std::printf("training %lld parameters for steps %lld..%lld of %d x %lld tokens on %s: %lld micro-batches of "
                "%lld sequences per data-parallel rank, recipe %s; %s\n",
                (long long)model.table().trainable_numel(), (long long)first_step + 1,
                (long long)cfg.train.steps, cfg.train.global_batch, (long long)cfg.train.seq_len, layout.c_str(),
                (long long)cfg.parallel.micro_batches, (long long)runner.sequences(),
                std::string(to_string(cfg.fp8.recipe)).c_str(),
                std::isnan(peak.flops) ? "no MFU: fp8moe does not know this GPU's peak"
                                       : ("MFU against " + peak.basis + " of " + std::to_string(int64_t(peak.flops * 1e-9)) +
                                          " GFLOP/s").c_str());
  double moments[2] = {double(opt.state_bytes()), double(opt.state_bytes())};  // max, sum over ranks
  world.allreduce_max(&moments[0], 1);
  world.allreduce_sum(&moments[1], 1);
  if (root)
    std::printf("optimizer state (Adam moments): %.1f MB per rank, %.1f MB in all (%s)\n", moments[0] / 1e6,
                moments[1] / 1e6, sync.zero() ? "optim.zero 1: sharded over the data-parallel replicas" : "full copies");
}

// The stop signal any rank received (0: none); every rank gets the same answer.
int agreed_stop_signal(MPI_Comm world) {
  const WatchScope watch("stop-signal agreement", "world");
  int signal = int(g_stop_signal);
  MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, &signal, 1, MPI_INT, MPI_MAX, world));
  return signal;
}

}  // namespace

std::string layout_text(const GridDims& g) {
  return "tensor " + std::to_string(g.tensor) + " x pipeline " + std::to_string(g.pipeline) + " x expert " +
         std::to_string(g.expert) + " x data " + std::to_string(g.data) + " (" + std::to_string(g.world) +
         (g.world == 1 ? " rank)" : " ranks)");
}

void install_stop_handlers() {
  struct sigaction sa {};
  sa.sa_handler = on_stop_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;  // MPI and file calls carry on; the flag is read between steps
  sigaction(SIGUSR1, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
}

int train(const Config& cfg, const ProcessGrid& grid, Backend& be) {
  // Host communicators for the small numbers every rank exchanges (token counts, losses, loads,
  // agreements), and the same groups on the backend's memory for the tensors (runtime.comm,
  // resolved by app/train.cpp: NCCL, MPI staged through pinned memory, or the emulated device's
  // own; on the CPU backend the host ones themselves).
  MpiCommunicator world(grid.world(), "world"), pipe_h(grid.pipeline(), "pp"), dp_h(grid.data(), "dp"),
      tp_h(grid.tensor(), "tp"), ep_h(grid.expert(), "ep"), edp_h(grid.expert_data(), "edp");
  const bool nccl = cfg.runtime.comm == CommChoice::nccl;
  std::vector<std::unique_ptr<Communicator>> owned;
  auto on_device = [&](MpiCommunicator& host, MPI_Comm comm, const char* name) -> Communicator* {
    if (be.host_accessible()) return &host;
    owned.push_back(make_device_communicator(comm, be, nccl, name));
    return owned.back().get();
  };
  Communicator *tp = on_device(tp_h, grid.tensor(), "tp"), *ep = on_device(ep_h, grid.expert(), "ep"),
               *dp = on_device(dp_h, grid.data(), "dp"), *edp = on_device(edp_h, grid.expert_data(), "edp"),
               *pipe = on_device(pipe_h, grid.pipeline(), "pp");
  const TrainGroups groups{{tp, &tp_h}, {ep, &ep_h}, {dp, &dp_h}, {edp, &edp_h}, {pipe, &pipe_h}, &world};
  const bool root = world.rank() == 0;
  // Bad input is found on every rank alike: every rank returns the same status, only rank 0 speaks.
  auto fail = [&](const std::string& message) { return root ? usage_error(message) : kExitUsage; };

  TrainData data;
  if (const std::string error = open_data(cfg, {cfg.model.vocab_size, world.rank(), world.size()}, grid.world(), &data);
      !error.empty())
    return fail(error);
  const bool eval_on = evaluation_on(cfg, data, root);
  MetricsLog jsonl;  // log.jsonl, written by rank 0
  std::string jsonl_error;
  try {
    if (root && !cfg.log.jsonl.empty()) jsonl = MetricsLog(cfg.log.jsonl);
  } catch (const std::runtime_error& e) {
    jsonl_error = e.what();
  }
  if (any_rank(grid.world(), !jsonl_error.empty())) return fail(jsonl_error);

  Transformer model(be, cfg, ModelGroups{.pipeline = pipe, .tensor = tp, .data = dp, .expert = ep,
                                         .expert_counts = &ep_h, .expert_data = edp});
  ReplicaSync sync(model.store(), *dp, *edp, model.placement().at().tensor_rank, cfg.optim.zero == 1);
  const std::vector<bool> norm_mask = sync.norm_mask();
  AdamW opt(be, sync.local_table(), cfg.train, sync.owned());
  LossScaler scaler(cfg.train);
  TrainProgress progress;
  const TrainerState state{&cfg, &model, &opt, &scaler, &progress, layout_text(grid.dims()), sync.write_rows(),
                           sync.moment_write_rows()};
  std::string resumed;
  try {
    resumed = resume_from_checkpoint(grid.world(), state);
  } catch (const CheckpointError& e) {
    return fail(std::string("checkpoint.resume: ") + e.what());
  }
  if (resumed.empty() && !jsonl.restart())  // a fresh run: a fresh log
    std::fprintf(stderr, "fp8moe: warning: log.jsonl: cannot empty %s: no metrics log\n", cfg.log.jsonl.c_str());
  if (root && !resumed.empty())
    std::printf("resumed from %s: step %lld, %lld tokens consumed\n", resumed.c_str(), (long long)progress.step,
                (long long)progress.tokens);
  if (progress.step >= cfg.train.steps) {
    if (root) std::printf("nothing to train: the checkpoint is at step %lld, train.steps is %lld\n",
                          (long long)progress.step, (long long)cfg.train.steps);
    return kExitOk;
  }

  StageRunner runner(cfg, model, {pipe, &pipe_h, &dp_h, &world});
  CommAccounting comm(cfg, model, groups, runner.sequences());
  const Peak peak = training_peak(cfg, be, world.size());
  StepReporter reporter(cfg, be, world, jsonl, peak);
  const int64_t T = cfg.train.seq_len, first_step = progress.step;
  const int P = pipe_h.size(), M = cfg.parallel.micro_batches;
  announce_run(cfg, model, opt, sync, runner, state.layout, first_step, peak, world);
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
  Tensor grad_sq(be, DType::f64, {1});

  const auto t_start = Clock::now();
  for (int64_t step = first_step; step < cfg.train.steps; ++step) {
    const auto t0 = Clock::now();
    // Forward and backward of every micro-batch; gradients summed over the replicas, averaged
    // over the micro-batches and unscaled; AdamW; the router biases.
    watch_step(step + 1, "forward and backward");
    const TransferCounts transfers0 = be.transfers();
    model.zero_grads();
    comm.start_step();
    StepLocal local;
    const float used_scale = scaler.scale();
    runner.train_step(*data.train, progress.samples, used_scale, &local);
    watch_step(step + 1, "gradient sync and optimizer");
    sync.reduce_gradients(model.store());
    // The gradients are divided by the micro-batch count and the loss scale inside the norm and
    // the AdamW kernel (kernels/adamw.h), never rewritten.
    const float unscale = 1.0f / (float(M) * used_scale);
    opt.grad_sq(model.store(), unscale, norm_mask, grad_sq.data<double>());
    const StepTotals totals = runner.finish_step(grad_sq.data<double>());  // the step's host synchronisation
    const OptimizerStats st = opt.step(model.store(), step, totals.grad_sq, unscale);
    if (!st.skipped) sync.gather_weights(model.store());
    comm.end_step(local.rows_off_rank);
    scaler.update(!st.skipped);
    if (!st.skipped && !totals.expert_load.empty()) model.update_router_biases(totals.expert_load);
    const TransferCounts transfers = be.transfers() - transfers0;
    progress.step = step + 1;
    progress.samples += cfg.train.global_batch;
    progress.tokens += int64_t(cfg.train.global_batch) * T;

    // The step's time (so tokens/s and MFU) excludes the evaluation that may follow. The pipeline
    // bubble: the stages' mean fraction of the step spent waiting for a neighbour, beside the 1F1B
    // ideal (P - 1) / (M + P - 1).
    double step_s = seconds_since(t0);
    world.allreduce_max(&step_s, 1);
    double bubble = step_s > 0 ? local.waited_s / step_s : 0;
    pipe_h.allreduce_sum(&bubble, 1);
    bubble /= double(P);
    const bool final_step = step + 1 == cfg.train.steps;
    const bool evaluated = eval_on && ((step + 1) % cfg.eval.every == 0 || final_step);
    watch_step(step + 1, "evaluation and metrics");
    if (evaluated) progress.last_val_loss = runner.validation_loss(*data.val);
    if ((step + 1) % cfg.log.every == 0 || final_step)
      reporter.report({.step = step + 1, .loss = totals.loss, .mtp_loss = totals.mtp_loss, .val_loss = evaluated ? progress.last_val_loss : NAN,
                       .last_val_loss = progress.last_val_loss, .lr = st.lr, .grad_norm = st.grad_norm,
                       .loss_scale = used_scale, .skipped_steps = opt.skipped(), .fp8_saturated = totals.fp8_saturated,
                       .fp8_underflowed = totals.fp8_underflowed,
                       .expert_load_imbalance = load_imbalance(totals.expert_load), .step_s = step_s,
                       .bubble = P > 1 ? bubble : NAN, .bubble_ideal = P > 1 ? double(P - 1) / double(M + P - 1) : NAN,
                       .eta_s = seconds_since(t_start) / double(step + 1 - first_step) * double(cfg.train.steps - step - 1),
                       .transfers = transfers});

    // Checkpoints: every checkpoint.every steps, at the end, at train.exit_interval (then exit),
    // and after a stop signal on any rank (every rank stops after this same step; exit 3, requeue).
    watch_step_done("checkpoint and stop signal");  // watched call by call, not as part of the step
    const bool periodic = cfg.checkpoint.save && cfg.checkpoint.every > 0 && (step + 1) % cfg.checkpoint.every == 0;
    const bool exit_now = cfg.train.exit_interval > 0 && (step + 1) % cfg.train.exit_interval == 0 && !final_step;
    if ((periodic || (final_step && cfg.checkpoint.save) || exit_now) && !checkpoint()) return kExitFailure;
    if (exit_now) {
      if (root) std::printf("exit: step %lld is a multiple of train.exit_interval\n", (long long)step + 1);
      break;
    }
    if (const int signal = agreed_stop_signal(grid.world()); signal != 0 && !final_step) {
      if (root)
        std::printf("signal %d (%s): stopping after step %lld %s\n", signal,
                    signal == SIGUSR1 ? "SIGUSR1" : signal == SIGTERM ? "SIGTERM" : "?", (long long)step + 1,
                    cfg.checkpoint.save ? "with a checkpoint" : "without one (checkpoint.save is false)");
      if (!cfg.checkpoint.save) {
        // Not exit 3: a requeued job would find nothing to resume from and start again from step 0.
        if (root) std::printf("exit %d: nothing saved, nothing to requeue\n", kExitFailure);
        std::fflush(stdout);
        return kExitFailure;
      }
      if (!periodic && !checkpoint()) return kExitFailure;
      if (root) std::printf("exit %d: checkpointed at step %lld; requeue to continue\n", kExitRequeue, (long long)step + 1);
      std::fflush(stdout);
      return kExitRequeue;
    }
  }
  if (root) {
    comm.print();
    std::printf("done: %lld steps in %.1f s; final validation loss %s; %s%s%s\n",
                (long long)(progress.step - first_step), seconds_since(t_start),
                number_or_null(progress.last_val_loss).c_str(),
                cfg.checkpoint.save ? "sample with: fp8moe generate --checkpoint " : "no checkpoint (checkpoint.save false)",
                cfg.checkpoint.save ? cfg.checkpoint.dir.c_str() : "", cfg.checkpoint.save ? " --prompt ..." : "");
  }
  return kExitOk;
}

}  // namespace fp8moe
