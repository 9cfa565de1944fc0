#include "io/config.h"

#include "io/read_file.h"
#include "io/text.h"
#include "parallel/grid.h"  // grid_layout_problem: the world-size rules

#include <yaml-cpp/depthguard.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <functional>
#include <limits>
#include <map>
#include <sstream>
#include <type_traits>

namespace fp8moe {
namespace {

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

// ---------------------------------------------------------------------------------------------
// Scalar parsing (strict: "12abc" is not 12, "1.5" is not an integer, "yes" is not a bool)
// ---------------------------------------------------------------------------------------------

// A plain scalar for numbers and booleans: a quoted "256" is a string in YAML, and accepting it
// would hide a mistake; strings and choices may be quoted.
const std::string& scalar_or_fail(const YAML::Node& node, const std::string& where, const std::string& key,
                                  const std::string& expected, bool allow_quoted = false) {
  if (!node.IsScalar()) fail(where, key, describe(node), expected);
  if (!allow_quoted && node.Tag() == "!") fail(where, key, "the quoted string " + describe(node), expected);
  return node.Scalar();
}

template <class T>
bool parse_number(std::string_view s, T* out) {
  if (!s.empty() && s.front() == '+') s.remove_prefix(1);
  if (s.empty()) return false;
  auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), *out);
  if (ec != std::errc() || end != s.data() + s.size()) return false;
  if constexpr (std::is_floating_point_v<T>) return std::isfinite(*out);
  return true;
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
// The schema
// ---------------------------------------------------------------------------------------------

struct Field {
  std::string path;      // "model.moe.top_k"
  std::string expected;  // "an integer in [1, 256]"
  std::string doc;
  std::function<void(Config&, const YAML::Node&, const std::string& where)> parse;
  std::function<YAML::Node(const Config&)> show;
};

// REF(model.d_model) -> accessor usable on Config& and const Config&.
#define REF(member) [](auto& c) -> auto& { return c.member; }

template <class Ref>
using FieldType = std::remove_cvref_t<decltype(std::declval<Ref>()(std::declval<Config&>()))>;

constexpr int64_t kNoMax = std::numeric_limits<int64_t>::max();

template <class Ref>
Field integer(std::string path, Ref ref, int64_t lo, int64_t hi, std::string doc) {
  using T = FieldType<Ref>;
  hi = std::min<int64_t>(hi, std::numeric_limits<T>::max());
  std::string expected = hi == std::numeric_limits<T>::max()
                             ? "an integer >= " + std::to_string(lo)
                             : "an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]";
  Field f{path, expected, std::move(doc), {}, {}};
  f.parse = [=](Config& c, const YAML::Node& n, const std::string& where) {
    const std::string& s = scalar_or_fail(n, where, path, expected);
    int64_t v = 0;
    if (!parse_number(s, &v) || v < lo || v > hi) fail(where, path, describe(n), expected);
    ref(c) = static_cast<T>(v);
  };
  f.show = [=](const Config& c) { return YAML::Node(std::to_string(ref(c))); };
  return f;
}

enum class Bound { closed, open };

template <class Ref>
Field real(std::string path, Ref ref, double lo, Bound lo_b, double hi, Bound hi_b, std::string doc) {
  std::string expected;
  const bool has_hi = std::isfinite(hi);
  if (!has_hi)
    expected = std::string("a number ") + (lo_b == Bound::open ? "> " : ">= ") + format_double(lo);
  else
    expected = std::string("a number in ") + (lo_b == Bound::open ? "(" : "[") + format_double(lo) + ", " +
               format_double(hi) + (hi_b == Bound::open ? ")" : "]");
  Field f{path, expected, std::move(doc), {}, {}};
  f.parse = [=](Config& c, const YAML::Node& n, const std::string& where) {
    const std::string& s = scalar_or_fail(n, where, path, expected);
    double v = 0;
    const bool ok = parse_number(s, &v) && (lo_b == Bound::open ? v > lo : v >= lo) &&
                    (!has_hi || (hi_b == Bound::open ? v < hi : v <= hi));
    if (!ok) fail(where, path, describe(n), expected);
    ref(c) = v;
  };
  f.show = [=](const Config& c) { return YAML::Node(format_double(ref(c))); };
  return f;
}

template <class Ref>
Field boolean(std::string path, Ref ref, std::string doc) {
  const std::string expected = "true or false";
  Field f{path, expected, std::move(doc), {}, {}};
  f.parse = [=](Config& c, const YAML::Node& n, const std::string& where) {
    const std::string& s = scalar_or_fail(n, where, path, expected);
    if (s == "true" || s == "True" || s == "TRUE") ref(c) = true;
    else if (s == "false" || s == "False" || s == "FALSE") ref(c) = false;
    else fail(where, path, describe(n), expected);
  };
  f.show = [=](const Config& c) { return YAML::Node(ref(c) ? "true" : "false"); };
  return f;
}

template <class Ref>
Field text(std::string path, Ref ref, bool may_be_empty, std::string doc) {
  const std::string expected = may_be_empty ? "a string" : "a non-empty string";
  Field f{path, expected, std::move(doc), {}, {}};
  f.parse = [=](Config& c, const YAML::Node& n, const std::string& where) {
    if (n.IsNull() && may_be_empty) {
      ref(c).clear();
      return;
    }
    const std::string& s = scalar_or_fail(n, where, path, expected, /*allow_quoted=*/true);
    if (s.empty() && !may_be_empty) fail(where, path, "''", expected);
    ref(c) = s;
  };
  f.show = [=](const Config& c) { return YAML::Node(ref(c)); };
  return f;
}

template <class E>
std::string one_of() {
  std::string s = "one of ";
  for (size_t i = 0; i < std::size(EnumNames<E>::names); ++i)
    s += (i ? ", " : "") + std::string(EnumNames<E>::names[i]);
  return s;
}

template <class Ref>
Field choice(std::string path, Ref ref, std::string doc) {
  using E = FieldType<Ref>;
  const std::string expected = one_of<E>();
  Field f{path, expected, std::move(doc), {}, {}};
  f.parse = [=](Config& c, const YAML::Node& n, const std::string& where) {
    const std::string& s = scalar_or_fail(n, where, path, expected, /*allow_quoted=*/true);
    const auto& names = EnumNames<E>::names;
    auto it = std::find(std::begin(names), std::end(names), s);
    if (it == std::end(names)) fail(where, path, describe(n), expected);
    ref(c) = static_cast<E>(it - std::begin(names));
  };
  f.show = [=](const Config& c) { return YAML::Node(std::string(to_string(ref(c)))); };
  return f;
}

// train.loss_scale: none | dynamic | a positive number (static scale).
Field loss_scale_field() {
  const std::string path = "train.loss_scale", expected = "none, dynamic, or a number > 0 (a static scale)";
  Field f{path, expected,
          "Loss scaling: none (the default with per-tensor FP8 scaling), dynamic (grow/back off on "
          "overflow), or a fixed number.",
          {}, {}};
  f.parse = [=](Config& c, const YAML::Node& n, const std::string& where) {
    const std::string& s = scalar_or_fail(n, where, path, expected);
    double v = 0;
    if (s == "none") c.train.loss_scale = {LossScaleMode::none, 1.0};
    else if (s == "dynamic") c.train.loss_scale = {LossScaleMode::dynamic, 1.0};
    else if (parse_number(s, &v) && v > 0) c.train.loss_scale = {LossScaleMode::fixed, v};
    else fail(where, path, describe(n), expected);
  };
  f.show = [](const Config& c) {
    switch (c.train.loss_scale.mode) {
      case LossScaleMode::none: return YAML::Node("none");
      case LossScaleMode::dynamic: return YAML::Node("dynamic");
      default: return YAML::Node(format_double(c.train.loss_scale.value));
    }
  };
  return f;
}

// data.path / data.valid_path: one prefix, or a blend [[weight, prefix], ...] (Megatron's
// --data-path as a YAML list); null or '' = none. One prefix is shown as a plain string.
template <class Ref>
Field data_sources_field(std::string path, Ref ref, std::string doc) {
  const std::string expected = "a data set prefix, or a list of [weight > 0, prefix] pairs";
  Field f{path, expected, std::move(doc), {}, {}};
  f.parse = [=](Config& c, const YAML::Node& n, const std::string& where) {
    std::vector<DataSource> sources;
    if (n.IsNull()) {
    } else if (n.IsScalar()) {
      if (!n.Scalar().empty()) sources.push_back({1.0, n.Scalar()});
    } else if (n.IsSequence() && n.size() > 0) {
      for (size_t i = 0; i < n.size(); ++i) {
        const YAML::Node item = n[i];
        const std::string item_path = path + "[" + std::to_string(i) + "]";
        if (!item.IsSequence() || item.size() != 2) fail(where, item_path, describe(item), "a pair [weight, prefix]");
        double w = 0;
        const std::string& ws = scalar_or_fail(item[0], where, item_path + "[0]", "a weight > 0");
        if (!parse_number(ws, &w) || !(w > 0)) fail(where, item_path + "[0]", describe(item[0]), "a weight > 0");
        const std::string& prefix = scalar_or_fail(item[1], where, item_path + "[1]", "a data set prefix", true);
        if (prefix.empty()) fail(where, item_path + "[1]", "''", "a data set prefix");
        sources.push_back({w, prefix});
      }
    } else {
      fail(where, path, describe(n), expected);
    }
    ref(c) = std::move(sources);
  };
  f.show = [=](const Config& c) {
    const std::vector<DataSource>& sources = ref(c);
    if (sources.empty()) return YAML::Node("");
    if (sources.size() == 1 && sources[0].weight == 1.0) return YAML::Node(sources[0].prefix);
    YAML::Node list(YAML::NodeType::Sequence);
    for (const DataSource& s : sources) {
      YAML::Node pair(YAML::NodeType::Sequence);
      pair.SetStyle(YAML::EmitterStyle::Flow);
      pair.push_back(format_double(s.weight));
      pair.push_back(s.prefix);
      list.push_back(pair);
    }
    return list;
  };
  return f;
}

// fp8.layers: a list drawn from attention, mlp, experts, shared_experts.
constexpr std::pair<std::string_view, bool Fp8Layers::*> kFp8LayerNames[] = {
    {"attention", &Fp8Layers::attention},
    {"mlp", &Fp8Layers::mlp},
    {"experts", &Fp8Layers::experts},
    {"shared_experts", &Fp8Layers::shared_experts},
};

Field fp8_layers_field() {
  const std::string path = "fp8.layers",
                    expected = "a list drawn from attention, mlp, experts, shared_experts (each at most once)";
  Field f{path, expected,
          "Layer classes whose linear GEMMs run in FP8 when fp8.recipe is not off; the others stay "
          "in high precision.",
          {}, {}};
  f.parse = [=](Config& c, const YAML::Node& n, const std::string& where) {
    if (!n.IsSequence()) fail(where, path, describe(n), expected);
    Fp8Layers layers{false, false, false, false};
    for (size_t i = 0; i < n.size(); ++i) {
      const YAML::Node item = n[i];
      const std::string item_path = path + "[" + std::to_string(i) + "]";
      auto* it = std::find_if(std::begin(kFp8LayerNames), std::end(kFp8LayerNames), [&](const auto& e) {
        return item.IsScalar() && e.first == item.Scalar();
      });
      if (it == std::end(kFp8LayerNames)) fail(where, item_path, describe(item), expected);
      if (layers.*(it->second)) fail(where, item_path, describe(item) + " a second time", expected);
      layers.*(it->second) = true;
    }
    c.fp8.layers = layers;
  };
  f.show = [](const Config& c) {
    YAML::Node list(YAML::NodeType::Sequence);
    for (const auto& [name, member] : kFp8LayerNames)
      if (c.fp8.layers.*member) list.push_back(std::string(name));
    return list;
  };
  return f;
}

constexpr double kInf = std::numeric_limits<double>::infinity();

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
    v.push_back(integer("parallel.expert", REF(parallel.expert), 1, 1 << 16,
                        "Expert-parallel size; divides the data-parallel size (world / (tensor x pipeline))."));
    v.push_back(integer("parallel.micro_batches", REF(parallel.micro_batches), 1, 1 << 16,
                        "Micro-batches per step on each data-parallel rank (gradient accumulation, 1F1B)."));
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
                       "Recompute in backward instead of saving: nothing, the MoE blocks, or every block."));
    // optim
    v.push_back(integer("optim.zero", REF(optim.zero), 0, 1,
                        "1: shard the Adam moments over the data-parallel replicas (ZeRO-1: reduce-scatter "
                        "gradients, update the shard, all-gather weights); 0: every replica keeps full copies."));
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
    // log
    v.push_back(integer("log.every", REF(log.every), 1, kNoMax, "Print metrics every this many steps."));
    v.push_back(text("log.jsonl", REF(log.jsonl), true, "Path of the JSONL metrics file; empty = none."));
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

