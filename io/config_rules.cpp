// The rules between keys, checked after every key has parsed on its own (io/config_load.cpp):
// the model's shapes, the MoE routing groups, the schedule and precision, how the layout splits
// the model, the runtime's device rules, blockwise FP8 tiles against tensor-parallel shards, and
// (given a world size) the process grid. The first broken rule is the one error, naming its key.
#include "io/config.h"

#include "io/config_internal.h"
#include "parallel/grid.h"  // grid_layout_problem: the world-size rules

#include <numeric>
#include <string>
#include <utility>
#include <vector>

namespace fp8moe {

RuntimeProblem runtime_problem(const Config& c) {
  if (c.runtime.comm == CommChoice::nccl && c.runtime.device == DeviceChoice::cpu)
    return {"runtime.comm", "mpi or auto with runtime.device cpu (NCCL needs the CUDA backend)"};
  if (c.runtime.attention == AttentionChoice::cudnn && c.runtime.device != DeviceChoice::cuda &&
      c.runtime.device != DeviceChoice::automatic)
    return {"runtime.attention", "auto or reference unless runtime.device is cuda (cuDNN's fused attention runs on "
                                 "the GPU)"};
  if (c.runtime.device == DeviceChoice::cuda && c.fp8.recipe == Fp8Recipe::blockwise && c.fp8.tile != 128)
    return {"fp8.tile", "128 with runtime.device cuda and fp8.recipe blockwise (cuBLASLt's block-scaled GEMMs use "
                        "1 x 128 and 128 x 128 blocks)"};
  return {};
}

namespace config_detail {
namespace {

// rule(ok, key, expected): a broken rule is the ConfigError naming the key, its value (marked
// "(the default)" where the config did not give it) and where that value came from.
class Rule {
 public:
  Rule(const Config& c, const Loader& L) : c_(c), L_(L) {}
  void operator()(bool ok, const std::string& key, const std::string& expected) const {
    if (ok) return;
    std::string got = show_value(*find_field(key), c_);
    if (L_.where.find(key) == L_.where.end()) got += " (the default)";
    fail(L_.where_of(key), key, got, expected);
  }

