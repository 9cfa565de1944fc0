#include "app/train_loop.h"

#include <csignal>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>

#include "app/comm_accounting.h"
#include "app/exit_codes.h"
#include "app/stage_runner.h"
#include "app/step_report.h"
#include "app/trainer.h"
#include "io/checkpoint.h"
#include "io/config.h"
#include "io/metrics.h"
#include "io/token_data.h"
#include "kernels/check.h"
#include "model/data_parallel.h"
#include "model/optimizer.h"
#include "model/transformer.h"
#include "parallel/mpi_session.h"
#include "parallel/pipeline_schedule.h"
#include "parallel/trace.h"
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

// After a step, what every rank agrees on in one allreduce: the stop signal any rank received (0:
// none), and whether an asynchronous save's writer is still busy on any rank.
struct AfterStep {
  int signal = 0;
  bool writer_busy = false;
};
AfterStep agreed_after_step(MPI_Comm world, bool writer_busy) {
  const WatchScope watch("stop-signal agreement", "world");
  int v[2] = {int(g_stop_signal), writer_busy ? 1 : 0};
  MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, v, 2, MPI_INT, MPI_MAX, world));
  return {v[0], v[1] != 0};
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

namespace {

// log.trace: the directory exists (made if not) and this rank's file can be written there; an
// error message, or empty.
std::string open_trace_dir(const std::string& dir, int rank) {
  if (dir.empty()) return "";
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  const std::string path = dir + "/rank" + std::to_string(rank) + ".json";
  {
    std::ofstream probe(path, std::ios::trunc);
    if (!probe) return "log.trace: cannot write " + path + (ec ? " (" + ec.message() + ")" : "");
  }
  std::filesystem::remove(path, ec);  // written after the traced steps
  return "";
}

// One run of the loop over its steps: the trainer's parts, the data, the reporting. Every method
// is collective over the world.
class TrainLoop {
 public:
  TrainLoop(const Config& cfg, const ProcessGrid& grid, Backend& be, const TrainComms& comms, Trainer& t,
            TrainData& data, MetricsLog& jsonl, bool eval_on, int cpus)
      : cfg_(cfg), grid_(grid), be_(be), t_(t), data_(data), world_(comms.world()),
        pipe_h_(*comms.groups().pipeline.host), root_(world_.rank() == 0), eval_on_(eval_on),
        runner_(cfg, t.model, comms.runner()), comm_(cfg, t.model, t.model.dispatcher(), comms.groups(), runner_.sequences()),
        peak_(training_peak(cfg, be, world_.size())), reporter_(cfg, be, world_, jsonl, peak_),
        grad_sq_(be, DType::f64, {1}), first_step_(t.progress.step), cpus_(cpus) {
    runner_.set_gradient_sync(&t.sync);
  }

  // Steps first_step + 1 .. train.steps; the exit status.
  int run() {
    announce_run(cfg_, t_.model, t_.opt, t_.sync, runner_, t_.state.layout, first_step_, peak_, world_);
    start_async_saves();
    t_start_ = Clock::now();
    for (int64_t step = first_step_; step < cfg_.train.steps; ++step) {
      const StepDone done = train_step(step);
      write_trace(done.step, false);
      report(done);
      const int status = after_step(step);
      if (status != kCarryOn) write_trace(done.step, true);  // the run ends inside the window
      if (status == kEndRun) break;
      if (status != kCarryOn) return status;
    }
    if (root_) {
      comm_.print();
      std::printf("done: %lld steps in %.1f s; final validation loss %s; %s%s%s\n",
                  (long long)(t_.progress.step - first_step_), seconds_since(t_start_),
                  number_or_null(t_.progress.last_val_loss).c_str(),
                  cfg_.checkpoint.save ? "sample with: fp8moe generate --checkpoint " : "no checkpoint (checkpoint.save false)",
                  cfg_.checkpoint.save ? cfg_.checkpoint.dir.c_str() : "", cfg_.checkpoint.save ? " --prompt ..." : "");
    }
    return kExitOk;
  }

