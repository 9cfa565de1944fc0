// What the three parts of io/config.h share (internal to fp8moe_io): the schema, the typed key
// table (io/config_schema.cpp); the loader, YAML and --set overrides into a Config with its
// unknown-key errors (io/config_load.cpp); the rules between keys (io/config_rules.cpp).
#pragma once

#include <yaml-cpp/yaml.h>

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "io/config.h"

namespace fp8moe::config_detail {

// ---- messages (io/config_schema.cpp) ---------------------------------------------------------

// Throws the one ConfigError: "WHERE: KEY: got GOT, expected EXPECTED".
[[noreturn]] void fail(const std::string& where, const std::string& key, const std::string& got,
                       const std::string& expected);
// "file:line:col" of a node, or the file where the node has no mark.
std::string location(const std::string& file, const YAML::Mark& mark);
// How a node is shown after "got".
std::string describe(const YAML::Node& node);
// Shortest text that reads back to the same double, always with a '.' or an exponent.
std::string format_double(double v);

// ---- the schema (io/config_schema.cpp) -------------------------------------------------------

struct Field {
  std::string path;      // "model.moe.top_k"
  std::string expected;  // "an integer in [1, 256]"
  std::string doc;
  std::function<void(Config&, const YAML::Node&, const std::string& where)> parse;
  std::function<YAML::Node(const Config&)> show;
};

// Every key, in the order of the effective config and the reference.
const std::vector<Field>& schema();
const Field* find_field(const std::string& path);  // nullptr when no key has this path
// Sections are the proper prefixes of field paths: "model", "model.moe", "parallel", ...
bool is_section(const std::string& path);
std::string leaf(const std::string& path);    // "model.moe.top_k" -> "top_k"
std::string parent(const std::string& path);  // "model.moe.top_k" -> "model.moe"; "model" -> ""
// A field's value in `c` as one line of flow YAML.
std::string show_value(const Field& f, const Config& c);

// ---- loading (io/config_load.cpp) ------------------------------------------------------------

struct Loader {
  const ConfigSource& src;
  std::map<std::string, std::string> set_arg;  // key path -> the --set argument that set it
  std::map<std::string, std::string> where;    // key path -> where its value came from

  // Where a rule about `path` should point: the value's location, its --set argument, or the file.
  std::string where_of(const std::string& path) const {
    auto it = where.find(path);
    return it != where.end() ? it->second : src.file + " (default value)";
  }
  // One --set KEY=VALUE into the document, creating its sections.
  void apply_override(YAML::Node& root, const std::string& arg);
  // Parses the mapping `node` (the section `prefix`) into cfg, recording where each value came from.
  void walk(const YAML::Node& node, const std::string& prefix, const std::string& node_where, Config& cfg);
};

// ---- the rules between keys (io/config_rules.cpp) --------------------------------------------

// Rules between keys, and those that need the number of ranks (world_size > 0). Throws ConfigError
// naming the first broken rule's key and where its value came from.
void check_rules(const Config& c, const Loader& L, int world_size);

}  // namespace fp8moe::config_detail
