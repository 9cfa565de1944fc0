// The typed configuration of a run. io/config fills it from YAML (and documents every key with its
// default); the rest of the program reads only these structs. Defaults below are the defaults of
// the YAML keys of the same name (`fp8moe defaults` prints them all).
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <cstddef>
#include <string_view>
#include <vector>

namespace fp8moe {

enum class Gating { softmax, sigmoid };
enum class AttentionKind { gqa, mla };  // model.attention
enum class NormTopk { automatic, yes, no };  // auto: with sigmoid gating (DeepSeek-V3), not softmax (V2)
enum class Schedule { cosine, linear, constant };
enum class MomentsDtype { fp32, bf16 };
enum class Recompute { none, selective, moe, full };
// Whether train.recompute runs a block's forward again before its backward (the one rule the
// model, the planner and the communication formulas share): every block under full, the MoE
// blocks (the MTP modules' included) under moe; selective and none keep every block.
inline bool recomputes_block(Recompute r, bool moe_block) {
  return r == Recompute::full || (r == Recompute::moe && moe_block);
}
// The same for block `layer` of a model whose first `first_dense` blocks are dense (the multi-token
// prediction modules' blocks numbered on from n_layers, MoE): train.recompute's rule, or
// train.recompute_layers names it.
inline bool recomputes_layer(Recompute r, const std::vector<int>& layers, int first_dense, int layer) {
  return recomputes_block(r, layer >= first_dense) || std::find(layers.begin(), layers.end(), layer) != layers.end();
}
enum class ActivationDtype { fp32, bf16 };  // train.activations
enum class GemmDtype { fp32, bf16 };        // train.hp_gemm
enum class GateSite { combine, expert };    // train.moe_gates
enum class ReduceDtype { fp32, bf16 };      // optim.grad_reduce
enum class StageSplit { even, balanced, given };  // parallel.stage_layers
enum class PipelineSchedule { one_f_one_b, dualpipev, zb1p };  // parallel.pipeline_schedule
enum class Fp8Recipe { off, delayed, current, blockwise };
enum class Fp8Format { e4m3, hybrid };  // hybrid: E4M3 forward, E5M2 gradients
enum class AmaxCompute { max, most_recent };
enum class LossScaleMode { none, dynamic, fixed };
enum class DeviceChoice { automatic, cpu, cuda, emulated };  // runtime.device
enum class AsyncChoice { automatic, on, off };                // checkpoint.async
enum class CommChoice { automatic, mpi, nccl };      // runtime.comm
enum class AttentionChoice { automatic, cudnn, reference };  // runtime.attention

struct MoeConfig {
  int n_experts = 8;
  int top_k = 2;
  int n_shared_experts = 1;
  int d_expert = 256;  // width of each routed (and each shared) expert's SwiGLU
  Gating gating = Gating::sigmoid;
  double aux_loss_coef = 0.0;        // switch-style balance loss; 0 = off
  double bias_update_rate = 0.001;   // aux-loss-free balancing step (DeepSeek-V3 gamma); 0 = off
  double capacity_factor = 0.0;      // 0 = no token dropping
  // Node-limited routing (DeepSeek-V3): the experts form n_group groups of n_experts / n_group
  // consecutive experts; a token keeps the topk_group groups with the largest sum of their two
  // best selection keys (score + bias), then takes its top_k experts inside them. 1 / 1: no limit.
  int n_group = 1;
  int topk_group = 1;
  double routed_scaling_factor = 1.0;  // multiplies the routed experts' gates (DeepSeek-V3: 2.5)
  NormTopk norm_topk_prob = NormTopk::automatic;  // gates divided by the sum of the chosen scores
  bool normalises_gates() const {
    return norm_topk_prob == NormTopk::yes || (norm_topk_prob == NormTopk::automatic && gating == Gating::sigmoid);
  }
  bool operator==(const MoeConfig&) const = default;
};

struct ModelConfig {
  int vocab_size = 256;
  int d_model = 256;
  int n_layers = 4;
  int n_heads = 8;
  // Grouped-query attention (attention: gqa): n_kv_heads key/value heads of head_dim each.
  AttentionKind attention = AttentionKind::gqa;
  int n_kv_heads = 8;
  int head_dim = 32;
  // Multi-head latent attention (attention: mla, DeepSeek-V2/V3): queries through a rank-q_lora_rank
  // latent (0: one projection), keys and values through one shared rank-kv_lora_rank latent; each
  // query/key head is qk_nope_head_dim channels without position plus qk_rope_head_dim rotated ones
  // (the rotated key shared by all heads), each value head v_head_dim channels.
  int q_lora_rank = 0;
  int kv_lora_rank = 64;
  int qk_nope_head_dim = 32;
  int qk_rope_head_dim = 16;
  int v_head_dim = 32;
  double rope_theta = 10000.0;
  double norm_eps = 1e-6;
  int first_dense_layers = 1;
  int d_ff_dense = 1024;
  double init_std = 0.02;
  int pad_id = -1;  // targets equal to it are not counted by the loss; -1 = none
  MoeConfig moe;
  // Multi-token prediction (DeepSeek-V3: depth 1): module k (1..mtp_depth) joins the previous
  // depth's hidden state and the embedding of the token k ahead (eh_proj), runs one MoE block and
  // predicts the token k + 1 ahead through the shared head; the loss adds mtp_loss_weight x the
  // mean of the modules' cross-entropies (DeepSeek-V3: 0.3, then 0.1).
  int mtp_depth = 0;
  double mtp_loss_weight = 0.3;
  // MoE layers: the blocks after the dense ones, then the multi-token prediction modules' blocks.
  int moe_layers() const { return n_layers - first_dense_layers + mtp_depth; }
  bool mla() const { return attention == AttentionKind::mla; }
  // The size of a query/key head, of a value head, and of the part of a head RoPE rotates.
  int qk_head_dim() const { return mla() ? qk_nope_head_dim + qk_rope_head_dim : head_dim; }
  int v_dim() const { return mla() ? v_head_dim : head_dim; }
  int rope_dim() const { return mla() ? qk_rope_head_dim : head_dim; }
  bool operator==(const ModelConfig&) const = default;
};

// parallel.stage_layers: the blocks of each pipeline stage (model/placement.h stage_split).
struct StageLayers {
  StageSplit split = StageSplit::even;
  std::vector<int> given;  // split given: one count per stage
  bool operator==(const StageLayers&) const = default;
};

struct ParallelConfig {
  int tensor = 1;
  int pipeline = 1;
  int expert = 1;
  int micro_batches = 1;
  StageLayers stage_layers;
  // 1f1b, zb1p: stage s runs the s-th of `pipeline` contiguous parts of the blocks. dualpipev: the blocks
  // cut into 2 x pipeline chunks (stage_layers counts chunks), rank s holding chunk s and chunk
  // 2 x pipeline - 1 - s (parallel/pipeline_schedule.h).
  PipelineSchedule pipeline_schedule = PipelineSchedule::one_f_one_b;
  // The pipeline's parts of the blocks: one per stage, or two per rank under DualPipeV.
  int pipeline_chunks() const { return pipeline_schedule == PipelineSchedule::dualpipev ? 2 * pipeline : pipeline; }
  // 1f1b, zb1p: the steady state's forward and backward of two micro-batches as one op,
  // interleaved at the expert exchanges (parallel/pipeline_schedule.h one_f_one_b_paired).
  bool pair_micro_batches = false;
  // The multi-token prediction modules on the last stage (DualPipeV: the last chunk, rank 0's)
  // alone, which then holds no block and a tied copy of the head's weight; the main model's final
  // norm, head and loss on the stage (chunk) of the last block (model/placement.h).
  bool mtp_own_stage = false;
  bool operator==(const ParallelConfig&) const = default;
};

struct LossScale {
  LossScaleMode mode = LossScaleMode::none;
  double value = 1.0;  // for `fixed`
  bool operator==(const LossScale&) const = default;
};

struct TrainConfig {
  int64_t seed = 1234;
  int64_t steps = 1000;
  int64_t exit_interval = 0;  // save and exit after a step that is a multiple of it (Megatron's --exit-interval)
  int global_batch = 8;  // sequences per optimizer step, over all data-parallel ranks
  int seq_len = 256;
  double lr = 3e-4;
  double min_lr = 3e-5;
  int64_t warmup_steps = 100;
  Schedule schedule = Schedule::cosine;
  double weight_decay = 0.1;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double grad_clip = 1.0;  // 0 = off
  MomentsDtype moments_dtype = MomentsDtype::fp32;
  LossScale loss_scale;
  double loss_scale_initial = 65536.0;       // dynamic: the first scale
  int64_t loss_scale_growth_interval = 1000;  // dynamic: finite steps in a row before growing
  double loss_scale_growth = 2.0;            // dynamic: factor after growth_interval finite steps
  double loss_scale_backoff = 0.5;           // dynamic: factor after a non-finite step
  Recompute recompute = Recompute::none;
  // Blocks (0-based, < model.n_layers) recomputed in full whatever `recompute` says: each keeps its
  // input and routing and runs its forward again before its backward (Megatron's recompute method
  // block, for chosen blocks: the first stage's, which hold the most micro-batches in flight).
  std::vector<int> recompute_layers;
  // bf16 (DeepSeek-V3's precisions, so far): the residual stream rounded to BF16 between blocks,
  // the pipeline's messages in BF16, the expert all-to-all's rows in FP8 (quantized once before
  // dispatch: blockwise in 1 x tile tiles, per-tensor recipes at one scale per exchange) or BF16
  // (experts out of FP8), and combine in BF16.
  // Inside a block the ops still run and keep FP32. fp32: every activation and message FP32.
  ActivationDtype activations = ActivationDtype::fp32;
  // The GEMMs outside the linear layers (the MoE router, the head, the MTP modules' eh_proj): fp32,
  // or bf16 (DeepSeek-V3's): BF16 operands, FP32 accumulation and outputs.
  GemmDtype hp_gemm = GemmDtype::fp32;
  // Where the routed experts' gates multiply (model/moe.h): combine (the token's rank scales each
  // expert's output as it sums them), or expert (each expert scales its SwiGLU output before its
  // down-projection, Megatron-Core's weighted SwiGLU: combine is a plain sum, and the experts'
  // outputs are not kept for the gates' gradient).
  GateSite moe_gates = GateSite::combine;
  bool operator==(const TrainConfig&) const = default;
};

// The distributed optimizer.
struct OptimConfig {
  int zero = 1;  // 1: Adam moments sharded over the data-parallel replicas (ZeRO-1); 0: full copies
  // The gradients' reduction over the replicas: fp32, or bf16: each replica's gradients rounded to
  // BF16 and exchanged as such, the sum in FP32 (model/data_parallel.h).
  ReduceDtype grad_reduce = ReduceDtype::fp32;
  // The FP32 reduction in per-layer buckets posted during the step's last backward, waited before
  // the optimizer (model/data_parallel.h); false: one reduction per group after the backward.
  bool overlap_grad_reduce = true;
  bool operator==(const OptimConfig&) const = default;
};

// Which layer classes run their GEMMs in FP8 (when fp8.recipe != off).
struct Fp8Layers {
  bool attention = true;       // q, k, v, o projections
  bool mlp = true;             // dense SwiGLU MLPs
  bool experts = true;         // routed experts
  bool shared_experts = true;  // shared experts
  bool operator==(const Fp8Layers&) const = default;
};

struct Fp8Config {
  Fp8Recipe recipe = Fp8Recipe::blockwise;
  Fp8Format format = Fp8Format::e4m3;
  int amax_history_len = 1024;
  AmaxCompute amax_compute = AmaxCompute::max;
  int margin = 0;
  int tile = 128;  // blockwise: 1 x tile activation/gradient tiles, tile x tile weight blocks
  bool power_of_two_scales = true;
  bool cache_activations = false;  // blockwise: keep the 1xT FP8 inputs (wgrad re-tiles them), not T x 1 copies from FP32
  Fp8Layers layers;
  bool operator==(const Fp8Config&) const = default;
};

// One Megatron indexed data set (PREFIX.bin + PREFIX.idx) and its weight in a blend.
struct DataSource {
  double weight = 1.0;
  std::string prefix;
  bool operator==(const DataSource&) const = default;
};

struct DataConfig {
  std::vector<DataSource> path;        // training: one data set, or a weighted blend
  std::vector<DataSource> valid_path;  // validation, the same; empty = no validation loss
  bool operator==(const DataConfig&) const = default;
};

struct EvalConfig {
  int64_t every = 100;  // 0 = never
  int batches = 8;
  bool operator==(const EvalConfig&) const = default;
};

struct CheckpointConfig {
  std::string dir = "checkpoints";
  int64_t every = 0;   // 0 = only at the end of training
  int keep_last = 3;
  bool save = true;  // false: never write one (benchmarks of models whose checkpoint fills the disk)
  std::string resume = "auto";  // auto | none | path of a checkpoint
  // The host buffer a save or a load stages tensors through (pinned under CUDA), in bytes.
  int64_t staging_bytes = int64_t(64) << 20;
  // Periodic saves copy what each rank writes to host memory (pinned under CUDA) and write it on a
  // thread of their own while training goes on (io/checkpoint.h AsyncCheckpointer): true; auto
  // on cuda where every rank has a CPU to spare for that thread (its binding's share at least 2
  // CPUs), blocking on the host backends, whose compute takes every CPU; false: every save blocks
  // training until it is committed.
  AsyncChoice async = AsyncChoice::automatic;
  // The most host memory one rank's copy may take; when some rank's share is larger, saves are
  // synchronous (a warning at the start).
  int64_t async_max_bytes = int64_t(32) << 30;
  bool operator==(const CheckpointConfig&) const = default;
};

struct RuntimeConfig {
  // auto: cuda when every rank sees a GPU, else cpu; emulated: the test device without a GPU
  // (kernels/host_backend.h). NOTE: the default is cpu until the device-resident CUDA backend has
  // passed the device check on a GPU (README, CUDA backend): no config moves onto it unasked.
  DeviceChoice device = DeviceChoice::cpu;
  CommChoice comm = CommChoice::automatic;        // auto: nccl on cuda (a GPU per rank) and emulated, mpi on cpu
  // auto: cuDNN's fused attention on cuda where it has plans for the shape, else the reference kernel.
  AttentionChoice attention = AttentionChoice::automatic;
  // The routed experts' GEMMs (forward, dgrad, wgrad) as one grouped kernel each (CUTLASS,
  // block-scaled FP8 on cuda); false: one cuBLASLt GEMM per expert.
  bool grouped_gemm = true;
  // Watchdog limit (parallel/watchdog.h): longer than this in one collective, checkpoint I/O call
  // or training step ends the job. Generous: a step of a large model, a save on a slow file system.
  double timeout_s = 600;
  // Ranks per node for the expert all-to-all's in-node / across-node accounting: 0 = the nodes MPI
  // reports (its shared-memory split); N: world ranks [k N, (k + 1) N) are node k (tests simulate
  // several nodes on one machine).
  int ranks_per_node = 0;
  // Where the expert group spans nodes: each token's row crosses to each other node once and is
  // forwarded in that node, and the rows its side only sums are summed there and cross back once
  // (DeepEP's internode dispatch and combine; parallel/expert_dispatch.h); false: one row per
  // expert chosen, straight to its rank and back.
  bool node_dedup = true;
  // The expert all-to-all behind the MoE layer's own compute (model/moe.cpp): the forward's
  // dispatch behind the shared experts' forward, the backward's dispatch behind their backward,
  // its combine behind the routed experts' weight gradients (the backward split into its input and
  // weight parts); false: every exchange in line. The same bits either way.
  bool overlap_expert_comm = true;
  bool operator==(const RuntimeConfig&) const = default;
};

struct LogConfig {
  int64_t every = 1;
  std::string jsonl;  // metrics file; empty = none
  // The step timeline (parallel/trace.h): a directory, one Chrome-trace JSON per rank
  // (rank<r>.json) of steps trace_start .. trace_start + trace_steps - 1; empty = none.
  std::string trace;
  int64_t trace_start = 2;
  int64_t trace_steps = 1;
  bool operator==(const LogConfig&) const = default;
};

struct Config {
  ModelConfig model;
  ParallelConfig parallel;
  TrainConfig train;
  OptimConfig optim;
  Fp8Config fp8;
  DataConfig data;
  EvalConfig eval;
  CheckpointConfig checkpoint;
  LogConfig log;
  RuntimeConfig runtime;
  bool operator==(const Config&) const = default;
};

// Names of enum values as they are written in YAML, indexed by the enum's value.
template <class E>
struct EnumNames;
#define FP8MOE_ENUM_NAMES(E, ...)                                  \
  template <>                                                      \
  struct EnumNames<E> {                                            \
    static constexpr std::string_view names[] = {__VA_ARGS__};     \
  }
FP8MOE_ENUM_NAMES(Gating, "softmax", "sigmoid");
FP8MOE_ENUM_NAMES(AttentionKind, "gqa", "mla");
FP8MOE_ENUM_NAMES(NormTopk, "auto", "true", "false");
FP8MOE_ENUM_NAMES(Schedule, "cosine", "linear", "constant");
FP8MOE_ENUM_NAMES(PipelineSchedule, "1f1b", "dualpipev", "zb1p");
FP8MOE_ENUM_NAMES(MomentsDtype, "fp32", "bf16");
FP8MOE_ENUM_NAMES(Recompute, "none", "selective", "moe", "full");
FP8MOE_ENUM_NAMES(GemmDtype, "fp32", "bf16");
FP8MOE_ENUM_NAMES(GateSite, "combine", "expert");
FP8MOE_ENUM_NAMES(ReduceDtype, "fp32", "bf16");
FP8MOE_ENUM_NAMES(ActivationDtype, "fp32", "bf16");
FP8MOE_ENUM_NAMES(Fp8Recipe, "off", "delayed", "current", "blockwise");
FP8MOE_ENUM_NAMES(Fp8Format, "e4m3", "hybrid");
FP8MOE_ENUM_NAMES(AmaxCompute, "max", "most_recent");
FP8MOE_ENUM_NAMES(DeviceChoice, "auto", "cpu", "cuda", "emulated");
FP8MOE_ENUM_NAMES(AsyncChoice, "auto", "true", "false");
FP8MOE_ENUM_NAMES(AttentionChoice, "auto", "cudnn", "reference");
FP8MOE_ENUM_NAMES(CommChoice, "auto", "mpi", "nccl");
#undef FP8MOE_ENUM_NAMES

template <class E>
constexpr std::string_view to_string(E v) {
  return EnumNames<E>::names[static_cast<size_t>(v)];
}

}  // namespace fp8moe
