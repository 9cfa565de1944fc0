// `fp8moe train CONFIG [--set key=value ...] [--dry-run]`
#pragma once

#include <string>
#include <vector>

namespace fp8moe {

struct TrainOptions {
  std::string config_path;
  std::vector<std::string> overrides;  // "key.path=value"
  bool dry_run = false;
};

// Starts MPI, validates the config on every rank (rank 0 reports), builds the process grid and
// prints the effective config and the layout. Returns the process exit status.
int run_train(const TrainOptions& options, int* argc, char*** argv);

}  // namespace fp8moe
