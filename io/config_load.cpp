// The loader: a YAML document and --set overrides into a Config, key by key through the schema
// (io/config_schema.cpp), with the errors of unknown keys ("did you mean ...?") and of the
// document's structure, then the rules between keys (io/config_rules.cpp); and a Config back to
// text: the effective config and the reference of every key.
#include "io/config.h"

#include "io/config_internal.h"
#include "io/read_file.h"
#include "io/text.h"

#include <yaml-cpp/depthguard.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <limits>
#include <map>
#include <sstream>

namespace fp8moe {
namespace config_detail {
namespace {

// ---------------------------------------------------------------------------------------------
// Unknown keys: the key meant, or the keys there are
// ---------------------------------------------------------------------------------------------

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

}  // namespace

// ---------------------------------------------------------------------------------------------
// Loading
// ---------------------------------------------------------------------------------------------

void Loader::apply_override(YAML::Node& root, const std::string& arg) {
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

void Loader::walk(const YAML::Node& node, const std::string& prefix, const std::string& node_where, Config& cfg) {
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

}  // namespace config_detail

using namespace config_detail;

// ---------------------------------------------------------------------------------------------
// io/config.h
// ---------------------------------------------------------------------------------------------

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
        if (depth == 0) out += "\n";  // a blank line before each top-level section
        out += std::string(2 * depth, ' ') + leaf(p) + ":\n";
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