 private:
  const Config& c_;
  const Loader& L_;
};

template <class T>
std::string num(T v) {
  return std::to_string(v);
}

// The attention's and the blocks' shapes.
void model_rules(const Rule& rule, const Config& c) {
  const ModelConfig& m = c.model;
  if (!m.mla()) {
    rule(m.n_kv_heads <= m.n_heads && m.n_heads % m.n_kv_heads == 0, "model.n_kv_heads",
         "a divisor of model.n_heads = " + num(m.n_heads) + " (grouped-query attention)");
    rule(m.head_dim % 2 == 0, "model.head_dim", "an even number (RoPE rotates pairs of channels)");
  } else {
    rule(m.qk_rope_head_dim % 2 == 0, "model.qk_rope_head_dim", "an even number (RoPE rotates pairs of channels)");
  }
  rule(m.first_dense_layers <= m.n_layers, "model.first_dense_layers",
       "at most model.n_layers = " + num(m.n_layers));
  rule(m.mtp_depth < c.train.seq_len, "model.mtp_depth",
       "fewer than train.seq_len = " + num(c.train.seq_len) +
           " (module k predicts the token k + 1 ahead in a sequence)");
  rule(m.pad_id < m.vocab_size, "model.pad_id", "-1 or a token id below model.vocab_size = " + num(m.vocab_size));
}

// The experts a token may reach: top_k of them, in topk_group of n_group equal groups.
void moe_rules(const Rule& rule, const MoeConfig& moe) {
  rule(moe.top_k <= moe.n_experts, "model.moe.top_k", "at most model.moe.n_experts = " + num(moe.n_experts));
  rule(moe.n_experts % moe.n_group == 0, "model.moe.n_group",
       "a divisor of model.moe.n_experts = " + num(moe.n_experts) + " (groups of equal size)");
  rule(moe.n_group == 1 || moe.n_experts / moe.n_group >= 2, "model.moe.n_group",
       "at most model.moe.n_experts / 2 = " + num(moe.n_experts / 2) +
           " (a group is ranked by its two best experts)");
  rule(moe.topk_group <= moe.n_group, "model.moe.topk_group", "at most model.moe.n_group = " + num(moe.n_group));
  rule(moe.top_k <= int64_t(moe.topk_group) * (moe.n_experts / moe.n_group), "model.moe.top_k",
       "at most model.moe.topk_group x experts per group = " + num(moe.topk_group) + " x " +
           num(moe.n_experts / moe.n_group) + " (the experts a token may reach)");
}

// The schedule, the optimizer's state and the FP8 format.
void training_rules(const Rule& rule, const Config& c) {
  rule(c.checkpoint.save || c.train.exit_interval == 0, "train.exit_interval",
       "0 with checkpoint.save false (exiting at an interval is for resuming from its checkpoint)");
  rule(c.train.min_lr <= c.train.lr, "train.min_lr", "at most train.lr = " + format_double(c.train.lr));
  rule(c.log.trace.empty() || c.log.trace_start <= c.train.steps, "log.trace_start",
       "at most train.steps = " + num(c.train.steps) + " (a step the run takes)");
  rule(c.train.warmup_steps < c.train.steps, "train.warmup_steps",
       "fewer than train.steps = " + num(c.train.steps) + " (the schedule must reach its decay)");
  // NOTE: a BF16 moment holds 8 significant bits: multiplying by beta2 changes it only when
  // 1 - beta2 is at least half a BF16 step (2^-9 relative); 0.999 would freeze v.
  rule(c.train.moments_dtype != MomentsDtype::bf16 || c.train.beta2 <= 0.996, "train.beta2",
       "at most 0.996 with train.moments_dtype bf16 (a BF16 second moment cannot decay by a smaller factor)");
  // NOTE: the expert all-to-all and the pipeline move 32-bit words (parallel/communicator.h); a
  // row of D BF16 values or D FP8 bytes is whole words when D is a multiple of 4.
  rule(c.train.activations != ActivationDtype::bf16 || c.model.d_model % 4 == 0, "model.d_model",
       "a multiple of 4 with train.activations bf16 (BF16 and FP8 rows travel as 32-bit words)");
  rule(!(c.fp8.recipe == Fp8Recipe::blockwise && c.fp8.format == Fp8Format::hybrid), "fp8.format",
       "e4m3 with fp8.recipe blockwise (DeepSeek-V3 block scaling is E4M3 only)");
  // The watchdog looks every 250 ms (parallel/watchdog.cpp): a limit under a second is no limit a
  // step can meet, and 0 already means "none".
  rule(c.runtime.timeout_s == 0 || c.runtime.timeout_s >= 1, "runtime.timeout_s",
       "0 (no limit) or at least 1 s (the watchdog looks every 250 ms)");
}

// How the layout splits the model: tensor parallelism splits heads, the vocabulary (embedding and
// head) and MLP/expert widths; expert parallelism whole experts; the pipeline whole layers.
void split_rules(const Rule& rule, const Config& c) {
  const ModelConfig& m = c.model;
  const ParallelConfig& p = c.parallel;
  rule(m.n_heads % p.tensor == 0, "parallel.tensor",
       "a divisor of model.n_heads = " + num(m.n_heads) + " (heads are split over tensor-parallel ranks)");
  rule(m.mla() || m.n_kv_heads % p.tensor == 0, "parallel.tensor",
       "a divisor of model.n_kv_heads = " + num(m.n_kv_heads) + " (kv heads are split over tensor-parallel ranks)");
  rule(m.vocab_size % p.tensor == 0, "parallel.tensor",
       "a divisor of model.vocab_size = " + num(m.vocab_size) + " (vocabulary-parallel embedding and head)");
  rule(m.d_ff_dense % p.tensor == 0, "parallel.tensor",
       "a divisor of model.d_ff_dense = " + num(m.d_ff_dense) + " (dense MLP columns are split)");
  rule(m.moe.d_expert % p.tensor == 0, "parallel.tensor",
       "a divisor of model.moe.d_expert = " + num(m.moe.d_expert) + " (expert columns are split)");
  rule(m.moe.n_experts % p.expert == 0, "parallel.expert",
       "a divisor of model.moe.n_experts = " + num(m.moe.n_experts) + " (each expert rank owns whole experts)");
  const bool v_shape = p.pipeline_schedule == PipelineSchedule::dualpipev;
  if (p.pair_micro_batches) {
    // Across stages a pair waits for the next stage's pair, which waits for this stage's previous
    // one: neighbouring stages would take turns (test_pipeline_schedule's PairsAcrossStagesTakeTurns)
    // unless each held twice the micro-batches in flight.
    rule(v_shape || p.pipeline == 1, "parallel.pipeline",
         "1 with parallel.pair_micro_batches under 1f1b or zb1p (across 1F1B's stages the pairs of neighbouring "
         "stages would wait for each other in turn; dualpipev pairs its F&B ops)");
    rule(c.runtime.overlap_expert_comm, "parallel.pair_micro_batches",
         "false unless runtime.overlap_expert_comm is true (a pair switches passes at the posted exchanges)");
  }
  if (v_shape) {
    rule(p.pipeline >= 2, "parallel.pipeline", "at least 2 with parallel.pipeline_schedule dualpipev (a V needs two ranks)");
    rule(p.micro_batches >= 2 * p.pipeline, "parallel.micro_batches",
         "at least 2 x parallel.pipeline = " + num(2 * int64_t(p.pipeline)) + " with parallel.pipeline_schedule dualpipev");
    rule(2 * p.pipeline <= m.n_layers, "parallel.pipeline",
         "at most model.n_layers / 2 = " + num(m.n_layers / 2) +
             " with parallel.pipeline_schedule dualpipev (2 x pipeline chunks, each but the last needs a layer)");
  } else {
    rule(p.pipeline <= m.n_layers, "parallel.pipeline",
         "at most model.n_layers = " + num(m.n_layers) + " (every stage needs a layer)");
  }
  if (p.stage_layers.split == StageSplit::given) {
    const std::vector<int>& g = p.stage_layers.given;
    const int parts = p.pipeline_chunks();
    rule(int(g.size()) == parts, "parallel.stage_layers",
         v_shape ? "one count per chunk with parallel.pipeline_schedule dualpipev: 2 x parallel.pipeline = " +
                       num(parts) + " counts, got " + num(int64_t(g.size()))
                 : "one count per pipeline stage: parallel.pipeline = " + num(p.pipeline) + " counts, got " +
                       num(int64_t(g.size())));
    rule(std::accumulate(g.begin(), g.end(), int64_t(0)) == m.n_layers, "parallel.stage_layers",
         "counts that add up to model.n_layers = " + num(m.n_layers));
  }
  // (On one stage it changes nothing: a one-rank tool of the config holds everything.)
  if (p.mtp_own_stage) rule(m.mtp_depth >= 1, "parallel.mtp_own_stage", "false without multi-token prediction (model.mtp_depth 0)");
  if (p.mtp_own_stage && p.pipeline > 1) {
    rule(p.stage_layers.split != StageSplit::even, "parallel.stage_layers",
         "balanced or a list ending in 0 with parallel.mtp_own_stage (the last stage holds the modules alone)");
    rule(p.stage_layers.split != StageSplit::given || p.stage_layers.given.empty() || p.stage_layers.given.back() == 0,
         "parallel.stage_layers", "a list ending in 0 with parallel.mtp_own_stage (the last stage holds the modules "
         "alone)");
  }
  for (int l : c.train.recompute_layers)
    rule(l < m.n_layers, "train.recompute_layers", "block indices below model.n_layers = " + num(m.n_layers) + ", got " + num(l));
  rule(c.train.recompute_layers.empty() || c.fp8.recipe != Fp8Recipe::delayed || p.pipeline == 1,
       "train.recompute_layers",
       "empty with fp8.recipe delayed and parallel.pipeline > 1 (as train.recompute: a recomputed block's "
       "delayed scale is gone by its backward)");
  rule(c.train.recompute == Recompute::none || c.fp8.recipe != Fp8Recipe::delayed || p.pipeline == 1,
       "train.recompute",
       "none with fp8.recipe delayed and parallel.pipeline > 1 (1F1B runs later micro-batches' forwards before a "
       "block is recomputed, so the delayed scale its forward used is gone)");
}

// Blockwise FP8 under tensor parallelism: a weight block or activation tile may not straddle a
// tensor-parallel shard.
void tile_rules(const Rule& rule, const Config& c) {
  const ModelConfig& m = c.model;
  const int tensor = c.parallel.tensor;
  std::vector<std::pair<const char*, int64_t>> widths = {
      {"model.d_ff_dense", m.d_ff_dense},
      {"model.moe.d_expert", m.moe.d_expert},
  };
  const int64_t H = m.n_heads;
  if (m.mla()) {  // q (or q_b), kv_b and o split by heads
    widths.push_back({"model.n_heads x (model.qk_nope_head_dim + model.qk_rope_head_dim)", H * m.qk_head_dim()});
    widths.push_back({"model.n_heads x (model.qk_nope_head_dim + model.v_head_dim)",
                      H * (m.qk_nope_head_dim + m.v_head_dim)});
    widths.push_back({"model.n_heads x model.v_head_dim", H * m.v_head_dim});
  } else {
    widths.push_back({"model.n_heads x model.head_dim", H * m.head_dim});
    widths.push_back({"model.n_kv_heads x model.head_dim", int64_t(m.n_kv_heads) * m.head_dim});
  }
  for (const auto& [name, width] : widths) {
    const int64_t shard = width / tensor;
    rule(shard % c.fp8.tile == 0, "fp8.tile",
         "a divisor of every tensor-parallel shard width, but " + std::string(name) + " / parallel.tensor = " +
             num(width) + " / " + num(tensor) + " = " + num(shard) + " (blocks may not straddle shards)");
  }
}

// The process grid of world_size ranks, and the global batch over its data-parallel replicas.
void world_rules(const Rule& rule, const Config& c, int world_size) {
  const ParallelConfig& p = c.parallel;
  if (const auto problem = grid_layout_problem(world_size, p.tensor, p.pipeline, p.expert))  // parallel/grid.h
    rule(false, problem->key, problem->expected);
  const int data = world_size / (p.tensor * p.pipeline);
  rule(c.train.global_batch % (int64_t(data) * p.micro_batches) == 0, "train.global_batch",
       "a multiple of data-parallel size x parallel.micro_batches = " + num(data) + " x " + num(p.micro_batches) +
           " = " + num(int64_t(data) * p.micro_batches));
  rule(c.runtime.ranks_per_node == 0 || world_size % c.runtime.ranks_per_node == 0, "runtime.ranks_per_node",
       "0 or a divisor of the world size " + num(world_size) + " (every node holds as many ranks)");
}

}  // namespace

void check_rules(const Config& c, const Loader& L, int world_size) {
  const Rule rule(c, L);
  model_rules(rule, c);
  moe_rules(rule, c.model.moe);
  training_rules(rule, c);
  split_rules(rule, c);
  if (const RuntimeProblem r = runtime_problem(c); !r.key.empty()) rule(false, r.key, r.expected);
  if (c.fp8.recipe == Fp8Recipe::blockwise && c.parallel.tensor > 1) tile_rules(rule, c);
  if (world_size > 0) world_rules(rule, c, world_size);
}

}  // namespace config_detail
}  // namespace fp8moe