// Every key and section path, the candidates of a suggestion.
std::vector<std::string> all_paths() {
  std::vector<std::string> out;
  for (const Field& f : schema()) {
    for (std::string p = f.path; !p.empty(); p = parent(p))
      if (std::find(out.begin(), out.end(), p) == out.end()) out.push_back(p);
  }
  return out;
}

std::string suggestion(const std::string& unknown) {
  // 1) The same key name under another section ("model.top_k" -> "model.moe.top_k").
  for (const std::string& p : all_paths())
    if (leaf(p) == leaf(unknown) && p != unknown) return p;
  // 2) The closest path by edit distance, if it is close enough to be a typo.
  std::string best;
  size_t best_d = std::numeric_limits<size_t>::max();
  for (const std::string& p : all_paths()) {
    const size_t d = edit_distance(unknown, p);
    if (d < best_d) best_d = d, best = p;
  }
  const size_t limit = std::max<size_t>(2, leaf(unknown).size() / 3);
  return best_d <= limit ? best : std::string();
}

[[noreturn]] void fail_unknown(const std::string& where, const std::string& path) {
  std::string msg = where + ": " + path + ": unknown key";
  const std::string hint = suggestion(path);
  if (!hint.empty()) {
    msg += "; did you mean " + hint + "?";
  } else {
    // The keys of the nearest section that exists: "model.foo.bar" lists model's keys (saying there
    // is no section model.foo), "a.b" the top-level sections.
    std::string sec = parent(path), missing;
    auto children = [&](const std::string& s) {
      std::vector<std::string> out;
      for (const std::string& p : all_paths()) {
        if (!s.empty() && p.rfind(s + ".", 0) != 0) continue;
        const std::string rest = s.empty() ? p : p.substr(s.size() + 1);
        const std::string child = rest.substr(0, rest.find('.'));
        if (std::find(out.begin(), out.end(), child) == out.end()) out.push_back(child);
      }
      return out;
    };
    while (!sec.empty() && children(sec).empty()) missing = sec, sec = parent(sec);
    std::string keys;
    for (const std::string& c : children(sec)) keys += (keys.empty() ? "" : ", ") + c;
    if (!missing.empty())
      msg += "; there is no section " + missing + (sec.empty() ? "; the sections are: " : "; " + sec + " has: ") + keys;
    else
      msg += "; expected one of: " + keys;
  }
  throw ConfigError(msg);
}