 private:
  struct StepDone {
    int64_t step = 0;  // 1-based
    StepTotals totals;
    OptimizerStats opt;
    float used_scale = 1;
    double step_s = 0, bubble = 0, comm_exposed_s = 0;
    bool evaluated = false;
    TransferCounts transfers;
  };

  // Forward and backward of every micro-batch; gradients summed over the replicas, averaged over
  // the micro-batches and unscaled; AdamW; the router biases; then the validation loss when due.
  StepDone train_step(int64_t step) {
    const auto t0 = Clock::now();
    StepDone d;
    d.step = step + 1;
    watch_step(d.step, "forward and backward");
    if (tracing(d.step) && !trace::on()) trace::start();
    const trace::Span step_span("step", "step", -1);
    trace::reset_comm_blocked();
    const TransferCounts transfers0 = be_.transfers();
    Transformer& model = t_.model;
    model.zero_grads();
    comm_.start_step();
    StepLocal local;
    d.used_scale = t_.scaler.scale();
    runner_.train_step(*data_.train, t_.progress.samples, d.used_scale, &local);
    watch_step(d.step, "gradient sync and optimizer");
    {
      const trace::Span span("gradient reduction", "phase", -1);  // the waits for what the backward posted
      t_.sync.reduce_gradients(model.store());
    }
    // The gradients are divided by the micro-batch count and the loss scale inside the norm and
    // the AdamW kernel (kernels/adamw.h), never rewritten.
    const float unscale = 1.0f / (float(cfg_.parallel.micro_batches) * d.used_scale);
    {
      const trace::Span span("optimizer", "compute", -1);
      t_.opt.grad_sq(model.store(), unscale, norm_mask_, grad_sq_.data<double>());
      d.totals = runner_.finish_step(grad_sq_.data<double>());  // the step's host synchronisation
      d.opt = t_.opt.step(model.store(), step, d.totals.grad_sq, unscale);
      if (!d.opt.skipped) {
        t_.sync.gather_weights(model.store());
        model.share_tied_head();  // parallel.mtp_own_stage: the head stage's weight to the modules' copy
      }
    }
    // Communication the step's compute did not hide: this rank's time blocked in collectives and
    // waits, less its pipeline receives (the bubble, reported apart).
    d.comm_exposed_s = std::max(0.0, trace::comm_blocked_s() - local.waited_s);
    comm_.end_step(local);
    t_.scaler.update(!d.opt.skipped);
    if (!d.opt.skipped && !d.totals.expert_load.empty()) model.update_router_biases(d.totals.expert_load);
    d.transfers = be_.transfers() - transfers0;
    TrainProgress& progress = t_.progress;
    progress.step = d.step;
    progress.samples += cfg_.train.global_batch;
    progress.tokens += int64_t(cfg_.train.global_batch) * cfg_.train.seq_len;

    // The step's time (so tokens/s and MFU) excludes the evaluation that may follow. The pipeline
    // bubble: the stages' mean fraction of the step spent waiting for a neighbour.
    d.step_s = seconds_since(t0);
    world_.allreduce_max(&d.step_s, 1);
    d.bubble = d.step_s > 0 ? local.waited_s / d.step_s : 0;
    pipe_h_.allreduce_sum(&d.bubble, 1);
    d.bubble /= double(pipe_h_.size());
    world_.allreduce_sum(&d.comm_exposed_s, 1);
    d.comm_exposed_s /= double(world_.size());
    d.evaluated = eval_on_ && (d.step % cfg_.eval.every == 0 || d.step == cfg_.train.steps);
    watch_step(d.step, "evaluation and metrics");
    if (d.evaluated) progress.last_val_loss = runner_.validation_loss(*data_.val);
    return d;
  }

