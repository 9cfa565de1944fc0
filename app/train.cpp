#include "app/train.h"

#include <omp.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <exception>

#include "app/exit_codes.h"
#include "app/train_loop.h"
#include "io/config.h"
#include "kernels/check.h"
#include "parallel/grid.h"
#include "parallel/mpi_session.h"

namespace fp8moe {
namespace {

// Ranks sharing a node share its cores: unless OMP_NUM_THREADS says otherwise, each rank gets
// cores / (ranks on the node), at least 1 (more threads than cores makes OpenMP's spinning
// threads crawl). Collective over MPI_COMM_WORLD.
int set_threads_per_rank() {
  MPI_Comm node;
  MPI_CHECK(MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node));
  int local = 1;
  MPI_CHECK(MPI_Comm_size(node, &local));
  MPI_CHECK(MPI_Comm_free(&node));
  if (!std::getenv("OMP_NUM_THREADS")) omp_set_num_threads(std::max(1, omp_get_num_procs() / local));
  return omp_get_max_threads();
}

int train_on_ranks(const TrainOptions& options, const MpiSession& mpi) {
  const bool root = mpi.rank() == 0;

  // Rank 0 reads the file and broadcasts it: one reader, and every rank validates the same text,
  // so every rank reaches the same verdict and exits the same way; only rank 0 speaks.
  std::string text, error;
  if (root) {
    try {
      text = read_config_file(options.config_path);
    } catch (const ConfigError& e) {
      error = e.what();
    }
  }
  broadcast_string(MPI_COMM_WORLD, error, 0);
  if (!error.empty()) {
    if (root) usage_error(error);
    return kExitUsage;
  }
  broadcast_string(MPI_COMM_WORLD, text, 0);

  Config config;
  try {
    config = load_config(ConfigSource{options.config_path, text, options.overrides}, mpi.size());
  } catch (const ConfigError& e) {
    error = e.what();
  }
  if (any_rank(MPI_COMM_WORLD, !error.empty())) {
    if (root) usage_error(error.empty() ? "the config was rejected on another rank" : error);
    return kExitUsage;
  }

  ProcessGrid grid(MPI_COMM_WORLD, config.parallel.tensor, config.parallel.pipeline, config.parallel.expert);
  const std::string table = grid.layout_table();  // collective
  const int threads = set_threads_per_rank();      // collective
  if (root) {
    std::printf("fp8moe %s: %s on %d rank%s\n\neffective config:\n%s\n%s\n", FP8MOE_VERSION,
                options.config_path.c_str(), mpi.size(), mpi.size() == 1 ? "" : "s",
                config_to_yaml(config).c_str(), table.c_str());
    std::printf("OpenMP threads per rank: %d%s\n", threads,
                std::getenv("OMP_NUM_THREADS") ? " (OMP_NUM_THREADS)" : " (the node's cores / its ranks)");
    if (options.dry_run) std::printf("dry run: the config is valid and the process grid is built; nothing was trained.\n");
    std::fflush(stdout);
  }
  if (options.dry_run) return kExitOk;
  return train(config, grid);
}

}  // namespace

int run_train(const TrainOptions& options, int* argc, char*** argv) {
  MpiSession mpi(argc, argv);
  install_stop_handlers();
  try {
    return train_on_ranks(options, mpi);
  } catch (const std::exception& e) {
    // Still inside the MPI session: the abort hook ends every rank (exit status 1).
    fatal_error(__FILE__, __LINE__, std::string("unexpected exception: ") + e.what());
  }
}

}  // namespace fp8moe