// ---------------------------------------------------------------------------------------------
// Loading
// ---------------------------------------------------------------------------------------------

struct Loader {
  const ConfigSource& src;
  std::map<std::string, std::string> set_arg;  // key path -> the --set argument that set it
  std::map<std::string, std::string> where;    // key path -> where its value came from

  // Where a rule about `path` should point: the value's location, its --set argument, or the file.
  std::string where_of(const std::string& path) const {
    auto it = where.find(path);
    return it != where.end() ? it->second : src.file + " (default value)";
  }

  void apply_override(YAML::Node& root, const std::string& arg) {
    const size_t eq = arg.find('=');
    const std::string where_arg = "--set " + arg;
    if (eq == std::string::npos || eq == 0)
      throw ConfigError(where_arg + ": expected key.path=value (for example --set train.lr=1e-4)");
    const std::string path = arg.substr(0, eq), value = arg.substr(eq + 1);
    if (!find_field(path)) {
      if (is_section(path))
        throw ConfigError(where_arg + ": " + path + ": is a section; set one of its keys (" + path + ".KEY=value)");
      fail_unknown(where_arg, path);
    }
    YAML::Node parsed;
    try {
      parsed = YAML::Load(value);
    } catch (const YAML::Exception& e) {
      fail(where_arg, path, "'" + value + "'", "a YAML value (" + e.msg + ")");
    }
    // Walk down, creating sections; a section that exists must be a mapping.
    std::vector<std::string> parts;
    std::stringstream ss(path);
    for (std::string p; std::getline(ss, p, '.');) parts.push_back(p);
    std::vector<YAML::Node> chain{root};
    std::string prefix;
    for (size_t i = 0; i + 1 < parts.size(); ++i) {
      prefix += (i ? "." : "") + parts[i];
      YAML::Node next = chain.back()[parts[i]];
      if (next.IsDefined() && !next.IsNull() && !next.IsMap())
        fail(location(src.file, next.Mark()), prefix, describe(next), "a mapping of keys");
      chain.push_back(next);
    }
    chain.back()[parts.back()] = parsed;
    set_arg[path] = where_arg;
  }

