// The kinds of config fields (io/config_schema.cpp's table is made of them): strict scalar
// parsing, the plain kinds (integer, real, boolean, text, choice of an enum) and the composite
// values (parallel.stage_layers, train.loss_scale, data sources, fp8.layers), each with how it is
// parsed and shown. Internal to io/: included by io/config_schema.cpp only.
#pragma once

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <type_traits>

#include "io/config_internal.h"
#include "io/text.h"

namespace fp8moe {
namespace config_detail {

// ---------------------------------------------------------------------------------------------
// Scalar parsing (strict: "12abc" is not 12, "1.5" is not an integer, "yes" is not a bool)
// ---------------------------------------------------------------------------------------------
// A plain scalar for numbers and booleans: a quoted "256" is a string in YAML, and accepting it
// would hide a mistake; strings and choices may be quoted.
inline const std::string& scalar_or_fail(const YAML::Node& node, const std::string& where, const std::string& key,
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

// ---------------------------------------------------------------------------------------------
// The kinds of fields: each takes the key's path, an accessor of its member of Config (the
// schema's REF) and its documentation
// ---------------------------------------------------------------------------------------------

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

// parallel.stage_layers: even | balanced | [blocks of stage 0, blocks of stage 1, ...].
inline Field stage_layers_field() {
  const std::string path = "parallel.stage_layers",
                    expected = "even, balanced, or a list of blocks per stage [n0, n1, ...], each >= 1 (the last >= 0)";
  Field f{path, expected,
          "The blocks of each pipeline stage: even (earlier stages take the extra blocks), balanced (by "
          "work: each block's GEMM and attention FLOPs, the last stage's head and multi-token prediction "
          "modules counted; the split whose slowest stage is fastest), or the counts, one per stage "
          "(Megatron's first/last-stage layer counts, in full; the last may be 0: a stage of the head and "
          "the multi-token prediction modules only).",
          {}, {}};
  f.parse = [=](Config& c, const YAML::Node& n, const std::string& where) {
    StageLayers& s = c.parallel.stage_layers;
    if (n.IsSequence()) {
      if (n.size() == 0) fail(where, path, describe(n), expected);
      s.split = StageSplit::given, s.given.clear();
      for (size_t i = 0; i < n.size(); ++i) {
        int64_t v = 0;
        const std::string item = path + "[" + std::to_string(i) + "]";
        const bool last = i + 1 == n.size();  // the head and the modules only: no block
        if (!n[i].IsScalar() || !parse_number(n[i].Scalar(), &v) || v < (last ? 0 : 1) || v > (1 << 20))
          fail(where, item, describe(n[i]), last ? "an integer >= 0" : "an integer >= 1");
        s.given.push_back(int(v));
      }
      return;
    }
    const std::string& v = scalar_or_fail(n, where, path, expected);
    if (v == "even") s.split = StageSplit::even, s.given.clear();
    else if (v == "balanced") s.split = StageSplit::balanced, s.given.clear();
    else fail(where, path, describe(n), expected);
  };
  f.show = [=](const Config& c) {
    const StageLayers& s = c.parallel.stage_layers;
    if (s.split != StageSplit::given) return YAML::Node(s.split == StageSplit::even ? "even" : "balanced");
    YAML::Node list(YAML::NodeType::Sequence);
    for (int v : s.given) list.push_back(v);
    return list;  // (no flow style set here: yaml-cpp then emits every later map in flow style too)
  };
  return f;
}

// train.recompute_layers: a list of block indices (each >= 0 and at most once; < model.n_layers
// is config_rules').
inline Field recompute_layers_field() {
  const std::string path = "train.recompute_layers", expected = "a list of block indices [i, j, ...], each >= 0, once";
  Field f{path, expected,
          "Blocks recomputed in full whatever train.recompute says (0-based, < model.n_layers): each keeps "
          "its input and routing and runs its forward again before its backward (Megatron's recompute "
          "method block, for chosen blocks: those of the first pipeline stage, which holds the most "
          "micro-batches in flight).",
          {}, {}};
  f.parse = [=](Config& c, const YAML::Node& n, const std::string& where) {
    if (!n.IsSequence()) fail(where, path, describe(n), expected);
    std::vector<int>& l = c.train.recompute_layers;
    l.clear();
    for (size_t i = 0; i < n.size(); ++i) {
      int64_t v = 0;
      const std::string item = path + "[" + std::to_string(i) + "]";
      if (!n[i].IsScalar() || !parse_number(n[i].Scalar(), &v) || v < 0 || v > (1 << 20))
        fail(where, item, describe(n[i]), "an integer >= 0");
      if (std::find(l.begin(), l.end(), int(v)) != l.end()) fail(where, item, describe(n[i]) + " a second time", expected);
      l.push_back(int(v));
    }
  };
  f.show = [=](const Config& c) {
    YAML::Node list(YAML::NodeType::Sequence);
    for (int v : c.train.recompute_layers) list.push_back(v);
    return list;
  };
  return f;
}

// train.loss_scale: none | dynamic | a positive number (static scale).
inline Field loss_scale_field() {
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

inline Field fp8_layers_field() {
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

}  // namespace config_detail
}  // namespace fp8moe
