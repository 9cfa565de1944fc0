// Expert parallelism's token exchange (DeepSeek-V3 / Megatron "alltoall" dispatcher) over the
// expert-parallel group of P ranks, rank r owning the experts ExpertOwnership gives it (the L =
// n_experts / P consecutive experts [r L, (r + 1) L)). A rank routes its tokens locally and permutes the chosen (token, expert) rows
// into global expert order; dispatch sends each row to the owner of its expert, combine brings
// the experts' outputs back in the same order. An expert that receives no row is normal.
//
// Backward runs the same plan the other way: the gradients of the experts' outputs go out with
// dispatch, the gradients of their inputs come back with combine.
//
// Across nodes (runtime.node_dedup, DeepEP's internode dispatch): rows that are the same for all of
// a token's experts (its input; with train.moe_gates expert, its output's gradient) cross to each
// other node once, to the rank of that node with this rank's index in its own node (the relay),
// which forwards them to the node's ranks that hold the token's experts. The experts receive the
// same rows in the same order as without the relay, bit for bit. A combine whose rows the token's
// side only sums (the input's gradient; with the gates in the experts, the output) goes back the
// same way: the relay sums a token's rows from its node's experts (FP32; BF16 rows summed in FP32
// and rounded once) and sends one row across; the token's side gets that sum in the place of the
// token's first row to that node and zeros in the others, so its sum over rows is unchanged up to
// the order of the additions and, for BF16 rows, the relay's rounding of its partial sum (one more
// rounding than the direct exchange, whose rows the token's side sums in FP32).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
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

// The ranks of an expert group by node: who relays what (runtime.node_dedup). Rank j's node is
// node[j]; its index in its node is its place among that node's ranks in group order. The relay of
// rank s in node n is the rank of n whose index is s's index modulo n's rank count. The one
// statement of the rule: the dispatcher relays by it, and its tests count by it.
struct NodeMap {
  std::vector<int64_t> node;  // (P) each rank's node
  bool same(int a, int b) const { return node[size_t(a)] == node[size_t(b)]; }
  std::vector<int> ranks_of(int64_t n) const;  // the ranks of node n, in group order
  int relay(int source, int64_t n) const;      // the rank of node n that source's rows cross to
};

struct DispatchPlan {
  int ranks = 1, local_experts = 0;
  std::vector<int64_t> send_rows;    // (P) rows to each rank
  std::vector<int64_t> recv_counts;  // (P x L) rows from rank j for local expert l, [j * L + l]
  std::vector<int64_t> local_rows;   // (L) rows per local expert, over all sources
  int64_t received = 0;              // rows this rank's experts process
  // The relay across nodes (empty without it). Three row gathers on the device, their indices kept
  // here on the host (the plan lives from a forward to its backward; each exchange uploads what it
  // reads): this rank's rows -> the first exchange (each rank of this node its rows, each other
  // node's relay the token rows it needs once each); its arrivals -> the relay's exchange in the
  // node (the rows of the sources this rank relays for, to their experts' ranks); both arrivals ->
  // the experts' rows, laid out as without the relay.
  // A summed combine runs the two exchanges backwards with the gathers' inverses and the relay's
  // sums (sum_rows over the rows each token slot of the first exchange received in the second).
  struct Relay {
    std::vector<int64_t> send1, recv1, send2, recv2;  // (P) rows of each exchange to / from each rank
    std::vector<int64_t> gather1, gather2, gather_out;  // row indices of the three gathers
    int64_t arrived1 = 0, arrived2 = 0;               // rows of the two exchanges' arrivals
    // Combine: the experts' rows -> the relays in the node ([experts' rows]); the sums (sum_offsets,
    // sum_index over the relay's arrivals, sums rows); [experts' rows | sums] -> the first
    // exchange backwards; [its arrivals | a zero row] -> this rank's rows in their order.
    std::vector<int64_t> back2, sum_offsets, sum_index, back1, back_out;
    int64_t sums = 0;
    int64_t across = 0;   // token rows this rank sends to other nodes (one per token and node)
    int64_t relayed = 0;  // rows this rank forwards in its node for other nodes' ranks (itself not counted)
  };
  std::shared_ptr<const Relay> relay;  // shared: the plan is kept with a forward's routing
};