  void walk(const YAML::Node& node, const std::string& prefix, const std::string& node_where, Config& cfg) {
    if (node.IsNull()) return;  // "model:" with nothing under it: all defaults
    if (!node.IsMap())
      fail(node_where, prefix.empty() ? "(top level)" : prefix, describe(node), "a mapping of keys");
    std::map<std::string, std::string> seen;  // key -> location, to reject duplicates
    for (const auto& kv : node) {
      const std::string key_where = location(src.file, kv.first.Mark());
      if (!kv.first.IsScalar()) fail(key_where, prefix.empty() ? "(top level)" : prefix, "a non-text key", "key names");
      const std::string key = kv.first.Scalar();
      const std::string path = prefix.empty() ? key : prefix + "." + key;
      if (key.find('.') != std::string::npos)
        throw ConfigError(key_where + ": " + path + ": a key may not contain '.'; nest it under its section instead");
      if (auto [it, fresh] = seen.emplace(key, key_where); !fresh)
        throw ConfigError(key_where + ": " + path + ": duplicate key (first given at " + it->second + ")");
      auto arg = set_arg.find(path);
      const std::string value_where =
          arg != set_arg.end() ? arg->second : location(src.file, kv.second.Mark());
      if (const Field* f = find_field(path)) {
        f->parse(cfg, kv.second, value_where);
        where[path] = value_where;
      } else if (is_section(path)) {
        walk(kv.second, path, value_where, cfg);
      } else {
        fail_unknown(key_where, path);
      }
    }
  }
};

