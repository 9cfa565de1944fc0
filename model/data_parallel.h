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

class DataParallel {
 public:
  DataParallel(const ParamTable& table, Communicator& group, bool zero);
  bool zero() const { return zero_; }
  // AdamW's row ranges: this replica's rows with ZeRO, else empty (every row).
  std::vector<RowRange> owned() const;
  // Sums the gradients over the replicas (zero: only this replica's rows receive the sum).
  void reduce_gradients(std::vector<std::vector<float>>& grads);
  // zero: every replica's updated rows to every replica; otherwise nothing to do.
  void gather_weights(std::vector<std::vector<float>>& params);
  // The squared-norm reduction AdamW needs: the sum over replicas with ZeRO (each holds a disjoint
  // part), none otherwise (each holds all of it).
  std::function<void(double*)> norm_reduce();

 private:
  void pack(const std::vector<std::vector<float>>& t, bool all_replicas);
  void unpack(std::vector<std::vector<float>>& t, bool all_replicas);

  const ParamTable& table_;
  Communicator& group_;
  bool zero_;
  std::vector<int64_t> counts_;  // floats of each replica's block (ZeRO)
  std::vector<float> bucket_, mine_;
};

}  // namespace fp8moe