// Exchanges posted and not yet done (the `later` argument of ExpertDispatcher's exchanges): the
// rows go out at the post while the caller computes (the MoE layer's shared expert, the experts'
// weight gradients: model/moe.h), and finish() waits for them and puts the rows where the exchange
// puts them. Until then the rows sent stay unchanged and alive (keep() holds what the caller would
// free) and the output is not read. Every rank of the group posts and finishes the same exchanges
// in the same order (the communicator's rule). Destroyed unfinished, it finishes.
class ExchangeLater {
 public:
  ExchangeLater() = default;
  ExchangeLater(const ExchangeLater&) = delete;
  ExchangeLater& operator=(const ExchangeLater&) = delete;
  ~ExchangeLater();
  void finish();
  bool pending() const { return !steps_.empty(); }
  void keep(std::shared_ptr<const void> x) { kept_.push_back(std::move(x)); }
  // The caller's work on the arrived rows (a widening), run by finish() after the exchanges.
  void then(std::function<void()> step) { steps_.push_back(std::move(step)); }

 private:
  friend class ExpertDispatcher;
  std::vector<std::function<void()>> steps_;
  std::vector<std::shared_ptr<const void>> kept_;
};

class ExpertDispatcher {
 public:
  // rows: the expert group's communicator on the backend's memory (the rows' all-to-all-v);
  // counts: the same group over host memory (the counts' all-to-all: they are on the host
  // already, read once per MoE layer and micro-batch). n_experts must be a multiple of the
  // group's size (checked by the config).
  ExpertDispatcher(Backend& be, Communicator& rows, Communicator& counts, int n_experts);
  int local_experts() const { return local_; }

  // Collective: exchanges the row counts. counts: (n_experts) rows per GLOBAL expert on this rank
  // (host). row_token (host, sum of counts): each row's token, which the relay across nodes needs
  // (relays()); nullptr otherwise.
  DispatchPlan plan(const int64_t* counts, const int64_t* row_token = nullptr);
  // Collective. rows: (sum of counts, D) in global expert order. out: (plan.received, D) grouped
  // by local expert; within an expert, the rows of rank 0 first, then rank 1, ... each in its
  // sender's order. Backend memory.
  // per_token: the rows of one token are the same for all its experts, so the relay may send them
  // across nodes once (it does where the plan has one).
  // later (every exchange): posted, and done at later->finish() (ExchangeLater); through the relay,
  // the exchange across nodes is the one posted (dispatch: the first, combine: the last), the
  // other runs in line (at the finish, at the post).
  void dispatch(const DispatchPlan& plan, const float* rows, int64_t D, Tensor* out, bool per_token = false,
                ExchangeLater* later = nullptr);
  // Collective, the reverse: rows (plan.received, D) laid out as dispatch's output; out: (sum of
  // counts, D) in this rank's dispatch input order. Backend memory.
  // summed: the caller only sums each token's rows (unweighted), so the relay may send their sum
  // across once per node (it does where the plan has one).
  void combine(const DispatchPlan& plan, const float* rows, int64_t D, float* out, bool summed = false,
               ExchangeLater* later = nullptr);

  // The same exchanges of other row formats (train.activations bf16), the bytes moved unchanged:
  // BF16 rows (D values of 2 bytes), and FP8 rows with their scales (DeepEP's FP8 dispatch): a
  // QTensor of 1 x T tiles, each row's D bytes and its ceil(D / T) FP32 scales going together;
  // D (and so every row) is a whole number of 32-bit words: D a multiple of 4 (BF16: even).
  void dispatch(const DispatchPlan& plan, const uint16_t* rows, int64_t D, Tensor* out, bool per_token = false,
                ExchangeLater* later = nullptr);
  void combine(const DispatchPlan& plan, const uint16_t* rows, int64_t D, uint16_t* out, bool summed = false,
               ExchangeLater* later = nullptr);
  // FP64 rows back (train.moe_gates expert: the gates' gradients the experts computed, D = 1).
  void combine(const DispatchPlan& plan, const double* rows, int64_t D, double* out, ExchangeLater* later = nullptr);
  void dispatch(const DispatchPlan& plan, const QTensor& rows, QTensor* out, bool per_token = false,
                ExchangeLater* later = nullptr);
  // Per-tensor FP8 rows (the per-tensor recipes): the D bytes of each row only. The scale is not
  // sent: the caller made it the same on every rank of the group (its amax reduced by
  // reduce_amax), and out takes this rank's.
  // Collective: *amax (backend memory, one value) = the maximum over the group.
  void reduce_amax(float* amax) { rows_.allreduce_max(amax, 1); }