  // The metrics line and record, every log.every steps and at the end; the pipeline bubble beside
  // the schedule's ideal (parallel/pipeline_schedule.h): 1F1B's (P - 1) / (M + P - 1), DualPipeV's
  // as it runs (simulated; its F&B not overlapped, W = 0) with a backward twice a forward, ZB1P's
  // (simulated) with a forward, a backward's input part and its weight part alike; DualPipeV's F&B
  // ops as pairs (parallel.pair_micro_batches) hiding nothing.
  void report(const StepDone& d) {
    if (d.step % cfg_.log.every != 0 && d.step != cfg_.train.steps) return;
    const int P = pipe_h_.size(), M = cfg_.parallel.micro_batches;
    const PipelineSchedule ps = cfg_.parallel.pipeline_schedule;
    const double ideal = ps == PipelineSchedule::dualpipev ? dualpipev_bubble(P, M, 1, 2, cfg_.parallel.pair_micro_batches)
                         : ps == PipelineSchedule::zb1p  ? zb1p_idle(P, M, 1, 1, 1) / (zb1p_idle(P, M, 1, 1, 1) + 3.0 * M)
                                                         : one_f_one_b_bubble(P, M);
    const StepTotals& totals = d.totals;
    const TrainProgress& progress = t_.progress;
    reporter_.report({.step = d.step, .loss = totals.loss, .mtp_loss = totals.mtp_loss,
                      .val_loss = d.evaluated ? progress.last_val_loss : NAN, .last_val_loss = progress.last_val_loss,
                      .lr = d.opt.lr, .grad_norm = d.opt.grad_norm, .loss_scale = d.used_scale,
                      .skipped_steps = t_.opt.skipped(), .fp8_saturated = totals.fp8_saturated,
                      .fp8_underflowed = totals.fp8_underflowed,
                      .expert_load_imbalance = load_imbalance(totals.expert_load), .step_s = d.step_s,
                      .bubble = P > 1 ? d.bubble : NAN, .bubble_ideal = P > 1 ? ideal : NAN,
                      .comm_exposed_s = d.comm_exposed_s,
                      .eta_s = seconds_since(t_start_) / double(d.step - first_step_) * double(cfg_.train.steps - d.step),
                      .transfers = d.transfers});
  }

  // log.trace: whether step (1-based) is one the timeline records.
  bool tracing(int64_t step) const {
    const LogConfig& l = cfg_.log;
    return !l.trace.empty() && step >= l.trace_start && step < l.trace_start + l.trace_steps;
  }

  // After the timeline's last step (or the run's last step inside it, or `ending`: the run stops
  // after this step): every rank writes its file. A file that cannot be written is a warning; the
  // run goes on.
  void write_trace(int64_t step, bool ending) {
    if (!trace::on() || (!ending && tracing(step + 1) && step < cfg_.train.steps)) return;
    const std::string path = cfg_.log.trace + "/rank" + std::to_string(world_.rank()) + ".json";
    const std::string error = trace::stop_and_write(path, world_.rank());
    if (!error.empty()) std::fprintf(stderr, "fp8moe: warning: log.trace: %s\n", error.c_str());
    else if (root_) std::printf("trace: steps %lld-%lld in %s/rank*.json (scripts/trace.py summary %s)\n",
                                (long long)cfg_.log.trace_start, (long long)step, cfg_.log.trace.c_str(),
                                cfg_.log.trace.c_str());
  }

