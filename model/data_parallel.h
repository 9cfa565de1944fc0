// Gradient and weight synchronisation over the data-parallel replicas of the trainable
// parameters, in one flat bucket per step.
//   zero 0: allreduce the gradients; every replica updates every row.
//   zero 1 (ZeRO-1): reduce-scatter the gradients so that replica r holds the sum for its rows
//           (replica_rows(rows, r, R) of every parameter), AdamW updates those rows (moments for
//           them only: 8 bytes x parameters / R per rank instead of 8 x parameters), then an
//           all-gather gives every replica the updated weights.
#pragma once

#include <functional>
#include <vector>

#include "model/optimizer.h"
#include "model/param_table.h"
#include "parallel/communicator.h"

namespace fp8moe {

// Expert parallelism makes two of them: the dense parameters over the data-parallel group, this
// rank's experts over the expert-data-parallel group (the replicas of the same experts).
class DataParallel {
 public:
  // include[i]: this object synchronises parameter i (trainable ones only).
  DataParallel(const ParamTable& table, Communicator& group, bool zero, std::vector<bool> include);
  bool zero() const { return zero_; }
  Communicator& group() const { return group_; }
  bool includes(size_t i) const { return include_[i]; }
  // The rows of parameter i this replica updates: its share with ZeRO, else every row.
  RowRange owned(size_t i) const;
  // Sums the gradients over the replicas (zero: only this replica's rows receive the sum).
  void reduce_gradients(std::vector<std::vector<float>>& grads);
  // zero: every replica's updated rows to every replica; otherwise nothing to do.
  void gather_weights(std::vector<std::vector<float>>& params);
  // Whether this replica's owned rows of parameter i count in the global gradient norm: with ZeRO
  // every replica's (they are disjoint), otherwise replica 0's only (they are all the same).
  bool counts_in_norm(size_t i) const { return include_[i] && (zero_ || group_.rank() == 0); }

 private:
  template <class Fn>
  void for_each_block(bool all_replicas, Fn&& fn) const;
  void pack(const std::vector<std::vector<float>>& t, bool all_replicas);
  void unpack(std::vector<std::vector<float>>& t, bool all_replicas);

  const ParamTable& table_;
  Communicator& group_;
  bool zero_;
  std::vector<bool> include_;
  std::vector<int64_t> counts_;  // floats of each replica's block (ZeRO)
  std::vector<float> bucket_, mine_;
};

}  // namespace fp8moe

namespace fp8moe {

// The replicas of a whole model: the dense parameters are synchronised over `data` (every
// data-parallel rank holds them), this rank's experts over `expert_data` (the ranks holding the
// same experts; with no expert parallelism that is `data` again). Decides, from the ParamTable
// alone, which rows of each parameter this rank updates, counts in the gradient norm and writes
// to a checkpoint.
class ReplicaSync {
 public:
  // shards: this rank's block of every parameter (Transformer::shard); tensor_rank: replicated
  // parameters (TpSplit::none) count in the norm on tensor rank 0 only.
  ReplicaSync(const ParamTable& table, const std::vector<Shard>& shards, Communicator& data, Communicator& expert_data,
              Communicator& world, int tensor_rank, bool zero);
  bool zero() const { return dense_.zero(); }
  // The table with each parameter's shape replaced by this rank's block (what AdamW works on).
  const ParamTable& local_table() const { return local_; }
  // Per parameter: the rows of this rank's block AdamW updates here (none where it is not held).
  std::vector<RowRange> owned() const;
  // Per parameter, in GLOBAL rows: the rows (of its block's columns) this rank writes to, and
  // checks in, a checkpoint: its share among the ranks that hold the same block; over the ranks,
  // every element once. moment_write_rows: the same for the Adam moments (the owned rows with ZeRO).
  std::vector<RowRange> write_rows() const;
  std::vector<RowRange> moment_write_rows() const;
  void reduce_gradients(std::vector<std::vector<float>>& grads);
  void gather_weights(std::vector<std::vector<float>>& params);
  // Global squared gradient norm from each parameter's owned-row partial: every element once.
  AdamW::NormReduce norm();

 private:
  bool writes(size_t i) const;  // whether this rank writes any of parameter i
  const ParamTable& table_;
  std::vector<Shard> shards_;
  ParamTable local_;
  Communicator& world_;
  int tensor_rank_;
  DataParallel dense_, experts_;
};

}  // namespace fp8moe
