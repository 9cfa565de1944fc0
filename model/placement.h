// Where the model's pieces live on the process grid, answered in one place (docs/ARCHITECTURE.md,
// "Placement"). From a rank's position in its model-parallel groups and the model config:
//   pipeline   which blocks a stage runs (the embedding on the first stage, the head on the last,
//              or with parallel.mtp_own_stage on the one before it);
//   experts    which routed experts an expert-parallel rank holds, and who holds a given one;
//   tensor     which block of every parameter a tensor-parallel rank holds, and the model's widths
//              on that rank;
//   rows       which rows of a tensor a replica owns (ZeRO-1's shards, the checkpoint writers'
//              shares) — replica_rows below.
// The Transformer builds one from its communicators; everything else asks the Transformer's.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "model/config.h"
#include "model/param_table.h"
#include "parallel/expert_dispatch.h"

namespace fp8moe {

// A rank's position in each model-parallel group: its rank in it and the group's size; split: the
// blocks of each pipeline stage (stage_split), empty for the even split.
// v_shape (parallel.pipeline_schedule dualpipev): the blocks are cut into 2 x stages chunks and
// stage s holds chunk s and chunk 2 x stages - 1 - s; split then counts chunks.
struct GridPosition {
  int tensor_rank = 0, tensor = 1;
  int stage = 0, stages = 1;
  int expert_rank = 0, experts = 1;
  std::vector<int> split;
  bool v_shape = false;
  // parallel.mtp_own_stage (with several stages): the multi-token prediction modules alone on the
  // last chunk, the main model's head on the chunk before it.
  bool mtp_alone = false;
  int chunks() const { return v_shape ? 2 * stages : stages; }  // the pipeline's parts of the blocks
};

// The blocks of pipeline stage `stage` of `stages`: [ceil(s L / P), ceil((s + 1) L / P)) — the
// earlier stages take the extra blocks of an uneven split (the last one also runs the head and the
// loss).
std::pair<int, int> stage_layers(int n_layers, int stage, int stages);

// The work of the model's pieces for splitting it into stages: forward FLOPs per token of each
// block's GEMMs (the routed experts at top_k of n_experts, the router included) and attention core
// at sequence length T (causal: T / 2 keys a query on average); `last`: what the last stage runs
// besides its blocks (the head, for the model and each multi-token prediction module, and the
// modules themselves, eh_proj and block; `head`: of it, the main model's head). The embedding is
// a lookup: no work counted.
struct LayerCosts {
  std::vector<double> block;
  double last = 0;
  double head = 0;  // of `last`, the main model's head (parallel.mtp_own_stage puts it with the last block)
};
LayerCosts layer_costs(const ModelConfig& m, int64_t T);

// Blocks per stage by parallel.stage_layers: even (stage_layers above), given, or balanced: the
// contiguous split, every stage at least one block, whose most expensive stage (its blocks, and
// the last stage's head and modules, by layer_costs) costs least; among equals, the one with the
// most blocks on the earlier stages. The last stage holds no block (the head and the multi-token
// prediction modules only) where that makes the most expensive stage strictly cheaper (Megatron's
// last-stage layer count of 0). given: every stage at least one block, the last at least 0.
// v_shape (DualPipeV, stages = 2P chunks): balanced balances the ranks, each chunk r with chunk
// 2P - 1 - r (the last chunk with the head and the modules), not the chunks; even and given as
// above, over the chunks.
// mtp_alone (parallel.mtp_own_stage): balanced leaves the last stage (DualPipeV: rank 0's back
// chunk) no block and only the modules' cost, and puts the main head's on the stage before it
// (rank 1).
std::vector<int> stage_split(const ModelConfig& m, const StageLayers& s, int stages, int64_t T, bool v_shape = false,
                             bool mtp_alone = false);

// Whether a split's last chunk holds no block and runs the head (not parallel.mtp_own_stage's
// modules alone): Placement::head_alone.
inline bool last_chunk_head_alone(const std::vector<int>& split, bool mtp_alone) {
  return !mtp_alone && !split.empty() && split.back() == 0;
}

// Rows [begin, end) of a parameter's (rows, cols) tensor.
struct RowRange {
  int64_t begin = 0, end = 0;
  bool operator==(const RowRange&) const = default;
};

// An even split of a tensor's rows over `replicas` ranks: rows [rows r / n, rows (r + 1) / n) to
// replica r, every row to exactly one (ZeRO-1's shards; the checkpoint writers' shares).
RowRange replica_rows(int64_t rows, int replica, int replicas);

class Placement {
 public:
  // Checks that the model splits evenly over the groups (the config checks it first, with a
  // message for the user; here it is an internal error).
  Placement(const ModelConfig& m, const GridPosition& at);
  const GridPosition& at() const { return at_; }

