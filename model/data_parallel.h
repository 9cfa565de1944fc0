// Gradient and weight synchronisation over the data-parallel replicas of the trainable
// parameters, on one contiguous range of the flat buffers (model/param_store.h's Segment): no
// packing, the collectives run on the parameters and gradients where they are.
//   zero 0: allreduce the gradients; every replica updates every row.
//   zero 1 (ZeRO-1): the segment is cut into one contiguous chunk per replica, at row boundaries;
//           reduce-scatter the gradients so that replica r holds the sum over its chunk, AdamW
//           updates those rows (moments for them only: about 8 bytes x parameters / R per rank
//           instead of 8 x parameters), then an all-gather gives every replica the updated weights.
// optim.grad_reduce bf16: the reduction is a reduce-scatter of BF16 values summed in FP32. Each
// replica rounds its gradients to BF16 once and sends block r (ZeRO's chunk r; without ZeRO an even
// split) to replica r by all-to-alls (in rounds of 2^24 values over all the replicas: the buffers
// take about 32 MB each way, not a copy of the bucket); replica r widens the R blocks it receives
// and adds them in FP32 in rank order (the same order whatever ZeRO, the rounds or the transport
// do, so the two ZeRO settings give the same bits). The reduce-scatter sends half the FP32 bytes.
// Without ZeRO an FP32 all-gather of the sums follows (every replica then holds the same FP32
// sums): 0.75 of the all-reduce's bytes.
//
// optim.overlap_grad_reduce (FP32 reduction): the reduction runs in buckets, one per layer
// (ParamSpec::layer) of the segment, each posted as a non-blocking collective once that layer's
// gradients are final (post_layer: after the layer's backward of the step's last micro-batch;
// post_rest: whatever is left once the backward is over), and waited before the optimizer reads
// the sums (reduce_gradients). With ZeRO a bucket's reduce-scatter gives each replica the bucket's
// part of its chunk: the same chunks, the same sums per element as one reduce-scatter of the
// segment, but the transport may add the replicas in another order (with 2 replicas the bits are
// the same). BF16 reductions stay whole-segment and in line, and so does every reduction over a
// transport that would run a post in line (Communicator::overlaps() false: the staged one).
#pragma once

#include <unordered_map>
#include <vector>

#include "model/config.h"
#include "model/optimizer.h"
#include "model/param_store.h"
#include "model/param_table.h"
#include "parallel/communicator.h"

namespace fp8moe {

// Expert parallelism makes two of them: the dense parameters over the data-parallel group, this
// rank's experts over the expert-data-parallel group (the replicas of the same experts).
class DataParallel {
 public:
  // The parameters `members` (layout order) fill `segment` of `store`; `group` works on the
  // store's backend memory.
  // round_values: the BF16 reduction's values per round over all the replicas (its buffers' size).
  static constexpr int64_t kRoundValues = int64_t(1) << 24;
  DataParallel(const ParamStore& store, Segment segment, std::vector<size_t> members, Communicator& group, bool zero,
               ReduceDtype reduce, int64_t round_values = kRoundValues, bool overlap = false);
  bool zero() const { return zero_; }
  Communicator& group() const { return group_; }
  bool includes(size_t i) const { return rows_.count(i) > 0; }
  // The rows of parameter i's block this replica updates: its chunk's share with ZeRO (possibly
  // none), else every row.
  RowRange owned(size_t i) const;
  // Sums the gradients over the replicas (zero: only this replica's chunk receives the sum).
  void reduce_gradients(ParamStore& store);
  // Whether the reduction runs in buckets posted during the backward (see the top of this file).
  bool overlapped() const { return !buckets_.empty(); }
  // Posts the reduction of layer `layer`'s buckets, whose gradients no later backward of this step
  // changes; the sums are in place once reduce_gradients returns. Every replica posts the same
  // layers in the same order. No-op without overlap, or for a layer posted already this step.
  void post_layer(ParamStore& store, int layer);
  // Posts every bucket not posted yet this step (the backward is over).
  void post_rest(ParamStore& store);
  // Lets the posted reductions move (the caller computes meanwhile).
  void progress() { if (overlapped()) group_.progress(); }
  // zero: every replica's updated chunk to every replica; otherwise nothing to do.
  void gather_weights(ParamStore& store);
  // Whether this replica's owned rows of parameter i count in the global gradient norm: with ZeRO
  // every replica's (they are disjoint), otherwise replica 0's only (they are all the same).
  bool counts_in_norm(size_t i) const { return includes(i) && (zero_ || group_.rank() == 0); }

 private:
  void reduce_bf16(Backend& be, float* g);
  // A contiguous range [begin, end) of the flat buffers holding one layer's members.
  struct Bucket {
    int layer = 0;
    int64_t begin = 0, end = 0;
    std::vector<int64_t> counts;  // ZeRO: each replica's part of the bucket (of its chunk)
    Tensor part;                  // ZeRO: this replica's part of the sums, until the wait
    int64_t ticket = -1;          // posted this step when >= 0
  };
  void post(ParamStore& store, Bucket& b);
  std::vector<Bucket> buckets_;   // overlap only
  std::vector<int64_t> cut_;      // ZeRO chunk boundaries (R + 1)
  Segment segment_;
  Communicator& group_;
  bool zero_;
  ReduceDtype reduce_;
  int64_t round_values_;
  std::vector<int64_t> counts_;                  // elements of each replica's chunk (ZeRO)
  std::vector<int64_t> split_;                   // without ZeRO: the BF16 reduction's even blocks
  std::unordered_map<size_t, RowRange> rows_;    // this replica's owned rows per member
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
  // data, expert_data: on the store's backend memory. tensor_rank: replicated parameters
  // (TpSplit::none) count in the norm on tensor rank 0 only. Collective-free.
  // copies (empty: none): per parameter, whether this rank holds it as a tied copy of another
  // rank's (model/placement.h holds_tied_copy; the holder's weight replaces it after each step):
  // neither written nor counted in the norm here.
  ReplicaSync(const ParamStore& store, Communicator& data, Communicator& expert_data, int tensor_rank, bool zero,
              ReduceDtype reduce, bool overlap = false, std::vector<bool> copies = {});
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
  // The reductions of both groups (DataParallel::post_layer, post_rest, progress; reduce_gradients
  // waits for what was posted).
  void post_layer(ParamStore& store, int layer) { dense_.post_layer(store, layer), experts_.post_layer(store, layer); }
  void post_rest(ParamStore& store) { dense_.post_rest(store), experts_.post_rest(store); }
  void progress() { dense_.progress(), experts_.progress(); }
  void reduce_gradients(ParamStore& store);
  void gather_weights(ParamStore& store);
  // Per parameter: whether this rank's owned rows of it count in the global gradient norm, so
  // that over the ranks every element counts once (the caller sums the parts over every rank).
  std::vector<bool> norm_mask() const;

 private:
  bool writes(size_t i) const;  // whether this rank writes any of parameter i
  const ParamTable& table_;
  std::vector<Shard> shards_;
  ParamTable local_;
  int tensor_rank_;
  std::vector<bool> copies_;
  DataParallel dense_, experts_;
};

}  // namespace fp8moe