std::string show_value(const Field& f, const Config& c) {
  YAML::Emitter e;
  e << YAML::Flow << f.show(c);
  return e.c_str();
}

}  // namespace

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

namespace {

// Rules between keys, and those that need the number of ranks (world_size > 0).
void check_rules(const Config& c, const Loader& L, int world_size) {
  auto rule = [&](bool ok, const std::string& key, const std::string& expected) {
    if (!ok) {
      std::string got = show_value(*find_field(key), c);
      if (L.where.find(key) == L.where.end()) got += " (the default)";
      fail(L.where_of(key), key, got, expected);
    }
  };
  auto n = [](auto v) { return std::to_string(v); };
  const ModelConfig& m = c.model;
  const ParallelConfig& p = c.parallel;

  if (!m.mla()) {
    rule(m.n_kv_heads <= m.n_heads && m.n_heads % m.n_kv_heads == 0, "model.n_kv_heads",
         "a divisor of model.n_heads = " + n(m.n_heads) + " (grouped-query attention)");
    rule(m.head_dim % 2 == 0, "model.head_dim", "an even number (RoPE rotates pairs of channels)");
  } else {
    rule(m.qk_rope_head_dim % 2 == 0, "model.qk_rope_head_dim", "an even number (RoPE rotates pairs of channels)");
  }
  rule(m.first_dense_layers <= m.n_layers, "model.first_dense_layers",
       "at most model.n_layers = " + n(m.n_layers));
  rule(m.mtp_depth < c.train.seq_len, "model.mtp_depth",
       "fewer than train.seq_len = " + n(c.train.seq_len) + " (module k predicts the token k + 1 ahead in a sequence)");
  rule(m.pad_id < m.vocab_size, "model.pad_id", "-1 or a token id below model.vocab_size = " + n(m.vocab_size));
  rule(m.moe.top_k <= m.moe.n_experts, "model.moe.top_k", "at most model.moe.n_experts = " + n(m.moe.n_experts));
  rule(m.moe.n_experts % m.moe.n_group == 0, "model.moe.n_group",
       "a divisor of model.moe.n_experts = " + n(m.moe.n_experts) + " (groups of equal size)");
  rule(m.moe.n_group == 1 || m.moe.n_experts / m.moe.n_group >= 2, "model.moe.n_group",
       "at most model.moe.n_experts / 2 = " + n(m.moe.n_experts / 2) +
           " (a group is ranked by its two best experts)");
  rule(m.moe.topk_group <= m.moe.n_group, "model.moe.topk_group", "at most model.moe.n_group = " + n(m.moe.n_group));
  rule(m.moe.top_k <= int64_t(m.moe.topk_group) * (m.moe.n_experts / m.moe.n_group), "model.moe.top_k",
       "at most model.moe.topk_group x experts per group = " + n(m.moe.topk_group) + " x " +
           n(m.moe.n_experts / m.moe.n_group) + " (the experts a token may reach)");
  rule(c.checkpoint.save || c.train.exit_interval == 0, "train.exit_interval",
       "0 with checkpoint.save false (exiting at an interval is for resuming from its checkpoint)");
  rule(c.train.min_lr <= c.train.lr, "train.min_lr", "at most train.lr = " + format_double(c.train.lr));
  rule(c.train.warmup_steps < c.train.steps, "train.warmup_steps",
       "fewer than train.steps = " + n(c.train.steps) + " (the schedule must reach its decay)");
  // NOTE: a BF16 moment holds 8 significant bits: multiplying by beta2 changes it only when
  // 1 - beta2 is at least half a BF16 step (2^-9 relative); 0.999 would freeze v.
  rule(c.train.moments_dtype != MomentsDtype::bf16 || c.train.beta2 <= 0.996, "train.beta2",
       "at most 0.996 with train.moments_dtype bf16 (a BF16 second moment cannot decay by a smaller factor)");
  rule(!(c.fp8.recipe == Fp8Recipe::blockwise && c.fp8.format == Fp8Format::hybrid), "fp8.format",
       "e4m3 with fp8.recipe blockwise (DeepSeek-V3 block scaling is E4M3 only)");

  // Tensor parallelism splits heads, the vocabulary (embedding and head) and MLP/expert widths.
  const std::string tp = " (parallel.tensor = " + n(p.tensor) + ")";
  rule(m.n_heads % p.tensor == 0, "parallel.tensor",
       "a divisor of model.n_heads = " + n(m.n_heads) + " (heads are split over tensor-parallel ranks)");
  rule(m.mla() || m.n_kv_heads % p.tensor == 0, "parallel.tensor",
       "a divisor of model.n_kv_heads = " + n(m.n_kv_heads) + " (kv heads are split over tensor-parallel ranks)");
  rule(m.vocab_size % p.tensor == 0, "parallel.tensor",
       "a divisor of model.vocab_size = " + n(m.vocab_size) + " (vocabulary-parallel embedding and head)");
  rule(m.d_ff_dense % p.tensor == 0, "parallel.tensor",
       "a divisor of model.d_ff_dense = " + n(m.d_ff_dense) + " (dense MLP columns are split)");
  rule(m.moe.d_expert % p.tensor == 0, "parallel.tensor",
       "a divisor of model.moe.d_expert = " + n(m.moe.d_expert) + " (expert columns are split)");
  rule(m.moe.n_experts % p.expert == 0, "parallel.expert",
       "a divisor of model.moe.n_experts = " + n(m.moe.n_experts) + " (each expert rank owns whole experts)");
  rule(p.pipeline <= m.n_layers, "parallel.pipeline",
       "at most model.n_layers = " + n(m.n_layers) + " (every stage needs a layer)");
  rule(c.train.recompute == Recompute::none || c.fp8.recipe != Fp8Recipe::delayed || p.pipeline == 1,
       "train.recompute",
       "none with fp8.recipe delayed and parallel.pipeline > 1 (1F1B runs later micro-batches' forwards before a "
       "block is recomputed, so the delayed scale its forward used is gone)");
  if (const RuntimeProblem r = runtime_problem(c); !r.key.empty()) rule(false, r.key, r.expected);

  // Blockwise FP8: a weight block or activation tile may not straddle a tensor-parallel shard.
  if (c.fp8.recipe == Fp8Recipe::blockwise && p.tensor > 1) {
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
      const int64_t shard = width / p.tensor;
      rule(shard % c.fp8.tile == 0, "fp8.tile",
           "a divisor of every tensor-parallel shard width, but " + std::string(name) + " / parallel.tensor = " +
               n(width) + " / " + n(p.tensor) + " = " + n(shard) + " (blocks may not straddle shards)");
    }
  }