  // Pipeline: this rank's chunks of blocks, [layer_begin(c), layer_end(c)) for c < chunks(): one
  // (its stage's) under 1F1B; two under DualPipeV, the V's way down (chunk `stage` of the 2P, run
  // by phase 0) and its way back (chunk 2P - 1 - stage, phase 1).
  int chunks() const { return at_.v_shape ? 2 : 1; }
  int layer_begin(int c = 0) const { return ranges_[size_t(c)].first; }
  int layer_end(int c = 0) const { return ranges_[size_t(c)].second; }
  bool holds_layer(int layer) const;
  // Whether chunk c starts the model (the embedding) or ends it (the multi-token prediction
  // modules, and the head and the loss unless mtp_alone). (The last chunk may hold no block:
  // parallel.stage_layers. The first holds at least one.) chunk_head: whether chunk c runs the
  // main model's final norm, head and loss: the last chunk, or with mtp_alone the one before it
  // (it holds the last block; its output to the last chunk is the final norm's, hf).
  bool chunk_first(int c) const { return at_.stage == 0 && c == 0; }
  bool chunk_last(int c) const { return at_.v_shape ? at_.stage == 0 && c == 1 : at_.stage == at_.stages - 1; }
  bool chunk_head(int c) const {
    if (!at_.mtp_alone) return chunk_last(c);
    return at_.v_shape ? at_.stage == 1 && c == 1 : at_.stage == at_.stages - 2;
  }
  // Whether the last chunk runs the head with no block (parallel.stage_layers [.., 0] without
  // mtp_alone): its input gradient is the head's, which is not a rounding point of BF16
  // activations (model/context.h), so that pipeline message carries it in FP32 on every wire.
  bool head_alone() const { return last_chunk_head_alone(at_.split, at_.mtp_alone); }
  // Whether this rank holds the embedding / the last chunk (DualPipeV: rank 0 holds both) / the
  // main model's head.
  bool first_stage() const { return at_.stage == 0; }
  bool last_stage() const { return at_.v_shape ? at_.stage == 0 : at_.stage == at_.stages - 1; }
  bool head_stage() const { return chunk_head(0) || chunk_head(chunks() - 1); }
  // mtp_alone: the last stage holds a copy of the head's weight for the modules' heads, tied to the
  // head stage's (its gradient added to the head stage's, the head stage's weight replacing it
  // after each step: Transformer::tie_head_gradient, share_tied_head). The copy is not written to
  // checkpoints nor counted in the gradient norm: the head stage's is.
  bool mtp_alone() const { return at_.mtp_alone; }
  // The pipeline ranks of the last chunk and of the head's chunk (the same one without mtp_alone).
  int last_rank() const { return at_.v_shape ? 0 : at_.stages - 1; }
  int head_rank() const { return !at_.mtp_alone ? last_rank() : at_.v_shape ? 1 : at_.stages - 2; }
  // Whether this rank is one of the two that hold the head's weight tied (mtp_alone).
  bool in_head_tie() const { return at_.mtp_alone && (at_.stage == head_rank() || at_.stage == last_rank()); }
  bool holds_tied_copy(const ParamSpec& p) const { return at_.mtp_alone && last_stage() && p.name == "head.weight"; }

  // Expert parallelism: this rank's routed experts [first_expert, first_expert + local_experts)
  // of every MoE layer, and the expert-parallel rank holding expert e.
  int first_expert() const { return experts_.first(at_.expert_rank); }
  int local_experts() const { return experts_.per_rank(); }
  int expert_owner(int e) const { return experts_.owner(e); }
  const ExpertOwnership& expert_ownership() const { return experts_; }

  // The block of a parameter's GLOBAL (rows, cols) tensor this rank holds: tensor parallelism
  // splits dim 0 (TpSplit::rows) or dim 1 (TpSplit::cols) evenly; expert parallelism holds whole
  // experts or none; a pipeline stage holds its blocks' parameters (layer -1, the embedding, on the
  // first stage; the final norm and the head on the head stage, the head on the last stage too;
  // the modules' on the last). Empty where not held.
  Shard shard(const ParamSpec& p) const;

  // The model's dims on this tensor-parallel rank: heads, FFN and expert widths and the vocabulary
  // divided by the tensor-parallel size; and the first vocabulary row this rank holds.
  const ModelConfig& local() const { return local_; }
  int64_t vocab_first() const { return int64_t(local_.vocab_size) * at_.tensor_rank; }

 private:
  GridPosition at_;
  int n_layers_ = 0;
  std::vector<std::pair<int, int>> ranges_;  // per chunk of this rank
  ExpertOwnership experts_;
  ModelConfig local_;
};

}  // namespace fp8moe
