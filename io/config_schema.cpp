// The schema: every config key once, with its path, type, range and meaning (its default is
// model/config.h's; how each kind of value is parsed and shown: io/config_fields.h), and the
// lookups of the table. The loader
// (and the effective config and reference it writes) is io/config_load.cpp, the rules between
// keys io/config_rules.cpp.
#include "io/config_fields.h"
#include "io/config_internal.h"
#include "io/text.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <functional>
#include <limits>
#include <type_traits>

namespace fp8moe {
namespace config_detail {

// ---------------------------------------------------------------------------------------------
// Messages
// ---------------------------------------------------------------------------------------------

[[noreturn]] void fail(const std::string& where, const std::string& key, const std::string& got,
                       const std::string& expected) {
  throw ConfigError(where + ": " + key + ": got " + got + ", expected " + expected);
}

std::string location(const std::string& file, const YAML::Mark& mark) {
  if (mark.is_null()) return file;
  return file + ":" + std::to_string(mark.line + 1) + ":" + std::to_string(mark.column + 1);
}

// How a node is shown after "got".
std::string describe(const YAML::Node& node) {
  switch (node.Type()) {
    case YAML::NodeType::Null: return "nothing (an empty value)";
    case YAML::NodeType::Map: return "a mapping";
    case YAML::NodeType::Sequence: return "a list";
    case YAML::NodeType::Scalar: return "'" + shown(node.Scalar()) + "'";  // control bytes escaped, long values cut
    default: return "an undefined value";
  }
}

std::string format_double(double v) {
  // Shortest text that reads back to the same double; plain decimals where they stay short
  // ("0.0003", not "3e-04"), exponents for very small or large magnitudes.
  char buf[64];
  const double mag = std::abs(v);
  const auto format = (v == 0 || (mag >= 1e-4 && mag < 1e15)) ? std::chars_format::fixed : std::chars_format::scientific;
  auto [end, ec] = std::to_chars(buf, buf + sizeof buf, v, format);
  std::string s(buf, end);
  // Keep it a float to YAML readers ("3" -> "3.0"), so the effective config shows the type.
  if (s.find_first_of(".eEn") == std::string::npos) s += ".0";
  return s;
}

// ---------------------------------------------------------------------------------------------
// The schema (its fields' kinds: io/config_fields.h)
// ---------------------------------------------------------------------------------------------

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// REF(model.d_model) -> accessor usable on Config& and const Config&.
#define REF(member) [](auto& c) -> auto& { return c.member; }

}  // namespace

const std::vector<Field>& schema() {
  static const std::vector<Field> fields = [] {
    using B = Bound;
    std::vector<Field> v;
    // model
    v.push_back(integer("model.vocab_size", REF(model.vocab_size), 2, 1 << 24, "Vocabulary size (256 = bytes)."));
    v.push_back(integer("model.d_model", REF(model.d_model), 1, 1 << 20, "Hidden size."));
    v.push_back(integer("model.n_layers", REF(model.n_layers), 1, 4096, "Transformer blocks."));
    v.push_back(integer("model.n_heads", REF(model.n_heads), 1, 4096, "Attention (query) heads."));
    v.push_back(choice("model.attention", REF(model.attention),
                       "gqa: grouped-query attention (n_kv_heads, head_dim); mla: DeepSeek-V2/V3's multi-head "
                       "latent attention (q_lora_rank, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, "
                       "v_head_dim)."));
    v.push_back(integer("model.n_kv_heads", REF(model.n_kv_heads), 1, 4096,
                        "gqa: key/value heads (grouped-query attention); divides n_heads."));
    v.push_back(integer("model.head_dim", REF(model.head_dim), 2, 4096, "gqa: size of one head; even (RoPE)."));
    v.push_back(integer("model.q_lora_rank", REF(model.q_lora_rank), 0, 1 << 20,
                        "mla: rank of the queries' down-projection (DeepSeek-V3: 1536); 0 = one projection "
                        "(DeepSeek-V2-Lite)."));
    v.push_back(integer("model.kv_lora_rank", REF(model.kv_lora_rank), 1, 1 << 20,
                        "mla: rank of the latent shared by keys and values (DeepSeek-V3: 512)."));
    v.push_back(integer("model.qk_nope_head_dim", REF(model.qk_nope_head_dim), 0, 4096,
                        "mla: channels of each query/key head without RoPE (DeepSeek-V3: 128)."));
    v.push_back(integer("model.qk_rope_head_dim", REF(model.qk_rope_head_dim), 2, 4096,
                        "mla: RoPE channels of each query head and of the one key shared by all heads; even "
                        "(DeepSeek-V3: 64)."));
    v.push_back(integer("model.v_head_dim", REF(model.v_head_dim), 1, 4096,
                        "mla: size of one value head (DeepSeek-V3: 128)."));
    v.push_back(real("model.rope_theta", REF(model.rope_theta), 0, B::open, kInf, B::open, "RoPE base."));
    v.push_back(real("model.norm_eps", REF(model.norm_eps), 0, B::open, 1, B::open, "RMSNorm epsilon."));
    v.push_back(integer("model.first_dense_layers", REF(model.first_dense_layers), 0, 4096,
                        "The first this many blocks use a dense SwiGLU MLP, the rest an MoE."));
    v.push_back(integer("model.d_ff_dense", REF(model.d_ff_dense), 1, 1 << 22, "Width of the dense MLPs."));
    v.push_back(real("model.init_std", REF(model.init_std), 0, B::open, 1, B::closed,
                     "Standard deviation of the initial weights (DeepSeek-V3: 0.006)."));
    v.push_back(integer("model.pad_id", REF(model.pad_id), -1, 1 << 24,
                        "Targets equal to this token id are ignored by the loss; -1 = none."));
    v.push_back(integer("model.mtp_depth", REF(model.mtp_depth), 0, 64,
                        "Multi-token prediction modules (DeepSeek-V3: 1), each predicting one token further "
                        "with one MoE block and the shared embedding and head; 0 = off."));
    v.push_back(real("model.mtp_loss_weight", REF(model.mtp_loss_weight), 0, B::closed, kInf, B::open,
                     "Weight of the mean of the multi-token prediction losses in the training loss "
                     "(DeepSeek-V3: 0.3 for the first 10T tokens, then 0.1)."));
    v.push_back(integer("model.moe.n_experts", REF(model.moe.n_experts), 1, 1 << 16, "Routed experts per MoE layer."));
    v.push_back(integer("model.moe.top_k", REF(model.moe.top_k), 1, 1 << 16, "Routed experts chosen per token."));
    v.push_back(integer("model.moe.n_shared_experts", REF(model.moe.n_shared_experts), 0, 64,
                        "Always-active shared experts."));
    v.push_back(integer("model.moe.d_expert", REF(model.moe.d_expert), 1, 1 << 22,
                        "Width of each routed and shared expert."));
    v.push_back(choice("model.moe.gating", REF(model.moe.gating),
                       "softmax: top-k of softmax scores; sigmoid (DeepSeek-V3): top-k of sigmoid "
                       "scores normalised over the chosen k."));
    v.push_back(real("model.moe.aux_loss_coef", REF(model.moe.aux_loss_coef), 0, B::closed, kInf, B::open,
                     "Coefficient of the auxiliary balance loss; 0 = off."));
    v.push_back(real("model.moe.bias_update_rate", REF(model.moe.bias_update_rate), 0, B::closed, kInf,
                     B::open, "Aux-loss-free balancing: per-step change of the expert bias; 0 = off."));
    v.push_back(real("model.moe.capacity_factor", REF(model.moe.capacity_factor), 0, B::closed, kInf,
                     B::open, "Expert capacity as a multiple of the balanced load; 0 = never drop tokens."));
    v.push_back(integer("model.moe.n_group", REF(model.moe.n_group), 1, 1 << 16,
                        "Node-limited routing (DeepSeek-V3: 8): the routed experts in this many groups of "
                        "consecutive experts; 1 = no limit."));
    v.push_back(integer("model.moe.topk_group", REF(model.moe.topk_group), 1, 1 << 16,
                        "Groups a token may route to (DeepSeek-V3: 4): those with the largest sum of their "
                        "two best selection keys (score + bias)."));
    v.push_back(real("model.moe.routed_scaling_factor", REF(model.moe.routed_scaling_factor), 0, B::open, kInf,
                     B::open, "Multiplies the routed experts' gates (DeepSeek-V3: 2.5); the shared experts' "
                     "output is not scaled."));
    v.push_back(choice("model.moe.norm_topk_prob", REF(model.moe.norm_topk_prob),
                       "Divide the chosen experts' scores by their sum: auto = true with sigmoid gating "
                       "(DeepSeek-V3), false with softmax (DeepSeek-V2)."));
    // parallel
    v.push_back(integer("parallel.tensor", REF(parallel.tensor), 1, 1 << 16, "Tensor-parallel size."));
    v.push_back(integer("parallel.pipeline", REF(parallel.pipeline), 1, 1 << 16, "Pipeline stages."));
    v.push_back(stage_layers_field());
    v.push_back(choice("parallel.pipeline_schedule", REF(parallel.pipeline_schedule),
                       "The order of the pipeline's forwards and backwards: 1f1b (Megatron's non-interleaved "
                       "schedule), zb1p (the zero-bubble ZB-H1: 1F1B with each backward split into its input "
                       "part and its linear layers' weight-gradient GEMMs, stage s keeping up to s of those "
                       "waiting to fill what was 1F1B's bubble; the experts' stay in the backward where their "
                       "exchange is posted; the same gradients, bit for bit), or dualpipev (DeepSeek's V-shaped DualPipe: the blocks in 2 x pipeline "
                       "chunks, rank s holding chunk s and chunk 2 x pipeline - 1 - s, so that rank 0 holds "
                       "the embedding and the head; needs parallel.pipeline >= 2 and parallel.micro_batches "
                       ">= 2 x pipeline; parallel.stage_layers then counts chunks). An F&B runs its backward, "
                       "then its forward (overlapped with parallel.pair_micro_batches), and no backward leaves "
                       "its weight gradient for the weight ops yet."));
    v.push_back(boolean("parallel.pair_micro_batches", REF(parallel.pair_micro_batches),
                        "The forward of one micro-batch and the backward of another as one op, the two passes "
                        "interleaved at the MoE layers' expert exchanges so that each exchange travels while the "
                        "other pass computes (DualPipe's F&B; Megatron's --overlap-moe-expert-parallel-comm "
                        "across micro-batches): under dualpipev its F&B ops; under 1f1b or zb1p on one stage "
                        "(parallel.pipeline 1: across 1F1B's stages neighbouring pairs would wait for each other "
                        "in turn) one forward first, then pairs. One more micro-batch (chunk) in flight; the same "
                        "results. Needs runtime.overlap_expert_comm."));
    v.push_back(boolean("parallel.mtp_own_stage", REF(parallel.mtp_own_stage),
                        "The multi-token prediction modules on the last pipeline stage alone (dualpipev: the last "
                        "chunk, on rank 0), which then holds no block; the main model's final norm, head and loss "
                        "run on the stage (chunk) of the last block, so that the two heads' GEMMs are on two "
                        "ranks. Both hold the head's weight, tied: the modules' stage sends its gradient to the "
                        "head's stage, which adds it before the data-parallel reduction, and after the "
                        "optimizer's step the head's stage sends its weight back to replace the copy. Needs model.mtp_depth >= 1 and, on several stages, the last stage (chunk) "
                        "holding no block (parallel.stage_layers: balanced, or a list ending in 0); on one stage "
                        "it changes nothing."));
    v.push_back(integer("parallel.expert", REF(parallel.expert), 1, 1 << 16,
                        "Expert-parallel size; divides the data-parallel size (world / (tensor x pipeline))."));
    v.push_back(integer("parallel.micro_batches", REF(parallel.micro_batches), 1, 1 << 16,
                        "Micro-batches per step on each data-parallel rank (gradient accumulation; the pipeline's schedule runs them)."));
    // train
    v.push_back(integer("train.seed", REF(train.seed), 0, kNoMax, "Seed of initialisation and data order."));
    v.push_back(integer("train.steps", REF(train.steps), 1, kNoMax, "Optimizer steps."));
    v.push_back(integer("train.exit_interval", REF(train.exit_interval), 0, kNoMax,
                        "Save a checkpoint and exit 0 after a step whose number is a multiple of this; 0 = off."));
    v.push_back(integer("train.global_batch", REF(train.global_batch), 1, 1 << 24,
                        "Sequences per step over all data-parallel ranks."));
    v.push_back(integer("train.seq_len", REF(train.seq_len), 1, 1 << 20, "Tokens per sequence."));
    v.push_back(real("train.lr", REF(train.lr), 0, B::open, kInf, B::open, "Peak learning rate."));
    v.push_back(real("train.min_lr", REF(train.min_lr), 0, B::closed, kInf, B::open,
                     "Learning rate at the end of the decay; <= train.lr."));
    v.push_back(integer("train.warmup_steps", REF(train.warmup_steps), 0, kNoMax, "Linear warm-up steps."));
    v.push_back(choice("train.schedule", REF(train.schedule), "Decay after warm-up."));
    v.push_back(real("train.weight_decay", REF(train.weight_decay), 0, B::closed, kInf, B::open,
                     "Decoupled (AdamW) weight decay; not applied to norms and biases."));
    v.push_back(real("train.beta1", REF(train.beta1), 0, B::closed, 1, B::open, "Adam beta1."));
    v.push_back(real("train.beta2", REF(train.beta2), 0, B::closed, 1, B::open, "Adam beta2."));
    v.push_back(real("train.eps", REF(train.eps), 0, B::open, 1, B::open, "Adam epsilon."));
    v.push_back(real("train.grad_clip", REF(train.grad_clip), 0, B::closed, kInf, B::open,
                     "Global gradient-norm clip; 0 = off."));
    v.push_back(choice("train.moments_dtype", REF(train.moments_dtype),
                       "Storage of the Adam moments (bf16 as DeepSeek-V3)."));
    v.push_back(loss_scale_field());
    v.push_back(real("train.loss_scale_initial", REF(train.loss_scale_initial), 0, B::open, 1e30, B::closed,
                     "Dynamic loss scaling: the first scale."));
    v.push_back(integer("train.loss_scale_growth_interval", REF(train.loss_scale_growth_interval), 1, kNoMax,
                        "Dynamic loss scaling: finite steps in a row before the scale grows."));
    v.push_back(real("train.loss_scale_growth", REF(train.loss_scale_growth), 1, B::open, 1e6, B::closed,
                     "Dynamic loss scaling: growth factor."));
    v.push_back(real("train.loss_scale_backoff", REF(train.loss_scale_backoff), 0, B::open, 1, B::open,
                     "Dynamic loss scaling: factor after a step with non-finite gradients (which is skipped)."));
    v.push_back(choice("train.recompute", REF(train.recompute),
                       "Recompute in backward instead of saving: nothing; selected ops of every block (DeepSeek-V3: the "
                       "FFN norm's output, MLA's per-head queries, keys and values, the SwiGLU outputs); the MoE "
                       "blocks; or every block."));
    v.push_back(recompute_layers_field());
    v.push_back(choice("train.activations", REF(train.activations),
                       "fp32: every activation and message FP32 (exact). bf16 (DeepSeek-V3's wire precisions): "
                       "the residual stream rounded to BF16 between blocks, pipeline messages in BF16, the "
                       "experts' all-to-all rows in FP8, quantized once before dispatch (blockwise: 1 x tile "
                       "tiles; delayed, current: one scale per exchange) or BF16 (experts out of FP8), combine "
                       "in BF16; ops inside a block stay FP32."));
    v.push_back(choice("train.hp_gemm", REF(train.hp_gemm),
                       "The GEMMs outside the linear layers (MoE router, head, MTP eh_proj): fp32, or bf16 "
                       "(DeepSeek-V3's): BF16 operands, FP32 accumulation and outputs."));
    v.push_back(choice("train.moe_gates", REF(train.moe_gates),
                       "Where the routed experts' gates multiply: combine (each expert's output, as the token's "
                       "rank sums them), or expert (each expert's SwiGLU output before its down-projection, "
                       "Megatron-Core's weighted SwiGLU: combine is a plain sum and the experts' outputs are "
                       "not kept for backward; each row's gate travels with it, 4 bytes out and its FP64 gradient, 8 bytes, back)."));
    // optim
    v.push_back(integer("optim.zero", REF(optim.zero), 0, 1,
                        "1: shard the Adam moments over the data-parallel replicas (ZeRO-1: reduce-scatter "
                        "gradients, update the shard, all-gather weights); 0: every replica keeps full copies."));
    v.push_back(choice("optim.grad_reduce", REF(optim.grad_reduce),
                       "The gradients' reduction over the data-parallel replicas: fp32, or bf16: each replica's "
                       "gradients rounded to BF16 on the wire (half the reduce-scatter's bytes), summed in FP32 "
                       "in rank order; the ZeRO-1 all-gather of the weights stays FP32."));
    v.push_back(boolean("optim.overlap_grad_reduce", REF(optim.overlap_grad_reduce),
                        "The FP32 gradient reduction in one bucket per layer, each posted as a non-blocking "
                        "collective once the step's last backward has passed its layer, waited before the "
                        "optimizer (Megatron's --overlap-grad-reduce); false: one reduction after the backward. "
                        "MPI and NCCL overlap; the staged MPI transport runs a post in line."));
    // fp8
    v.push_back(choice("fp8.recipe", REF(fp8.recipe),
                       "off: FP32 GEMMs; delayed / current: per-tensor scales from an amax history / "
                       "this step's amax; blockwise (DeepSeek-V3): 1 x tile activation and gradient "
                       "tiles, tile x tile weight blocks."));
    v.push_back(choice("fp8.format", REF(fp8.format),
                       "e4m3 everywhere, or hybrid: E4M3 forward, E5M2 gradients (not with blockwise)."));
    v.push_back(integer("fp8.amax_history_len", REF(fp8.amax_history_len), 1, 1 << 20,
                        "Delayed scaling: length of the amax history."));
    v.push_back(choice("fp8.amax_compute", REF(fp8.amax_compute),
                       "Delayed scaling: the amax used is the history's max or its most recent entry."));
    v.push_back(integer("fp8.margin", REF(fp8.margin), 0, 64, "Scale = fp8_max / amax / 2^margin."));
    v.push_back(integer("fp8.tile", REF(fp8.tile), 1, 4096,
                        "Blockwise tile size T (DeepSeek-V3 and cuBLASLt: 128)."));
    v.push_back(boolean("fp8.power_of_two_scales", REF(fp8.power_of_two_scales),
                        "Round scales down to powers of two (exact rescaling)."));
    v.push_back(boolean("fp8.cache_activations", REF(fp8.cache_activations),
                        "Blockwise: keep the inputs of FP8 linear layers for backward as their 1 x T FP8 copy, "
                        "re-tiled to T x 1 for the weight gradient (DeepSeek-V3), instead of the T x 1 copy "
                        "quantized from FP32 in the forward (either way FP8, never FP32)."));
    v.push_back(fp8_layers_field());
    // data
    v.push_back(data_sources_field("data.path", REF(data.path),
                                   "Training data: the prefix of a Megatron indexed data set (PREFIX.bin + PREFIX.idx, "
                                   "made by `fp8moe prepare-data`, scripts/tokenize-data.py or Megatron-LM), or a "
                                   "blend [[weight, prefix], ...] sampled by weight."));
    v.push_back(data_sources_field("data.valid_path", REF(data.valid_path),
                                   "Validation data, in the same form; empty = no validation loss."));
    // eval
    v.push_back(integer("eval.every", REF(eval.every), 0, kNoMax, "Evaluate every this many steps; 0 = never."));
    v.push_back(integer("eval.batches", REF(eval.batches), 1, 1 << 20, "Validation batches per evaluation."));
    // checkpoint
    v.push_back(text("checkpoint.dir", REF(checkpoint.dir), false, "Directory of the checkpoints."));
    v.push_back(integer("checkpoint.every", REF(checkpoint.every), 0, kNoMax,
                        "Save every this many steps; 0 = only at the end."));
    v.push_back(integer("checkpoint.keep_last", REF(checkpoint.keep_last), 1, 1 << 20,
                        "Committed checkpoints kept; older ones are deleted after a newer one commits."));
    v.push_back(boolean("checkpoint.save", REF(checkpoint.save),
                        "false: write no checkpoint, not even at the end (benchmarks); a stop signal then ends "
                        "the job after its step with exit 1 (nothing saved, nothing to requeue)."));
    v.push_back(text("checkpoint.resume", REF(checkpoint.resume), false,
                     "auto: resume from <dir>/latest if present; none: start fresh; or a checkpoint path."));
    v.push_back(integer("checkpoint.staging_bytes", REF(checkpoint.staging_bytes), 8, kNoMax,
                        "Bytes of the one host buffer (pinned under CUDA) a save or a load stages tensors "
                        "through, chunk by chunk."));
    v.push_back(choice("checkpoint.async", REF(checkpoint.async),
                       "true: a periodic save copies what each rank writes into host memory (pinned under CUDA) "
                       "and writes, reads back and commits it on a thread of its own while training goes on; "
                       "the next save, a stop signal and the end of the run wait for it. auto: true on cuda where "
                       "every rank has a CPU to spare for that thread (its binding's share of CPUs is at least 2), "
                       "false on the cpu and emulated devices (their compute takes every CPU). false: every save "
                       "blocks training until it is committed."));
    v.push_back(integer("checkpoint.async_max_bytes", REF(checkpoint.async_max_bytes), 0, kNoMax,
                        "The most host memory one rank's asynchronous copy may take (default 32 GiB); when a "
                        "rank's share of the checkpoint is larger, saves are synchronous, with a warning."));
    // log
    v.push_back(integer("log.every", REF(log.every), 1, kNoMax, "Print metrics every this many steps."));
    v.push_back(text("log.jsonl", REF(log.jsonl), true, "Path of the JSONL metrics file; empty = none."));
    v.push_back(text("log.trace", REF(log.trace), true,
                     "Directory of the step timeline: rank<r>.json per rank, Chrome trace JSON (Perfetto): compute "
                     "phases, every collective's call or post and wait, pipeline sends and receives; "
                     "scripts/trace.py merges and summarises. Empty = none."));
    v.push_back(integer("log.trace_start", REF(log.trace_start), 1, kNoMax, "The first step the timeline records."));
    v.push_back(integer("log.trace_steps", REF(log.trace_steps), 1, 1000, "Steps the timeline records."));
    // runtime
    v.push_back(choice("runtime.device", REF(runtime.device),
                       "Where the step runs: cpu, cuda (rank -> GPU by its node-local rank), auto (cuda when "
                       "every rank sees a GPU, else cpu), or emulated (the CPU kernels on memory the host may not "
                       "touch: proves without a GPU that the step keeps its tensors on the device). The default is "
                       "cpu until the device-resident CUDA backend has passed the device check on a GPU (README, "
                       "CUDA backend)."));
    v.push_back(choice("runtime.comm", REF(runtime.comm),
                       "Collectives and pipeline transfers on device memory: nccl (cuda with a GPU per rank; on the "
                       "emulated device its own in-order collectives), mpi (staged through pinned host memory, one "
                       "host synchronisation per call: ranks may share a GPU), or auto (nccl where it can run, else "
                       "mpi). On cpu always mpi."));
    v.push_back(choice("runtime.attention", REF(runtime.attention),
                       "Attention kernel: cudnn (cuDNN's fused flash attention, forward and deterministic "
                       "backward: BF16 operands, FP32 statistics, O(T) memory; runtime.device cuda), reference "
                       "(fp8moe's own FP32 kernel, one warp per query row), or auto (cudnn on cuda where cuDNN "
                       "loads and has plans for the shape, with a warning naming why where not; else reference)."));
    v.push_back(boolean("runtime.grouped_gemm", REF(runtime.grouped_gemm),
                        "The routed experts' GEMMs of a layer (forward, dgrad, wgrad) as one grouped kernel each "
                        "(CUTLASS's block-scaled FP8 grouped GEMM on cuda with fp8.recipe blockwise; the other "
                        "recipes and devices loop over the experts either way); false: one cuBLASLt GEMM per "
                        "expert."));
    v.push_back(integer("runtime.ranks_per_node", REF(runtime.ranks_per_node), 0, 1 << 16,
                        "The nodes the expert all-to-all's bytes are split by (in-node / across nodes, in the "
                        "communication table): 0 = as MPI places the ranks (its shared-memory split); N = world "
                        "ranks [k N, (k + 1) N) form node k (several simulated nodes on one machine)."));
    v.push_back(boolean("runtime.node_dedup", REF(runtime.node_dedup),
                        "Where the expert group spans nodes: each token's row (the experts' input; with "
                        "train.moe_gates expert, also its output's gradient) crosses to each other node once, "
                        "to the rank with the sender's index in that node, which forwards it to the ranks there "
                        "that hold the token's experts (DeepEP's internode dispatch; the experts get the same "
                        "rows either way); the rows the token's side only sums (the input's gradient; with the "
                        "gates in the experts, the output) are summed there and cross back once. false: one "
                        "row per expert chosen, straight to its rank and back."));
    v.push_back(boolean("runtime.overlap_expert_comm", REF(runtime.overlap_expert_comm),
                        "The expert all-to-all behind the MoE layer's own compute (Megatron's "
                        "--overlap-moe-expert-parallel-comm with --delay-wgrad-compute, within a micro-batch): the "
                        "forward's dispatch posted while the shared experts' forward runs, the backward's dispatch "
                        "while their backward runs, and its combine while the routed experts' weight-gradient GEMMs "
                        "run; the same results. false: every exchange in line."));
    v.push_back(real("runtime.timeout_s", REF(runtime.timeout_s), 0, B::closed, kInf, B::open,
                     "Watchdog: a rank that spends longer than this in one collective, one checkpoint I/O call "
                     "or one training step ends the job with exit 4 (requeue-able), naming the step, phase and "
                     "call; 0 = no limit."));
    return v;
  }();
  return fields;
}

#undef REF

const Field* find_field(const std::string& path) {
  for (const Field& f : schema())
    if (f.path == path) return &f;
  return nullptr;
}

// Sections are the proper prefixes of field paths: "model", "model.moe", "parallel", ...
bool is_section(const std::string& path) {
  for (const Field& f : schema())
    if (f.path.size() > path.size() && f.path.compare(0, path.size(), path) == 0 && f.path[path.size()] == '.')
      return true;
  return false;
}

std::string leaf(const std::string& path) {
  const size_t dot = path.rfind('.');
  return dot == std::string::npos ? path : path.substr(dot + 1);
}

std::string parent(const std::string& path) {
  const size_t dot = path.rfind('.');
  return dot == std::string::npos ? std::string() : path.substr(0, dot);
}

std::string show_value(const Field& f, const Config& c) {
  YAML::Emitter e;
  e << YAML::Flow << f.show(c);
  return e.c_str();
}

}  // namespace config_detail
}  // namespace fp8moe
