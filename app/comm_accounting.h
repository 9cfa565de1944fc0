// Communication accounting: the bytes each group's communicator sent in a step (summed over the
// ranks), beside the analytical count of the layout (README "Communication"), printed at the end
// of a run. The measured counts also hold the small collectives (token counts, loss, loads), so
// the ratio is >= 1.
#pragma once

#include <array>

#include "app/stage_runner.h"
#include "model/config.h"
#include "model/plan_model.h"
#include "model/transformer.h"
#include "parallel/communicator.h"

namespace fp8moe {

// A group's two communicators: on the backend's memory (the tensors) and on the host (the token
// counts, losses, loads and the experts' row counts); the same object on the CPU backend.
struct GroupPair {
  Communicator *device = nullptr, *host = nullptr;
  int size() const { return device->size(); }
  int64_t bytes_sent() const { return device->bytes_sent() + (host != device ? host->bytes_sent() : 0); }
  void reset_bytes_sent() const {
    device->reset_bytes_sent();
    host->reset_bytes_sent();
  }
};

struct TrainGroups {
  GroupPair tensor, expert, data, expert_data, pipeline;
  Communicator* world;
};

class CommAccounting {
 public:
  // sequences: per data-parallel replica in each micro-batch (StageRunner::sequences()).
  // dispatcher: the model's expert exchange (nullptr without expert parallelism), whose rows'
  // bytes in-node and across nodes are counted too.
  CommAccounting(const Config& cfg, const Transformer& model, ExpertDispatcher* dispatcher, const TrainGroups& groups,
                 int64_t sequences);
  // Before a step: zero every group's byte counter.
  void start_step();
  // After a step (collective over the world): this step's measured and analytical bytes.
  // local: the routed rows of this rank whose expert lives on another expert rank, of them those
  // whose expert's rank is on another node, and of both those of blocks run again.
  void end_step(const StepLocal& step);
  // The table of the last measured step (rank 0 calls it).
  void print() const;

 private:
  const Config& cfg_;
  const Transformer& model_;
  TrainGroups g_;
  std::array<GroupPair, 5> counted_;  // in kCommGroupNames' order
  int64_t sequences_ = 0;
  double dense_bytes_ = 0, expert_bytes_ = 0;  // the trainable parameters this rank holds, FP32
  std::array<double, 5> measured_{}, expected_{};
  // The expert rows' bytes (the 4 exchanges, every row format) to ranks of this node and of other
  // nodes, measured and analytical; printed where the expert group spans nodes.
  ExpertDispatcher* dispatcher_ = nullptr;
  bool spans_nodes_ = false;
  std::array<double, 2> node_measured_{}, node_expected_{};
  // The relay's rows per exchange (runtime.node_dedup), summed over the ranks: token rows across
  // nodes, rows forwarded in the nodes, and the tokens the plans routed.
  std::array<double, 3> relay_{};
};

}  // namespace fp8moe
