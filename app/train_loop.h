// The training loop: data -> micro-batches -> forward/backward -> AdamW -> router bias update,
// with evaluation, a metrics line (stdout) and JSONL record per logged step (app/step_report.h),
// checkpoints and stop signals.
#pragma once

#include <string>

#include "kernels/backend.h"
#include "model/config.h"
#include "parallel/grid.h"

namespace fp8moe {

// Collective over the grid's world: every rank holds its pipeline stage's blocks, its experts and
// its tensor-parallel slices (model/placement.h) and computes its data-parallel share of each
// micro-batch (app/stage_runner.h). Resumes per checkpoint.resume, saves every checkpoint.every
// steps and at the end. Returns the process exit status, the same on every rank (2 with one
// message from rank 0 for bad data files, paths or checkpoints; 1 when a checkpoint save failed).
//
// SIGUSR1 and SIGTERM (installed by install_stop_handlers) do not kill the run: the current step
// finishes, all ranks agree on the stop step (one all-reduce per step), a checkpoint is committed
// and train returns kExitRequeue. A second signal during that save changes nothing.
// `be`: this rank's backend (runtime.device), on which the model, the optimizer, the device
// communicators and the checkpoint staging work. `cpus`: this rank's share of the CPUs of its
// binding (parallel/cpu_binding.h), which checkpoint.async auto goes by.
int train(const Config& cfg, const ProcessGrid& grid, Backend& be, int cpus);

// "tensor 1 x pipeline 1 x expert 1 x data 2 (2 ranks)": the layout a checkpoint records.
std::string layout_text(const GridDims& g);

// Installs the SIGUSR1 / SIGTERM handlers that request the stop above (call before training).
void install_stop_handlers();

}  // namespace fp8moe
