// What the training loop reports: the throughput denominators (model FLOPs per token, the peak
// the MFU is taken against) and, per logged step, the terminal line (rank 0) and the metrics log's
// record (io/metrics.h).
#pragma once

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "io/metrics.h"
#include "kernels/backend.h"
#include "model/config.h"
#include "parallel/communicator.h"

namespace fp8moe {

// Model FLOPs per token of one training step (forward + backward = 3x forward): 2 per weight of
// every matrix a token goes through (its k routed experts, not all of them) plus causal attention.
double model_flops_per_token(const ModelConfig& m, int64_t T);

// The peak FLOP/s of all `ranks` together: on the CPU (and the emulated device) this machine's
// FP32 SGEMM, measured; on a GPU its dense FP8 (recipe other than off) or FP32 peak, NaN for a GPU
// fp8moe does not know.
struct Peak {
  double flops = 0;
  std::string basis;  // what the peak is, for the start-up line
};
Peak training_peak(const Config& cfg, const Backend& be, int ranks);

// Max over MoE layers of (max load / mean load); NaN without a layer with any load.
double load_imbalance(const std::vector<std::vector<int64_t>>& expert_load);

// One finished step, as every rank knows it after the step's reductions.
struct StepSummary {
  int64_t step = 0;                  // 1-based
  double loss = 0;                   // cross-entropy and aux losses (the multi-token prediction's apart)
  double mtp_loss = NAN;             // the multi-token prediction modules' mean cross-entropy (NaN: none)
  double val_loss = 0;               // NaN: this step did not evaluate
  double last_val_loss = 0;          // the latest validation loss (NaN: none yet)
  double lr = 0, grad_norm = 0;
  float loss_scale = 1;              // the scale the step's gradients were computed with
  int64_t skipped_steps = 0;         // so far in this run and the ones it resumed
  int64_t fp8_saturated = 0, fp8_underflowed = 0;
  double expert_load_imbalance = 0;  // max over MoE layers of max load / mean load (NaN: no MoE load)
  double step_s = 0;                 // the slowest rank's step time
  double bubble = 0, bubble_ideal = 0;  // NaN without pipeline parallelism
  double comm_exposed_s = 0;         // the ranks' mean seconds blocked in collectives and waits (io/metrics.h)
  double eta_s = 0;
  TransferCounts transfers;          // this rank's host synchronisations and copies of the step
};

class StepReporter {
 public:
  // log: rank 0's metrics log (closed elsewhere: write() does nothing).
  StepReporter(const Config& cfg, const Backend& be, Communicator& world, MetricsLog& log, const Peak& peak);
  // Collective (peak memory, host synchronisations and bytes copied are the maxima over the
  // ranks): prints the step's line on rank 0 and appends its record to the log.
  void report(const StepSummary& s);

 private:
  const Config& cfg_;
  const Backend& be_;
  Communicator& world_;
  MetricsLog& log_;
  Peak peak_;
  double flops_per_token_ = 0;
};

}  // namespace fp8moe
