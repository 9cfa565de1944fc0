// A plain weights file that the trainer writes at the end of training, for `fp8moe generate`,
// until the HDF5 checkpoints (with optimizer state, resume and resharding) replace it:
//   char[8] "FP8MOEW1" | u64 n | config YAML (n bytes) | u64 params
//   | per parameter: u32 n | name (n bytes) | u64 numel | f32 values[numel]      (little-endian)
#pragma once

#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "model/param_table.h"

namespace fp8moe {

struct WeightsError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Written to PATH.tmp, then renamed over PATH.
void save_weights(const std::string& path, const std::string& config_yaml, const ParamTable& table,
                  const std::vector<std::vector<float>>& params);

struct Weights {
  std::string config_yaml;
  std::vector<std::pair<std::string, std::vector<float>>> params;
};
// WeightsError naming the file on a missing, truncated or foreign file.
Weights load_weights(const std::string& path);

}  // namespace fp8moe