  if (world_size <= 0) return;
  if (const auto problem = grid_layout_problem(world_size, p.tensor, p.pipeline, p.expert))  // parallel/grid.h
    rule(false, problem->key, problem->expected);
  const int data = world_size / (p.tensor * p.pipeline);
  rule(c.train.global_batch % (int64_t(data) * p.micro_batches) == 0, "train.global_batch",
       "a multiple of data-parallel size x parallel.micro_batches = " + n(data) + " x " + n(p.micro_batches) +
           " = " + n(int64_t(data) * p.micro_batches));
}

}  // namespace

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diag = up;
    }
  }
  return row[b.size()];
}

std::string read_config_file(const std::string& path) {
  return read_whole_file<ConfigError>(path, "config file", uintmax_t(16) << 20);  // no config is 16 MiB
}

Config load_config(const ConfigSource& source, int world_size) {
  Loader L{source, {}, {}};
  YAML::Node root;
  try {
    const std::vector<YAML::Node> docs = YAML::LoadAll(source.text);
    if (docs.size() > 1)
      throw ConfigError(location(source.file, docs[1].Mark()) + ": a config file holds one YAML document; found " +
                        std::to_string(docs.size()));
    if (!docs.empty()) root = docs[0];
  } catch (const YAML::DeepRecursion& e) {
    throw ConfigError(location(source.file, e.mark) +
                      ": YAML nested too deeply (past the parser's recursion limit; a config nests three levels)");
  } catch (const YAML::ParserException& e) {
    throw ConfigError(location(source.file, e.mark) + ": YAML syntax error: " + shown(e.msg, 200));
  }
  if (!root.IsNull() && !root.IsMap()) fail(location(source.file, root.Mark()), "(top level)", describe(root), "a mapping of keys");
  if (root.IsNull()) root = YAML::Node(YAML::NodeType::Map);
  for (const std::string& arg : source.overrides) L.apply_override(root, arg);

  Config cfg;
  L.walk(root, "", source.file, cfg);
  check_rules(cfg, L, world_size);
  return cfg;
}

