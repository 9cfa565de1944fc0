// The metrics log: one JSON object per training step and line (log.jsonl), the keys in a fixed
// order, NaN written as null. Written by rank 0 through an RAII file: every path out of the
// training loop closes it. The line printed to the terminal stays in app/.
#pragma once

#include <cmath>
#include <cstdint>
#include <fstream>
#include <optional>
#include <string>

namespace fp8moe {

struct StepMetrics {
  int64_t step = 0;
  double loss = 0, val_loss = 0;  // val_loss: NaN when this step did not evaluate
  double mtp_loss = NAN;          // the multi-token prediction modules' mean cross-entropy; NaN without them
  double lr = 0, grad_norm = 0, tokens_per_s = 0, step_time_s = 0, mfu = 0;
  int64_t peak_mem_bytes = 0;
  std::optional<int64_t> peak_device_mem_bytes;  // on a GPU only
  double expert_load_imbalance = 0;
  int64_t fp8_saturated = 0, fp8_underflowed = 0, skipped_steps = 0;
  double loss_scale = 1, pipeline_bubble = 0, pipeline_bubble_ideal = 0;  // bubble: NaN without a pipeline
  // The step's host synchronisations (the host waited for the device) and bytes copied host to
  // device and back, the maxima over the ranks (kernels/backend.h's TransferCounts).
  int64_t host_syncs = 0, h2d_bytes = 0, d2h_bytes = 0;
  // Seconds of the step the ranks spent blocked in collectives and in waits for posted ones (not
  // in pipeline receives: the bubble), their mean: communication compute did not hide, as the
  // host sees it (NCCL calls only queue work: there it is their launch time).
  double comm_exposed_s = 0;
};

// The JSON line of one step (no newline).
std::string metrics_json(const StepMetrics& m);

class MetricsLog {
 public:
  MetricsLog() = default;  // no file: write() does nothing
  // Opens `path` for appending, creating its directory; throws std::runtime_error naming the path
  // when it cannot.
  explicit MetricsLog(const std::string& path);
  // A fresh run: empties the file. False (and the log closed) when it cannot.
  bool restart();
  // Appends the step's line and flushes it (a crash loses no finished step).
  void write(const StepMetrics& m);
  bool is_open() const { return out_.is_open(); }

 private:
  std::string path_;
  std::ofstream out_;
};

}  // namespace fp8moe
