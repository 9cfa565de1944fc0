// `fp8moe train CONFIG [--set key=value ...] [--dry-run]`
#pragma once

#include <string>
#include <vector>

namespace fp8moe {

struct TrainOptions {
  std::string config_path;
  std::vector<std::string> overrides;  // "key.path=value"
  bool dry_run = false;
  // With dry_run, from one process: validate and lay out the run for this many ranks, as on the
  // machine it is for (0: the ranks started).
  int world = 0;
};

// Starts MPI, validates the config on every rank (rank 0 reports), builds the process grid and
// prints the effective config and the layout. Returns the process exit status.
int run_train(const TrainOptions& options, int* argc, char*** argv);

class MpiSession;
struct Config;
// The config of a job, the same on every rank: rank 0 reads the file and broadcasts it, every rank
// validates it for the world size (`world`, or the ranks started when 0; rank 0 reports a
// problem, followed by `world_hint` where the problem names the world size). kExitOk with *out
// filled, or kExitUsage on every rank. Collective over MPI_COMM_WORLD (train, import).
int agreed_config(const std::string& path, const std::vector<std::string>& overrides, const MpiSession& mpi,
                  Config* out, int world = 0, const std::string& world_hint = "");

}  // namespace fp8moe
