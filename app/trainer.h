// A training run's parts, assembled in one place and in one order: the communicators of this
// rank's groups, the model, the replica sync (data parallelism, ZeRO-1), AdamW, the loss scaler,
// the progress, and the TrainerState a checkpoint save writes and a load fills. `fp8moe train`,
// `fp8moe import` (a step-0 checkpoint of the same objects) and plan's probe models build them so.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "app/comm_accounting.h"
#include "app/stage_runner.h"
#include "io/checkpoint.h"
#include "model/data_parallel.h"
#include "model/optimizer.h"
#include "model/transformer.h"
#include "parallel/grid.h"

namespace fp8moe {

// The communicators of this rank's groups (parallel/grid.h): over MPI on host memory for the small
// numbers the ranks exchange (token counts, losses, loads, agreements), and the same groups on the
// backend's memory for the tensors (runtime.comm: NCCL in place, MPI staged through pinned memory,
// or the emulated device's own; on the CPU backend the host ones themselves).
class TrainComms {
 public:
  // Collective over the grid's world (NCCL's set-up on a GPU). ranks_per_node: runtime.ranks_per_node
  // (parallel/mpi_session.h node_index).
  TrainComms(const ProcessGrid& grid, Backend& be, bool nccl, int ranks_per_node = 0);
  // One process alone, without MPI: every group is this rank (parallel/self_communicator.h).
  explicit TrainComms(Backend& be);
  TrainComms(const TrainComms&) = delete;
  TrainComms& operator=(const TrainComms&) = delete;

  const TrainGroups& groups() const { return groups_; }
  Communicator& world() const { return *groups_.world; }
  ModelGroups model() const;
  RunnerGroups runner() const;
  // The node of each rank of this rank's expert group (ExpertDispatcher::set_nodes).
  const std::vector<int64_t>& expert_nodes() const { return expert_nodes_; }

 private:
  std::vector<std::unique_ptr<Communicator>> owned_;
  TrainGroups groups_{};
  std::vector<int64_t> expert_nodes_;
};

// The trainer's objects over those groups: the model initialised from train.seed, AdamW with zero
// moments, a fresh progress (a resume overwrites them through `state`).
struct Trainer {
  Trainer(const Config& cfg, Backend& be, const TrainComms& comms, std::string layout);
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  Transformer model;
  ReplicaSync sync;
  AdamW opt;
  LossScaler scaler;
  TrainProgress progress;
  TrainerState state;
};

}  // namespace fp8moe
