// The ParamTable: every parameter of the model declared once, with its GLOBAL shape and how it is
// sharded (docs/ARCHITECTURE.md). Initialization, gradient-sync groups, the global norm, the
// optimizer's shards, checkpoints and resharding all derive from this table and nothing else.
#pragma once

#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "model/config.h"

namespace fp8moe {

// How tensor parallelism splits a parameter.
enum class TpSplit {
  none,    // replicated over the tensor-parallel group (norms, router)
  rows,    // dim 0 split: column-parallel linear W (out, in) (q, k, v, w1, w3), vocabulary rows
  cols,    // dim 1 split: row-parallel linear W (out, in) (o, w2)
};

// Which FP8 layer class a linear weight belongs to (fp8.layers), or none (not an FP8 GEMM).
enum class LinearClass { none, attention, mlp, experts, shared_experts };

enum class InitKind { normal, ones, zeros };

struct ParamSpec {
  std::string name;     // "layers.3.moe.experts.17.w1"
  int64_t rows = 1;     // global shape (rows, cols); vectors have rows = 1
  int64_t cols = 1;
  TpSplit tp = TpSplit::none;
  int layer = -1;       // block index; -1 embedding (first stage), n_layers final norm and head (last)
  int expert = -1;      // global routed-expert index (expert parallelism places whole experts)
  LinearClass linear = LinearClass::none;
  bool trainable = true;     // false: state updated by a rule, not by the optimizer (router bias)
  bool weight_decay = true;  // AdamW decay: not for norms, biases, the router bias
  InitKind init = InitKind::normal;
  float init_std = 0.0f;
  int64_t numel() const { return rows * cols; }
};

struct ParamTable {
  std::vector<ParamSpec> params;
  const ParamSpec& at(const std::string& name) const;  // asserts the name exists
  // -1 when absent. A hash lookup: the model asks by name for every layer's weights, and a
  // DeepSeek-V3-sized table has tens of thousands of entries.
  int64_t index_of(const std::string& name) const;
  int64_t trainable_numel() const;
  // Rebuilds the name index and asserts the names are unique. build_param_table calls it; so must
  // anything that adds or renames entries (index_of asserts the index covers every entry).
  void reindex();

 private:
  std::unordered_map<std::string, int64_t> index_;
};

// The block of a parameter's GLOBAL (rows, cols) tensor that one rank holds (Placement::shard,
// model/placement.h). Empty (rows = cols = 0) where the rank does not hold the parameter.
struct Shard {
  int64_t r0 = 0, rows = 0, c0 = 0, cols = 0;
  int64_t numel() const { return rows * cols; }
  bool held() const { return rows > 0 && cols > 0; }
  bool operator==(const Shard&) const = default;
};
// The table of a model config. Order: embedding, blocks in order, final norm, head, then each
// multi-token prediction module (model.mtp_depth).
ParamTable build_param_table(const ModelConfig& m);
// The name prefix of block l's parameters: "layers.<l>." for l < n_layers, "mtp.<l - n_layers>."
// for the block of multi-token prediction module l - n_layers.
std::string block_prefix(const ModelConfig& m, int l);

// The model's parameter counts by component (`fp8moe train --dry-run`, the start of a run): every
// entry of the table, and what one token activates: the routed experts top_k of n_experts, the
// embedding none (a row lookup, as DeepSeek counts its 37B), everything else all.
struct ParamCount {
  // embedding, attention, dense MLP, routed experts, shared experts, router, norms, head, and MTP:
  // the multi-token prediction modules' own parameters (those of the main model the components
  // before; the MTP row counts its routed experts top_k of n_experts, like the rest).
  std::string component;
  int64_t total = 0;
  double activated = 0;
};
// The main model's components present, "total" (the main model), then with model.mtp_depth > 0
// "MTP" and "total with MTP".
std::vector<ParamCount> count_params(const ModelConfig& m);
std::string param_count_table(const ModelConfig& m);        // the counts as a table for the log

// Deterministic initial values of elements [begin, end) of a parameter's flat (row-major) global
// tensor: a function of (seed, name, global element index) through a counter-based RNG
// (Philox-4x32-10), so any shard is generated alone and equals the same slice of a 1-rank run.
void init_param_slice(const ParamSpec& p, uint64_t seed, int64_t begin, int64_t end, float* out);
// The initial values of a shard (row-major (s.rows, s.cols)), equal to that block of the 1-rank tensor.
void init_shard(const ParamSpec& p, uint64_t seed, const Shard& s, float* out);

// Philox-4x32-10 (Salmon et al., SC'11): four 32-bit outputs for a 128-bit counter and 64-bit key.
struct Philox4x32 {
  uint32_t v[4];
};
Philox4x32 philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0, uint32_t k1);

// 64-bit FNV-1a of a name (the per-parameter key of the RNG).
uint64_t name_hash(const std::string& name);

}  // namespace fp8moe
