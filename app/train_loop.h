// The training loop: data -> micro-batches -> forward/backward -> AdamW -> router
// bias update, with evaluation and a metrics line (stdout) plus JSONL record per logged step.
#pragma once

#include "model/config.h"
#include "parallel/grid.h"

namespace fp8moe {

// Collective over the grid's world. Tensor and pipeline parallelism are refused by the caller: the
// ranks are data-parallel replicas, with expert parallelism carved out of them (each rank holds
// n_experts / ep routed experts of every MoE layer and everything else whole). Resumes per
// checkpoint.resume, saves every checkpoint.every steps and at the end. Returns the process exit
// status, the same on every rank (2 with one message from rank 0 for bad data files, paths or
// checkpoints; 1 when a checkpoint save failed).
//
// SIGUSR1 and SIGTERM (installed by install_stop_handlers) do not kill the run: the current step
// finishes, all ranks agree on the stop step (one all-reduce per step), a checkpoint is committed
// and train returns kExitRequeue. A second signal during that save changes nothing.
int train(const Config& cfg, const ProcessGrid& grid);

// Installs the SIGUSR1 / SIGTERM handlers that request the stop above (call before training).
void install_stop_handlers();

}  // namespace fp8moe