std::string config_to_yaml(const Config& config) {
  YAML::Emitter out;
  out << YAML::BeginMap;
  std::vector<std::string> open;  // the sections we are inside, outermost first
  for (const Field& f : schema()) {
    std::vector<std::string> want;
    for (std::string p = parent(f.path); !p.empty(); p = parent(p)) want.insert(want.begin(), leaf(p));
    size_t common = 0;
    while (common < open.size() && common < want.size() && open[common] == want[common]) ++common;
    for (size_t i = open.size(); i > common; --i) out << YAML::EndMap;
    open.resize(common);
    for (size_t i = common; i < want.size(); ++i) {
      out << YAML::Key << want[i] << YAML::Value << YAML::BeginMap;
      open.push_back(want[i]);
    }
    out << YAML::Key << leaf(f.path) << YAML::Value << YAML::Flow << f.show(config);
  }
  for (size_t i = 0; i < open.size(); ++i) out << YAML::EndMap;
  out << YAML::EndMap;
  return std::string(out.c_str()) + "\n";
}

std::string config_reference() {
  const Config defaults;
  std::string out =
      "# fp8moe configuration reference: every key with its default value, what it accepts and what\n"
      "# it means. Generated by `fp8moe defaults`; a config file only needs the keys it changes.\n";
  std::string section;
  for (const Field& f : schema()) {
    const std::string sec = parent(f.path);
    if (sec != section) {
      // Open each section level that differs from the previous field's.
      std::string common;
      for (std::string p = sec; !p.empty(); p = parent(p))
        if (section == p || section.rfind(p + ".", 0) == 0) { common = p; break; }
      std::vector<std::string> opens;
      for (std::string p = sec; p != common; p = parent(p)) opens.insert(opens.begin(), p);
      for (const std::string& p : opens) {
        const size_t depth = std::count(p.begin(), p.end(), '.');
        out += (depth == 0 ? "\n" : "") + std::string(2 * depth, ' ') + leaf(p) + ":\n";
      }
      section = sec;
    }
    const size_t depth = std::count(f.path.begin(), f.path.end(), '.');
    std::string line = std::string(2 * depth, ' ') + leaf(f.path) + ": " + show_value(f, defaults);
    if (line.size() < 40) line.resize(40, ' ');
    out += line + "  # " + f.expected + ". " + f.doc + "\n";
  }
  return out;
}

}  // namespace fp8moe