  // checkpoint.async with periodic saves: the writer, unless (auto) the host's CPUs compute (the
  // cpu and emulated backends) or some rank has one CPU, MPI lacks MPI_THREAD_MULTIPLE on some
  // rank, or some rank's share exceeds checkpoint.async_max_bytes (then blocking saves, a note or
  // a warning). Collective.
  void start_async_saves() {
    const CheckpointConfig& c = cfg_.checkpoint;
    if (!c.save || c.async == AsyncChoice::off || c.every <= 0) return;
    double v[3] = {double(checkpoint_copy_bytes(grid_.world(), t_.state)), threads_multiple() ? 0.0 : 1.0,
                   -double(cpus_)};
    world_.allreduce_max(v, 3);
    if (c.async == AsyncChoice::automatic && (be_.kind() != DeviceKind::cuda || -v[2] < 2)) {
      // A writer on the CPUs training computes on: measured on a 2-core VM (2026-12-06), the steps
      // during a background save ran 2x to 6x slower; with 2 ranks bound to a core each that cost
      // more than blocking saves (README "Checkpoints").
      if (root_) std::printf("checkpoint.async auto: saves block (%s; checkpoint.async: true writes in the "
                             "background anyway)\n", be_.kind() != DeviceKind::cuda ? "the training computes on "
                             "the host's CPUs, which a writer thread would take from it" : "a rank has one CPU");
      return;
    }
    if (v[1] > 0) {
      if (root_) std::fprintf(stderr, "fp8moe: warning: checkpoint.async: MPI does not provide MPI_THREAD_MULTIPLE "
                                      "on every rank: checkpoint saves are synchronous\n");
      return;
    }
    if (v[0] > double(c.async_max_bytes)) {
      if (root_) std::fprintf(stderr, "fp8moe: warning: checkpoint.async: a rank's copy of the checkpoint would take "
                                      "%.1f MB of host memory, more than checkpoint.async_max_bytes (%.1f MB): checkpoint "
                                      "saves are synchronous\n", v[0] / 1e6, double(c.async_max_bytes) / 1e6);
      return;
    }
    async_ = std::make_unique<AsyncCheckpointer>(grid_.world(), be_);
    if (root_) std::printf("checkpoint.async: every %lld steps a save copies at most %.1f MB per rank to host memory and "
                           "writes it in the background\n", (long long)c.every, v[0] / 1e6);
  }

  // Runs `save` (returns the committed directory) and says what became of it. false: it failed.
  template <class Save>
  bool committed(Save&& save) {
    try {
      const std::string dir = save();
      if (root_) std::printf("checkpoint %s committed\n", dir.c_str());
      std::fflush(stdout);
      return true;
    } catch (const CheckpointError& e) {
      if (root_) std::fprintf(stderr, "fp8moe: error: checkpoint save failed: %s (the previous checkpoint is intact)\n", e.what());
      return false;
    }
  }

  // The save in flight, if any, committed (and said so), or its failure reported. false: failed.
  bool finish_background() {
    return !async_ || !async_->in_flight() || committed([&] { return async_->wait(); });
  }

  // A periodic save in the background: the previous one committed first; then the copy, the only
  // time training waits for it.
  bool start_background() {
    if (!finish_background()) return false;
    const auto t0 = Clock::now();
    const int64_t bytes = async_->start(grid_.world(), t_.state);
    double v[2] = {seconds_since(t0), double(bytes)};
    world_.allreduce_max(v, 2);
    if (root_)
      std::printf("checkpoint step %lld: copied (at most %.1f MB per rank) in %.3f s; writing in the background\n",
                  (long long)t_.progress.step, v[1] / 1e6, v[0]);
    return true;
  }

  // A blocking save, after the one in flight (saves commit in order).
  bool checkpoint() {
    return finish_background() && committed([&] { return save_checkpoint(grid_.world(), t_.state); });
  }

  // Checkpoints: every checkpoint.every steps, at the end, at train.exit_interval (then the run
  // ends as if done), and after a stop signal on any rank (every rank stops after this same step;
  // exit 3, requeue). Returns kCarryOn, kEndRun, or the exit status of a run that stops here.
  static constexpr int kCarryOn = -1, kEndRun = -2;
  int after_step(int64_t step) {
    watch_step_done("checkpoint and stop signal");  // watched call by call, not as part of the step
    const CheckpointConfig& c = cfg_.checkpoint;
    const bool final_step = step + 1 == cfg_.train.steps;
    const bool periodic = c.save && c.every > 0 && (step + 1) % c.every == 0;
    const bool exit_now = cfg_.train.exit_interval > 0 && (step + 1) % cfg_.train.exit_interval == 0 && !final_step;
    // A periodic save the run goes on after runs in the background (checkpoint.async); the others
    // (the last step's, train.exit_interval's, a stop signal's) block, after the one in flight.
    if (periodic && async_ && !final_step && !exit_now) {
      if (!start_background()) return kExitFailure;
    } else if ((periodic || (final_step && c.save) || exit_now) && !checkpoint()) {
      return kExitFailure;
    }
    if (exit_now) {
      if (root_) std::printf("exit: step %lld is a multiple of train.exit_interval\n", (long long)step + 1);
      return kEndRun;
    }
    const AfterStep agreed = agreed_after_step(grid_.world(), async_ && !async_->finished());
    // Every rank's writer is done: its result now (a failure ends the run here, on every rank).
    if (!agreed.writer_busy && !finish_background()) return kExitFailure;
    const int signal = agreed.signal;
    if (signal == 0 || final_step) return kCarryOn;
    if (root_)
      std::printf("signal %d (%s): stopping after step %lld %s\n", signal,
                  signal == SIGUSR1 ? "SIGUSR1" : signal == SIGTERM ? "SIGTERM" : "?", (long long)step + 1,
                  c.save ? "with a checkpoint" : "without one (checkpoint.save is false)");
    if (!c.save) {
      // Not exit 3: a requeued job would find nothing to resume from and start again from step 0.
      if (root_) std::printf("exit %d: nothing saved, nothing to requeue\n", kExitFailure);
      std::fflush(stdout);
      return kExitFailure;
    }
    if (!finish_background()) return kExitFailure;  // this step's own periodic save, if in the background
    if (!periodic && !checkpoint()) return kExitFailure;
    if (root_) std::printf("exit %d: checkpointed at step %lld; requeue to continue\n", kExitRequeue, (long long)step + 1);
    std::fflush(stdout);
    return kExitRequeue;
  }

