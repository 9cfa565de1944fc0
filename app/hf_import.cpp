// fp8moe import (app/hf.h): a Hugging Face DeepSeek-V3 directory as a step-0 checkpoint, each rank
// reading its own shards (names, layouts and the FP8 form: io/hf_format.h).
#include "app/hf.h"

#include <cstdio>
#include <filesystem>
#include <memory>
#include <set>

#include "app/exit_codes.h"
#include "app/hf_output.h"
#include "app/train.h"
#include "app/train_loop.h"
#include "app/trainer.h"
#include "io/checkpoint.h"
#include "io/config.h"
#include "io/dir_lock.h"
#include "io/hf_format.h"
#include "kernels/backend.h"
#include "kernels/check.h"
#include "model/transformer.h"
#include "parallel/grid.h"
#include "parallel/mpi_session.h"

namespace fp8moe {
namespace {

namespace fs = std::filesystem;

// What the files hold that the model does not read: names of neither a parameter, nor a copy,
// nor a scale of one.
std::vector<std::string> foreign_tensors(const HfDirectory& d, const ModelConfig& m, const ParamTable& table) {
  std::set<std::string> known;
  for (const ParamSpec& p : table.params) known.insert(hf_tensor(m, p).name);
  for (const auto& [name, source] : hf_copies(m)) known.insert(name);
  std::vector<std::string> out;
  for (const std::string& n : d.names()) {
    const std::string base = n.ends_with("_scale_inv") ? n.substr(0, n.size() - 10) : n;
    if (!known.count(base)) out.push_back(n);
  }
  return out;
}

std::string some(const std::vector<std::string>& v, size_t most = 8) {
  std::string s;
  for (size_t i = 0; i < v.size() && i < most; ++i) s += "\n  " + v[i];
  if (v.size() > most) s += "\n  ... and " + std::to_string(v.size() - most) + " more";
  return s;
}

// The lock of checkpoint directory `dir` (made here; io/dir_lock.h), so that no training run starts
// on it while the import writes it; throws HfFormatError naming the holder.
std::unique_ptr<DirLock> lock_import_destination(const std::string& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) throw HfFormatError(dir + ": cannot make the directory: " + ec.message());
  const std::string path = DirLock::of_checkpoint_dir(dir);
  try {
    return std::make_unique<DirLock>(path, "fp8moe import");
  } catch (const DirLockBusy& e) {
    throw HfFormatError(dir + " is in use by " + (e.holder.empty() ? "another process" : e.holder) + " (its lock " +
                        path + "): wait for it to end, or import into another directory");
  } catch (const DirLockError& e) {
    throw HfFormatError(e.what());
  }
}

int import_on_ranks(const ImportOptions& o, const MpiSession& mpi) {
  const bool root = mpi.rank() == 0;
  auto fail = [&](const std::string& message) { return root ? usage_error("import: " + message) : kExitUsage; };
  Config cfg;
  if (const int status = agreed_config(o.config_path, o.overrides, mpi, &cfg); status != kExitOk) return status;
  cfg.checkpoint.dir = o.checkpoint_dir;
  const ModelConfig& m = cfg.model;
  const ParamTable table = build_param_table(m);

  // The directory, read by every rank alike (each reads its own tensors below).
  std::unique_ptr<HfDirectory> dir;
  std::string error;
  std::vector<std::string> fresh;  // multi-token prediction tensors the files lack: initialised from the seed
  std::unique_ptr<DirLock> lock;    // rank 0: the checkpoint directory's, as a training run takes it
  try {
    if (const std::string why = hf_export_refusal(m); !why.empty()) throw HfFormatError("--config: " + why);
    if (const std::string why = import_destination_refusal(o.checkpoint_dir); !why.empty()) throw HfFormatError(why);
    if (root) lock = lock_import_destination(o.checkpoint_dir);
    dir = std::make_unique<HfDirectory>(o.hf_dir);
    if (const auto diff = hf_config_differences(dir->config_json(), m); !diff.empty())
      throw HfFormatError(o.hf_dir + "/config.json is not the model of " + o.config_path + ":" + some(diff, 64));
    // Every tensor of the main model; each multi-token prediction module whole or not at all.
    std::vector<std::string> missing;
    std::vector<int> module_present(size_t(m.mtp_depth), 0), module_missing(size_t(m.mtp_depth), 0);
    for (const ParamSpec& p : table.params) {
      const std::string name = hf_tensor(m, p).name;
      const bool mtp = p.name.rfind("mtp.", 0) == 0;
      if (mtp) ++(dir->has(name) ? module_present : module_missing)[size_t(p.layer - m.n_layers)];
      if (dir->has(name)) continue;
      (mtp ? fresh : missing).push_back(name);
    }
    for (int k = 0; k < m.mtp_depth; ++k)
      if (module_present[size_t(k)] > 0 && module_missing[size_t(k)] > 0)
        missing.push_back("(multi-token prediction module " + std::to_string(k) + ": " +
                          std::to_string(module_missing[size_t(k)]) + " of its tensors are missing, " +
                          std::to_string(module_present[size_t(k)]) + " are there)");
    if (!missing.empty())
      throw HfFormatError(o.hf_dir + ": " + std::to_string(missing.size()) + " tensors of the model are missing:" + some(missing));
    if (const auto extra = foreign_tensors(*dir, m, table); !extra.empty())
      throw HfFormatError(o.hf_dir + ": " + std::to_string(extra.size()) +
                          " tensors are not of this model (another architecture?):" + some(extra));
  } catch (const HfFormatError& e) {
    error = e.what();
  } catch (const fs::filesystem_error& e) {
    error = e.what();
  }
  if (const std::string e = first_error(MPI_COMM_WORLD, error); !e.empty()) return fail(e);

  // The model and optimizer of a fresh run of this layout, on the CPU backend: each rank holds its
  // shard, exactly as training would, and the checkpoint is written the way training writes one.
  ProcessGrid grid(MPI_COMM_WORLD, cfg.parallel.tensor, cfg.parallel.pipeline, cfg.parallel.expert);
  const std::unique_ptr<Backend> be = make_backend(DeviceKind::cpu);
  const TrainComms comms(grid, *be, /*nccl=*/false);
  Trainer trainer(cfg, *be, comms, layout_text(grid.dims()));
  Transformer& model = trainer.model;
  try {
    for (size_t i = 0; i < table.params.size(); ++i) {
      const ParamSpec& p = table.params[i];
      if (!model.holds(i) || !dir->has(hf_tensor(m, p).name)) continue;
      model.set_param(i, hf_read_param(*dir, m, p, model.shard(i)));
    }
  } catch (const HfFormatError& e) {
    error = e.what();
  }
  if (const std::string e = first_error(MPI_COMM_WORLD, error); !e.empty()) return fail(e);
  if (root && !fresh.empty())
    std::printf("note: %s has no multi-token prediction tensors (%zu of them, e.g. %s; transformers does not save "
                "them): those modules start from train.seed as in a fresh run\n",
                o.hf_dir.c_str(), fresh.size(), fresh.front().c_str());
  std::string saved;
  try {
    saved = save_checkpoint(grid.world(), trainer.state);
  } catch (const CheckpointError& e) {
    if (root) std::fprintf(stderr, "fp8moe: error: import: %s\n", e.what());
    return kExitFailure;
  }
  if (root)
    std::printf("import: %s -> %s: %s parameters at step 0 with zero Adam moments, written by %d rank%s; resume it "
                "with checkpoint.resume: %s (any layout)\n",
                o.hf_dir.c_str(), saved.c_str(), std::to_string(table.trainable_numel()).c_str(), mpi.size(),
                mpi.size() == 1 ? "" : "s", o.checkpoint_dir.c_str());
  return kExitOk;
}

}  // namespace

int run_import(const ImportOptions& o, int* argc, char*** argv) {
  MpiSession mpi(argc, argv);
  try {
    return import_on_ranks(o, mpi);
  } catch (const std::exception& e) {
    fatal_error(__FILE__, __LINE__, std::string("unexpected exception: ") + e.what());
  }
}

}  // namespace fp8moe
