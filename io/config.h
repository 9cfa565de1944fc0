// YAML -> validated Config.
//
// Every key is declared once (io/config_schema.cpp, the schema): its path, type, range, default
// and meaning. From that one table come parsing, `--set` overrides, "did you mean" suggestions
// (io/config_load.cpp), the effective config printed at start (and stored in checkpoints) and
// `fp8moe defaults`. The rules between keys are io/config_rules.cpp.
//
// Any problem is ONE ConfigError whose message names where (file:line:col, the --set argument, or
// the file for a default value), the key path, the value, and what was expected.
#pragma once

#include <stdexcept>
#include <string>
#include <vector>

#include "model/config.h"

namespace fp8moe {

struct ConfigError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct ConfigSource {
  std::string file;                    // name used in messages (the path as the user gave it)
  std::string text;                    // the YAML document
  std::vector<std::string> overrides;  // "key.path=value" from --set, applied in order
};

// Reads a whole file; ConfigError when it is missing, not a regular file, or unreadable.
std::string read_config_file(const std::string& path);

// Parses, applies overrides and checks every rule. With world_size > 0 the rules that depend on
// the number of ranks are checked too. Throws ConfigError.
Config load_config(const ConfigSource& source, int world_size);

// The effective config as YAML: every key, in schema order. load_config of it gives `config` back.
std::string config_to_yaml(const Config& config);

// Every key with its default, what it accepts and what it means, as commented YAML.
std::string config_reference();

// The runtime rules that depend on runtime.device and runtime.comm: checked by load_config for
// the values a config gives, and by `fp8moe train` again once `auto` has been resolved. Empty when
// none is broken, else {key, what is expected}.
struct RuntimeProblem {
  std::string key, expected;
};
RuntimeProblem runtime_problem(const Config& config);

// Levenshtein distance (exposed for tests of the "did you mean" suggestions).
size_t edit_distance(const std::string& a, const std::string& b);

}  // namespace fp8moe