  const Config& cfg_;
  const ProcessGrid& grid_;
  Backend& be_;
  Trainer& t_;
  TrainData& data_;
  Communicator& world_;
  Communicator& pipe_h_;
  const bool root_, eval_on_;
  StageRunner runner_;
  CommAccounting comm_;
  const Peak peak_;
  StepReporter reporter_;
  const std::vector<bool> norm_mask_ = t_.sync.norm_mask();
  Tensor grad_sq_;
  const int64_t first_step_;
  Clock::time_point t_start_;
  const int cpus_;  // this rank's share of its binding's CPUs (checkpoint.async auto)
  std::unique_ptr<AsyncCheckpointer> async_;  // checkpoint.async's writer (start_async_saves)
};

}  // namespace

int train(const Config& cfg, const ProcessGrid& grid, Backend& be, int cpus) {
  const TrainComms comms(grid, be, cfg.runtime.comm == CommChoice::nccl, cfg.runtime.ranks_per_node);
  Communicator& world = comms.world();
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

  if (const std::string error = open_trace_dir(cfg.log.trace, world.rank()); any_rank(grid.world(), !error.empty()))
    return fail(error.empty() ? "log.trace: " + cfg.log.trace + ": cannot be written on some rank" : error);

  Trainer t(cfg, be, comms, layout_text(grid.dims()));
  std::string resumed;
  try {
    resumed = resume_from_checkpoint(grid.world(), t.state);
  } catch (const CheckpointError& e) {
    return fail(std::string("checkpoint.resume: ") + e.what());
  }
  if (resumed.empty() && !jsonl.restart())  // a fresh run: a fresh log
    std::fprintf(stderr, "fp8moe: warning: log.jsonl: cannot empty %s: no metrics log\n", cfg.log.jsonl.c_str());
  if (root && !resumed.empty())
    std::printf("resumed from %s: step %lld, %lld tokens consumed\n", resumed.c_str(), (long long)t.progress.step,
                (long long)t.progress.tokens);
  if (root && !cfg.log.trace.empty() && cfg.log.trace_start + cfg.log.trace_steps - 1 <= t.progress.step)
    std::printf("log.trace: steps %lld-%lld are before this run's first step (%lld): no timeline\n",
                (long long)cfg.log.trace_start, (long long)(cfg.log.trace_start + cfg.log.trace_steps - 1),
                (long long)t.progress.step + 1);
  if (t.progress.step >= cfg.train.steps) {
    if (root) std::printf("nothing to train: the checkpoint is at step %lld, train.steps is %lld\n",
                          (long long)t.progress.step, (long long)cfg.train.steps);
    return kExitOk;
  }
  return TrainLoop(cfg, grid, be, comms, t, data, jsonl, eval_on, cpus).run();
}

}  // namespace fp8moe