  // Nodes (runtime.ranks_per_node): node[j] of each rank of the group (default: one node). The
  // rows' bytes this rank sends to the others (dispatch and combine, every format), split into
  // those to ranks of its node and to other nodes, since the last reset.
  // dedup (runtime.node_dedup): relay the per-token rows across nodes where the group spans them.
  void set_nodes(std::vector<int64_t> node, bool dedup = false);
  bool same_node(int rank) const { return nodes_.same(rank, rows_.rank()); }
  // runtime.overlap_expert_comm: the MoE layer posts its exchanges (`later`) and computes behind
  // them (model/moe.cpp); false: every exchange in line. Default on.
  void set_overlap(bool on) { overlap_ = on; }
  bool overlap() const { return overlap_; }
  bool spans_nodes() const;
  bool relays() const { return dedup_ && spans_nodes(); }
  const NodeMap& nodes() const { return nodes_; }
  // The group's ranks on other nodes than this rank's.
  int remote_ranks() const { return rows_.size() - int(nodes_.ranks_of(nodes_.node[size_t(rows_.rank())]).size()); }
  struct NodeBytes {
    int64_t in_node = 0, across = 0;
  };
  const NodeBytes& node_bytes() const { return node_bytes_; }
  void reset_node_bytes() { node_bytes_ = {}, relay_rows_ = {}; }
  // What the relay's plans since the last reset said this rank sends: token rows across nodes and
  // rows forwarded in its node, per plan (each per-token exchange of a plan moves them once).
  struct RelayRows {
    int64_t across = 0, relayed = 0, plans = 0;
  };
  const RelayRows& relay_rows() const { return relay_rows_; }

 private:
  // The exchanges over rows of row_bytes bytes each (a multiple of 4): dispatch into `out`
  // (plan.received rows, expert-major), combine into `out` (this rank's sent rows, its order).
  // per_token: through the plan's relay where it has one.
  void dispatch_bytes(const DispatchPlan& plan, const void* rows, int64_t row_bytes, void* out, bool per_token,
                      ExchangeLater* later);
  void relay_bytes(const DispatchPlan& plan, const void* rows, int64_t row_bytes, void* out, ExchangeLater* later);
  // One all-to-all-v of 32-bit words (its bytes counted), then `then`: in line, or posted with the
  // wait and `then` left to later.
  void exchange(const void* send, const std::vector<int64_t>& sc, void* recv, const std::vector<int64_t>& rc,
                ExchangeLater* later, std::function<void()> then);
  void gather_rows(const void* rows, const std::vector<int64_t>& index, int64_t words, void* out);
  // The summed combine through the relay: rows of D FP32 or BF16 values.
  void relay_combine(const DispatchPlan& plan, const void* rows, int64_t D, bool bf16, void* out, ExchangeLater* later);
  void plan_relay(const int64_t* counts, const int64_t* row_token, DispatchPlan* plan);
  void combine_bytes(const DispatchPlan& plan, const void* rows, int64_t row_bytes, void* out, ExchangeLater* later);

  void count(const std::vector<int64_t>& send_words);

  Backend& be_;
  Communicator &rows_, &counts_;
  int experts_ = 0, local_ = 0;
  NodeMap nodes_;
  bool dedup_ = false;
  bool overlap_ = true;
  NodeBytes node_bytes_;
  RelayRows relay_rows_;
};

}  // namespace fp8moe
