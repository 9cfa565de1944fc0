#include "app/train.h"

#include <cstdio>
#include <exception>
#include <filesystem>
#include <memory>

#include "app/exit_codes.h"
#include "app/train_loop.h"
#include "io/config.h"
#include "io/dir_lock.h"
#include "kernels/backend_info.h"
#include "kernels/check.h"
#include "kernels/backend.h"
#include "model/param_table.h"
#include "parallel/cpu_binding.h"
#include "parallel/grid.h"
#include "parallel/mpi_session.h"
#include "parallel/watchdog.h"

namespace fp8moe {
namespace {

// runtime.device and runtime.comm resolved to what runs (every rank agrees), and the CUDA device
// of this rank (its node-local rank modulo the GPUs it sees). Empty on success, else the message
// of a usage error. A dry run on a machine without the configured device (a login node) is not
// one: it resolves as the config's machine would (a GPU per rank) and says the device was not
// checked here. Collective over MPI_COMM_WORLD.
std::string resolve_runtime(Config& cfg, bool dry_run, int* ordinal, std::string* device_line) {
  const NodePlace place = node_place(MPI_COMM_WORLD);
  std::string why;
  const int gpus = cuda_device_count(&why);
  bool all_have_gpu = !any_rank(MPI_COMM_WORLD, gpus == 0);
  *ordinal = gpus > 0 ? place.local_rank % gpus : -1;
  // NCCL refuses two ranks on one GPU.
  bool gpu_per_rank = distinct_gpus_per_node(MPI_COMM_WORLD, *ordinal);
  RuntimeConfig& r = cfg.runtime;
  std::string unchecked;
  if (r.device == DeviceChoice::cuda && !all_have_gpu) {
    const std::string missing = "a rank sees no CUDA device" + (gpus == 0 ? " (" + why + ")" : std::string());
    if (!dry_run) return "runtime.device: cuda, but " + missing + "; use runtime.device=cpu or auto";
    unchecked = "; not checked here: " + missing + " (train without --dry-run refuses to start on this machine)";
    all_have_gpu = gpu_per_rank = true;  // as on the machine the config is for
  }
  std::string resolved;
  if (r.device == DeviceChoice::automatic) {
    r.device = all_have_gpu ? DeviceChoice::cuda : DeviceChoice::cpu;
    resolved = std::string(" (runtime.device auto resolved to ") + (all_have_gpu ? "cuda" : "cpu") + ")";
  }
  if (r.comm == CommChoice::nccl && r.device == DeviceChoice::cuda && !gpu_per_rank)
    return "runtime.comm: nccl needs a GPU of its own for every rank (two ranks of a node use the same GPU); use mpi";
  if (r.comm == CommChoice::automatic)
    r.comm = (r.device == DeviceChoice::cuda && gpu_per_rank) || r.device == DeviceChoice::emulated ? CommChoice::nccl
                                                                                                     : CommChoice::mpi;
  if (r.attention == AttentionChoice::cudnn && r.device == DeviceChoice::cuda && !cudnn_attention_built())
    return "runtime.attention: cudnn, but this fp8moe was built without cuDNN's fused attention (no cuDNN frontend "
           "at configure time: scripts/fetch-headers.sh, then configure again); use auto or reference";
  if (const RuntimeProblem p = runtime_problem(cfg); !p.key.empty())  // the rules again, auto resolved
    return p.key + ": expected " + p.expected + resolved;
  const std::string comm = r.comm == CommChoice::mpi ? (r.device == DeviceChoice::cpu ? "mpi" : "mpi (staged through pinned host memory)")
                           : r.device == DeviceChoice::emulated ? "nccl (the emulated device's own collectives)"
                                                                : "nccl";
  const std::string attention = std::string(EnumNames<AttentionChoice>::names[size_t(r.attention)]) +
                                (cudnn_attention_built() ? "" : " (cuDNN's fused attention not built: reference)");
  if (r.device == DeviceChoice::cuda && !unchecked.empty())
    *device_line = "device: cuda, comm " + comm + ", attention " + attention + unchecked;
  else if (r.device == DeviceChoice::cuda)
    *device_line = "device: cuda (rank 0: GPU " + std::to_string(*ordinal) + " of the " + std::to_string(gpus) +
                   " it sees, by node-local rank " + std::to_string(place.local_rank) + "), comm " + comm +
                   ", attention " + attention;
  else if (r.device == DeviceChoice::emulated)
    *device_line = "device: emulated (the CPU kernels on memory the host may not touch), comm " + comm;
  else
    *device_line = "device: cpu, comm mpi";
  return "";
}

}  // namespace

int agreed_config(const std::string& path, const std::vector<std::string>& overrides, const MpiSession& mpi,
                  Config* out, int world, const std::string& world_hint) {
  const bool root = mpi.rank() == 0;
  // Rank 0 reads the file and broadcasts it: one reader, and every rank validates the same text,
  // so every rank reaches the same verdict and exits the same way; only rank 0 speaks.
  std::string text, error;
  if (root) {
    try {
      text = read_config_file(path);
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
  try {
    *out = load_config(ConfigSource{path, text, overrides}, world > 0 ? world : mpi.size());
  } catch (const ConfigError& e) {
    error = e.what();
    if (error.find("world size") != std::string::npos) error += world_hint;
  }
  if (any_rank(MPI_COMM_WORLD, !error.empty())) {
    if (root) usage_error(error.empty() ? "the config was rejected on another rank" : error);
    return kExitUsage;
  }
  return kExitOk;
}

namespace {

// What a run prints before it starts (rank 0): the effective config, the layout, the device, the
// parameter counts and the threads (null: not set here), and on stderr the warning when the ranks'
// bindings leave CPUs idle.
void print_start(const TrainOptions& options, const Config& config, int ranks, const std::string& table,
                 const std::string& device_line, const RankThreads* threads) {
  std::printf("fp8moe %s: %s on %d rank%s%s\n\neffective config:\n%s\n%s\n", FP8MOE_VERSION,
              options.config_path.c_str(), ranks, ranks == 1 ? "" : "s",
              options.world > 0 ? " (--world: laid out from this process, not launched)" : "",
              config_to_yaml(config).c_str(), table.c_str());
  std::printf("%s\n", device_line.c_str());
  std::printf("%s\n", param_count_table(config.model).c_str());
  if (threads) std::printf("OpenMP threads per rank: %s\n", threads->summary.c_str());
  if (options.dry_run)
    std::printf("dry run: the config is valid and the process grid is %s; nothing was trained.\n",
                options.world > 0 ? "laid out" : "built");
  std::fflush(stdout);
  if (threads && !threads->idle_line.empty()) std::fprintf(stderr, "fp8moe: warning: %s\n", threads->idle_line.c_str());
}

// One run per checkpoint directory (io/dir_lock.h): rank 0 takes checkpoint.dir's lock (making the
// directory) and holds it in *lock for the run; refused on every rank (rank 0 says why) when another
// live process holds it or the directory cannot be made. A run that saves nothing takes no lock.
int lock_checkpoint_dir(const Config& config, const MpiSession& mpi, std::unique_ptr<DirLock>* lock) {
  std::string error;
  if (mpi.rank() == 0 && config.checkpoint.save) {
    const std::string& dir = config.checkpoint.dir;
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    if (ec) {
      error = "checkpoint.dir " + dir + ": cannot make the directory: " + ec.message();
    } else {
      const std::string path = DirLock::of_checkpoint_dir(dir);
      try {
        *lock = std::make_unique<DirLock>(path, "fp8moe train");
      } catch (const DirLockBusy& e) {
        error = "checkpoint.dir: " + dir + " is in use by " + (e.holder.empty() ? "another process" : e.holder) +
                " (its lock " + path + "): one run per directory; wait for it to end, or use another directory";
      } catch (const DirLockError& e) {
        error = std::string("checkpoint.dir: ") + e.what();
      }
    }
  }
  broadcast_string(MPI_COMM_WORLD, error, 0);
  if (error.empty()) return kExitOk;
  if (mpi.rank() == 0) usage_error(error);
  return kExitUsage;
}

int train_on_ranks(const TrainOptions& options, const MpiSession& mpi) {
  const bool root = mpi.rank() == 0;
  if (options.world > 0 && mpi.size() > 1) {  // (CLI11 makes --world need --dry-run)
    if (root) usage_error("--world lays a run out from one process: start the dry run without mpirun");
    return kExitUsage;
  }
  Config config;
  // A dry run on a login node is one process: say how to lay out the job's real world size.
  const std::string hint = options.dry_run && options.world == 0 && mpi.size() == 1
                               ? " (a dry run from one process lays the run out for 1 rank: --world N lays it out for N)"
                               : "";
  if (const int status = agreed_config(options.config_path, options.overrides, mpi, &config, options.world, hint);
      status != kExitOk)
    return status;

  std::string device_line;
  int ordinal = -1;
  std::string error = resolve_runtime(config, options.dry_run, &ordinal, &device_line);  // collective; the verdict is the same on every rank
  if (!error.empty()) {
    if (root) usage_error(error);
    return kExitUsage;
  }
  const ParallelConfig& par = config.parallel;
  if (options.world > 0) {
    const GridDims dims = make_grid_dims(options.world, par.tensor, par.pipeline, par.expert);
    print_start(options, config, options.world, grid_layout_table(dims, {}), device_line, nullptr);
    return kExitOk;
  }
  ProcessGrid grid(MPI_COMM_WORLD, par.tensor, par.pipeline, par.expert);
  const std::string table = grid.layout_table();  // collective
  const RankThreads threads = set_rank_threads(MPI_COMM_WORLD);  // collective
  if (root) print_start(options, config, mpi.size(), table, device_line, &threads);
  if (options.dry_run) return kExitOk;
  std::unique_ptr<DirLock> dir_lock;
  if (const int status = lock_checkpoint_dir(config, mpi, &dir_lock); status != kExitOk) return status;
  const Watchdog watchdog(config.runtime.timeout_s, mpi.rank());  // ends a job with a stuck rank (exit 4)
  const DeviceKind kind = config.runtime.device == DeviceChoice::cuda       ? DeviceKind::cuda
                          : config.runtime.device == DeviceChoice::emulated ? DeviceKind::emulated
                                                                           : DeviceKind::cpu;
  BackendOptions backend_options;
  backend_options.attention = config.runtime.attention == AttentionChoice::cudnn       ? AttentionKernel::cudnn
                              : config.runtime.attention == AttentionChoice::reference ? AttentionKernel::reference
                                                                                        : AttentionKernel::automatic;
  backend_options.grouped_gemm = config.runtime.grouped_gemm;
  backend_options.verbose = root;
  const std::unique_ptr<Backend> backend = make_backend(kind, ordinal, backend_options);
  return train(config, grid, *backend, threads.plan.binding_cpus / std::max(1, threads.plan.sharing));
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
