#include "app/hf.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>

#include "app/exit_codes.h"
#include "app/train.h"
#include "app/train_loop.h"
#include "app/trainer.h"
#include "io/checkpoint.h"
#include "io/config.h"
#include "io/hf_format.h"
#include "kernels/backend.h"
#include "kernels/check.h"
#include "kernels/fp8.h"
#include "kernels/quantize.h"
#include "model/transformer.h"
#include "parallel/grid.h"
#include "parallel/mpi_session.h"

namespace fp8moe {
namespace {

namespace fs = std::filesystem;

// ---------------------------------------------------------------- export

// One unit of the export: a parameter (or DeepSeek's copy of one) as one tensor, or in the FP8
// form as the E4M3 weight and its weight_scale_inv; a unit never straddles two files.
struct ExportUnit {
  size_t param = 0;           // its fp8moe parameter (the source of a copy)
  std::vector<SafeTensor> tensors;
  bool fp8 = false;
  uint64_t bytes() const {
    uint64_t b = 0;
    for (const SafeTensor& t : tensors) b += uint64_t(t.numel()) * safetensors_dtype_size(t.dtype);
    return b;
  }
};

// The bytes of one unit, in the order of its tensors, from the parameter's FP32 values (rows
// already in the file's order).
std::vector<std::vector<unsigned char>> encode_unit(const ExportUnit& u, const std::vector<float>& v, int64_t rows,
                                                    int64_t cols, bool power_of_two) {
  std::vector<std::vector<unsigned char>> out;
  if (u.fp8) {
    // DeepSeek-V3's form: E4M3 (saturating, round to nearest even) with one scale per 128 x 128
    // block from the block's amax; weight = decode(byte) * weight_scale_inv. With fp8moe's power-of-
    // two scales (fp8.power_of_two_scales, the default) the bytes are those its blockwise recipe
    // computes with at a tile of 128.
    QuantTensor q;
    quantize_tiled(v.data(), rows, cols, Tiling::blocks_TxT, kHfFp8Block, Fp8Dtype::e4m3, ScaleOptions{0, power_of_two}, &q);
    out.emplace_back(q.data.begin(), q.data.end());
    const auto* s = reinterpret_cast<const unsigned char*>(q.scale_inv.data());
    out.emplace_back(s, s + q.scale_inv.size() * 4);
    return out;
  }
  const std::string& dt = u.tensors[0].dtype;
  std::vector<unsigned char> b(v.size() * safetensors_dtype_size(dt));
  if (dt == "F32") {
    std::memcpy(b.data(), v.data(), b.size());
  } else {
    for (size_t i = 0; i < v.size(); ++i) {
      const uint16_t h = bf16_encode(v[i]);
      std::memcpy(b.data() + 2 * i, &h, 2);
    }
  }
  out.push_back(std::move(b));
  return out;
}

void write_text(const fs::path& p, const std::string& text) {
  std::ofstream f(p, std::ios::binary | std::ios::trunc);
  f << text;
  f.close();
  if (!f) throw HfFormatError(p.string() + ": cannot write");
}

std::string gigabytes(double b) {
  char s[32];
  std::snprintf(s, sizeof s, "%.3f GB", b / 1e9);
  return s;
}

}  // namespace

int run_export(const ExportOptions& o) {
  std::unique_ptr<CheckpointParams> ck;
  try {
    ck = std::make_unique<CheckpointParams>(o.checkpoint);
  } catch (const CheckpointError& e) {
    return usage_error(std::string("export: ") + e.what());
  }
  const Config& cfg = ck->config();
  const ModelConfig& m = cfg.model;
  if (const std::string why = hf_export_refusal(m); !why.empty())
    return usage_error("export: " + ck->dir() + " has no DeepSeek-V3 form: " + why);
  const bool fp8 = o.dtype == "fp8";
  const std::string plain = o.dtype == "fp32" ? "F32" : "BF16";
  const ParamTable table = build_param_table(m);

  // The units in file order: every parameter, then DeepSeek's copies of the embedding and head in
  // each multi-token prediction layer.
  std::vector<ExportUnit> units;
  auto add = [&](size_t i, const std::string& name, const std::vector<int64_t>& shape) {
    const ParamSpec& p = table.params[i];
    ExportUnit u;
    u.param = i;
    u.fp8 = fp8 && hf_fp8_weight(p);
    if (u.fp8) {
      u.tensors.push_back({name, "F8_E4M3", shape});
      u.tensors.push_back({name + "_scale_inv", "F32",
                           {(p.rows + kHfFp8Block - 1) / kHfFp8Block, (p.cols + kHfFp8Block - 1) / kHfFp8Block}});
    } else {
      // The router's selection bias stays FP32 in every form, as DeepSeek publishes it.
      u.tensors.push_back({name, p.name.ends_with("router_bias") ? "F32" : plain, shape});
    }
    units.push_back(std::move(u));
  };
  for (size_t i = 0; i < table.params.size(); ++i) {
    const HfTensor t = hf_tensor(m, table.params[i]);
    add(i, t.name, t.shape);
  }
  for (const auto& [name, source] : hf_copies(m)) {
    const size_t i = size_t(table.index_of(source));
    add(i, name, hf_tensor(m, table.params[i]).shape);
  }

  // Files of at most max_shard_bytes each (a larger unit has a file of its own), in order.
  const std::map<std::string, std::string> metadata = {{"format", "pt"}};
  std::vector<std::vector<size_t>> files(1);
  uint64_t in_file = 0, total = 0;
  for (size_t k = 0; k < units.size(); ++k) {
    const uint64_t b = units[k].bytes();
    if (!files.back().empty() && double(in_file + b) > o.max_shard_bytes) files.emplace_back(), in_file = 0;
    files.back().push_back(k);
    in_file += b, total += b;
  }

  const fs::path out(o.out_dir);
  try {
    std::error_code ec;
    fs::create_directories(out, ec);
    if (ec) throw HfFormatError(o.out_dir + ": cannot create: " + ec.message());
    // The weights of an earlier export into the same directory go (as save_pretrained does), so
    // that no stale shard is read with the new ones.
    for (const auto& e : fs::directory_iterator(out)) {
      const std::string f = e.path().filename().string();
      if (f == "model.safetensors" || f == "model.safetensors.index.json" ||
          (f.rfind("model-", 0) == 0 && f.ends_with(".safetensors")))
        fs::remove(e.path());
    }
    write_text(out / "config.json", hf_config_json(cfg, o.dtype == "fp32" ? "float32" : "bfloat16", fp8));
    nlohmann::ordered_json index;
    index["metadata"] = {{"total_size", total}, {"format", "pt"}};
    index["weight_map"] = nlohmann::ordered_json::object();
    char fname[64];
    for (size_t f = 0; f < files.size(); ++f) {
      std::snprintf(fname, sizeof fname, "model-%05zu-of-%05zu.safetensors", f + 1, files.size());
      std::vector<SafeTensor> tensors;
      for (size_t k : files[f])
        for (const SafeTensor& t : units[k].tensors) tensors.push_back(t), index["weight_map"][t.name] = fname;
      SafetensorsWriter w((out / fname).string(), tensors, metadata);
      for (size_t k : files[f]) {
        const ExportUnit& u = units[k];
        const ParamSpec& p = table.params[u.param];
        std::vector<float> v = ck->read(p);
        const HfTensor t = hf_tensor(m, p);
        if (!t.hf_row.empty()) {
          std::vector<float> moved(v.size());
          for (int64_t r = 0; r < p.rows; ++r)
            std::copy_n(v.data() + r * p.cols, p.cols, moved.data() + t.hf_row[size_t(r)] * p.cols);
          v = std::move(moved);
        }
        for (const auto& bytes : encode_unit(u, v, p.rows, p.cols, cfg.fp8.power_of_two_scales)) w.write(bytes.data(), bytes.size());
      }
      w.close();
    }
    write_text(out / "model.safetensors.index.json", index.dump(2) + "\n");
  } catch (const CheckpointError& e) {
    return usage_error(std::string("export: ") + e.what());
  } catch (const HfFormatError& e) {  // writing the files
    std::fprintf(stderr, "fp8moe: error: export: %s\n", e.what());
    return kExitFailure;
  } catch (const fs::filesystem_error& e) {
    std::fprintf(stderr, "fp8moe: error: export: %s\n", e.what());
    return kExitFailure;
  }
  size_t tensors = 0;
  for (const ExportUnit& u : units) tensors += u.tensors.size();
  std::printf("export: %s (step %lld) -> %s: %zu tensors, %s of %s data in %zu safetensors file%s, config.json "
              "(deepseek_v3%s), model.safetensors.index.json\n",
              ck->dir().c_str(), (long long)ck->step(), o.out_dir.c_str(), tensors, gigabytes(double(total)).c_str(),
              fp8 ? "FP8 E4M3 (128 x 128 blocks) + BF16" : o.dtype == "fp32" ? "FP32" : "BF16", files.size(),
              files.size() == 1 ? "" : "s", fp8 ? ", quantization_config fp8" : "");
  if (m.moe.capacity_factor > 0)
    std::printf("note: model.moe.capacity_factor %g dropped tokens in training; inference engines route every token\n",
                m.moe.capacity_factor);
  return kExitOk;
}

// ---------------------------------------------------------------- import

namespace {

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
  try {
    if (const std::string why = hf_export_refusal(m); !why.empty()) throw HfFormatError("--config: " + why);
    std::error_code ec;
    if (fs::exists(fs::path(o.checkpoint_dir) / "latest", ec))
      throw HfFormatError(o.checkpoint_dir + " already holds checkpoints (it has a `latest`); import into a new directory");
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
