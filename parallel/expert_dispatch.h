// Expert parallelism's token exchange (DeepSeek-V3 / Megatron "alltoall" dispatcher) over the
// expert-parallel group of P ranks, rank r owning the experts ExpertOwnership gives it (the L =
// n_experts / P consecutive experts [r L, (r + 1) L)). A rank routes its tokens locally and permutes the chosen (token, expert) rows
// into global expert order; dispatch sends each row to the owner of its expert, combine brings
// the experts' outputs back in the same order. An expert that receives no row is normal.
//
// Backward runs the same plan the other way: the gradients of the experts' outputs go out with
// dispatch, the gradients of their inputs come back with combine.
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/tensor.h"
#include "parallel/communicator.h"

namespace fp8moe {

// Which expert-parallel rank holds which routed experts: rank r of P holds the L = E / P
// consecutive experts [r L, (r + 1) L). The one statement of the rule; model/placement.h answers
// the model's questions with it, the dispatcher's exchange depends on it (block j of a rank's
// counts and rows goes to rank j).
struct ExpertOwnership {
  int n_experts = 0, ranks = 1;
  int per_rank() const { return n_experts / ranks; }
  int first(int rank) const { return rank * per_rank(); }
  int owner(int expert) const { return expert / per_rank(); }
};

struct DispatchPlan {
  int ranks = 1, local_experts = 0;
  std::vector<int64_t> send_rows;    // (P) rows to each rank
  std::vector<int64_t> recv_counts;  // (P x L) rows from rank j for local expert l, [j * L + l]
  std::vector<int64_t> local_rows;   // (L) rows per local expert, over all sources
  int64_t received = 0;              // rows this rank's experts process
};

class ExpertDispatcher {
 public:
  // rows: the expert group's communicator on the backend's memory (the rows' all-to-all-v);
  // counts: the same group over host memory (the counts' all-to-all: they are on the host
  // already, read once per MoE layer and micro-batch). n_experts must be a multiple of the
  // group's size (checked by the config).
  ExpertDispatcher(Backend& be, Communicator& rows, Communicator& counts, int n_experts);
  int local_experts() const { return local_; }

  // Collective: exchanges the row counts. counts: (n_experts) rows per GLOBAL expert on this rank (host).
  DispatchPlan plan(const int64_t* counts);
  // Collective. rows: (sum of counts, D) in global expert order. out: (plan.received, D) grouped
  // by local expert; within an expert, the rows of rank 0 first, then rank 1, ... each in its
  // sender's order. Backend memory.
  void dispatch(const DispatchPlan& plan, const float* rows, int64_t D, Tensor* out);
  // Collective, the reverse: rows (plan.received, D) laid out as dispatch's output; out: (sum of
  // counts, D) in this rank's dispatch input order. Backend memory.
  void combine(const DispatchPlan& plan, const float* rows, int64_t D, float* out);

  // The same exchanges of other row formats (train.activations bf16), the bytes moved unchanged:
  // BF16 rows (D values of 2 bytes), and FP8 rows with their scales (DeepEP's FP8 dispatch): a
  // QTensor of 1 x T tiles, each row's D bytes and its ceil(D / T) FP32 scales going together;
  // D (and so every row) is a whole number of 32-bit words: D a multiple of 4 (BF16: even).
  void dispatch(const DispatchPlan& plan, const uint16_t* rows, int64_t D, Tensor* out);
  void combine(const DispatchPlan& plan, const uint16_t* rows, int64_t D, uint16_t* out);
  // FP64 rows back (train.moe_gates expert: the gates' gradients the experts computed, D = 1).
  void combine(const DispatchPlan& plan, const double* rows, int64_t D, double* out);
  void dispatch(const DispatchPlan& plan, const QTensor& rows, QTensor* out);
  // Per-tensor FP8 rows (the per-tensor recipes): the D bytes of each row only. The scale is not
  // sent: the caller made it the same on every rank of the group (its amax reduced by
  // reduce_amax), and out takes this rank's.
  // Collective: *amax (backend memory, one value) = the maximum over the group.
  void reduce_amax(float* amax) { rows_.allreduce_max(amax, 1); }

  // Nodes (runtime.ranks_per_node): node[j] of each rank of the group (default: one node). The
  // rows' bytes this rank sends to the others (dispatch and combine, every format), split into
  // those to ranks of its node and to other nodes, since the last reset.
  void set_nodes(std::vector<int64_t> node);
  bool same_node(int rank) const { return node_[size_t(rank)] == node_[size_t(rows_.rank())]; }
  bool spans_nodes() const;
  struct NodeBytes {
    int64_t in_node = 0, across = 0;
  };
  const NodeBytes& node_bytes() const { return node_bytes_; }
  void reset_node_bytes() { node_bytes_ = {}; }

 private:
  // The exchanges over rows of row_bytes bytes each (a multiple of 4): dispatch into `out`
  // (plan.received rows, expert-major), combine into `out` (this rank's sent rows, its order).
  void dispatch_bytes(const DispatchPlan& plan, const void* rows, int64_t row_bytes, void* out);
  void combine_bytes(const DispatchPlan& plan, const void* rows, int64_t row_bytes, void* out);

  void count(const std::vector<int64_t>& send_words);

  Backend& be_;
  Communicator &rows_, &counts_;
  int experts_ = 0, local_ = 0;
  std::vector<int64_t> node_;
  NodeBytes node_bytes_;
};

}  // namespace fp8moe
