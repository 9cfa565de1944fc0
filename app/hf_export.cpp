// fp8moe export (app/hf.h): a checkpoint of any layout as a Hugging Face DeepSeek-V3 directory,
// streamed one tensor at a time (names, layouts and the FP8 form: io/hf_format.h).
#include "app/hf.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <regex>

#include "app/exit_codes.h"
#include "app/hf_output.h"
#include "io/checkpoint.h"
#include "io/config.h"
#include "io/hf_format.h"
#include "kernels/fp8.h"
#include "kernels/quantize.h"

namespace fp8moe {
namespace {

namespace fs = std::filesystem;

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

// `text` as file `p`, flushed to the disk.
void write_synced(const fs::path& p, const std::string& text) {
  const int fd = ::open(p.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw HfFormatError(p.string() + ": cannot create: " + std::strerror(errno));
  for (size_t at = 0; at < text.size();) {
    const ssize_t w = ::write(fd, text.data() + at, text.size() - at);
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) {
      const std::string why = std::strerror(errno);
      ::close(fd);
      throw HfFormatError(p.string() + ": cannot write: " + why);
    }
    at += size_t(w);
  }
  if (::fsync(fd) != 0 || ::close(fd) != 0) throw HfFormatError(p.string() + ": cannot flush: " + std::strerror(errno));
}

// --max-shard-size: a whole number of bytes from 1 to kMaxShardBytes, in digits or in E notation
// (5e9); false for anything else (nan, inf, 0, -5, 1.5, 5GB, hexadecimal).
constexpr uint64_t kMaxShardBytes = 1'000'000'000'000'000'000;
bool parse_shard_bytes(const std::string& text, uint64_t* bytes) {
  static const std::regex digits("[0-9]+"), e_notation("[0-9]+(\\.[0-9]*)?([eE]\\+?[0-9]+)?");
  if (std::regex_match(text, digits)) {
    const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), *bytes);
    return ec == std::errc() && end == text.data() + text.size() && *bytes >= 1 && *bytes <= kMaxShardBytes;
  }
  if (!std::regex_match(text, e_notation)) return false;
  const double v = std::strtod(text.c_str(), nullptr);
  if (!(v >= 1 && v <= double(kMaxShardBytes)) || v != std::floor(v)) return false;
  *bytes = uint64_t(v);
  return true;
}

std::string gigabytes(double b) {
  char s[32];
  std::snprintf(s, sizeof s, "%.3f GB", b / 1e9);
  return s;
}

// What an export writes: its units in file order (every parameter, then DeepSeek's copies of the
// embedding and head in each multi-token prediction layer) and which units each file holds.
struct ExportPlan {
  std::vector<ExportUnit> units;
  std::vector<std::vector<size_t>> files;  // unit indices of each file, in order
  uint64_t total = 0;                      // data bytes
  size_t tensors() const {
    size_t n = 0;
    for (const ExportUnit& u : units) n += u.tensors.size();
    return n;
  }
};

ExportPlan plan_export(const ModelConfig& m, const ParamTable& table, const std::string& dtype,
                       uint64_t max_shard_bytes) {
  ExportPlan plan;
  const bool fp8 = dtype == "fp8";
  const std::string plain = dtype == "fp32" ? "F32" : "BF16";
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
    plan.units.push_back(std::move(u));
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
  plan.files.emplace_back();
  uint64_t in_file = 0;
  for (size_t k = 0; k < plan.units.size(); ++k) {
    const uint64_t b = plan.units[k].bytes();
    if (!plan.files.back().empty() && in_file + b > max_shard_bytes) plan.files.emplace_back(), in_file = 0;
    plan.files.back().push_back(k);
    in_file += b, plan.total += b;
  }
  return plan;
}

std::string shard_name(size_t f, size_t files) {
  char name[64];
  std::snprintf(name, sizeof name, "model-%05zu-of-%05zu.safetensors", f + 1, files);
  return name;
}

// The names an export writes in its directory (an earlier export's weights among them); anything
// else there is the user's and is kept.
bool export_file(const std::string& f) {
  return f == "config.json" || f == "model.safetensors" || f == "model.safetensors.index.json" ||
         (f.rfind("model-", 0) == 0 && f.ends_with(".safetensors"));
}

// One parameter's FP32 values in the file's row order. A NaN or an infinity is refused: a model
// that holds one is no model to publish.
std::vector<float> export_values(const CheckpointParams& ck, const ModelConfig& m, const ParamSpec& p) {
  std::vector<float> v = ck.read(p);
  if (const size_t bad = hf_first_nonfinite(v.data(), v.size()); bad < v.size())
    throw CheckpointError(ck.dir() + ": parameter " + p.name + " holds " + hf_value_text(v[bad]) + " at [" +
                          std::to_string(bad / size_t(p.cols)) + ", " + std::to_string(bad % size_t(p.cols)) +
                          "]: fp8moe exports finite weights only");
  const HfTensor t = hf_tensor(m, p);
  if (t.hf_row.empty()) return v;
  std::vector<float> moved(v.size());
  for (int64_t r = 0; r < p.rows; ++r)
    std::copy_n(v.data() + r * p.cols, p.cols, moved.data() + t.hf_row[size_t(r)] * p.cols);
  return moved;
}

// config.json, the shards and the index into `dir` (empty), each file flushed.
void write_export(const CheckpointParams& ck, const ParamTable& table, const ExportPlan& plan, const std::string& dtype,
                  const fs::path& dir) {
  const Config& cfg = ck.config();
  write_synced(dir / "config.json", hf_config_json(cfg, dtype == "fp32" ? "float32" : "bfloat16", dtype == "fp8"));
  nlohmann::ordered_json index;
  index["metadata"] = {{"total_size", plan.total}, {"format", "pt"}};
  index["weight_map"] = nlohmann::ordered_json::object();
  for (size_t f = 0; f < plan.files.size(); ++f) {
    const std::string fname = shard_name(f, plan.files.size());
    std::vector<SafeTensor> tensors;
    for (size_t k : plan.files[f])
      for (const SafeTensor& t : plan.units[k].tensors) tensors.push_back(t), index["weight_map"][t.name] = fname;
    SafetensorsWriter w((dir / fname).string(), tensors, {{"format", "pt"}});
    for (size_t k : plan.files[f]) {
      const ExportUnit& u = plan.units[k];
      const ParamSpec& p = table.params[u.param];
      const std::vector<float> v = export_values(ck, cfg.model, p);
      for (const auto& bytes : encode_unit(u, v, p.rows, p.cols, cfg.fp8.power_of_two_scales)) w.write(bytes.data(), bytes.size());
    }
    w.close();
    if (f == 0) export_fault_point("shard");
  }
  write_synced(dir / "model.safetensors.index.json", index.dump(2) + "\n");
}

// The directory read back as an import would read it (config.json, the index, every header against
// its file): every tensor of the plan is there.
void verify_export(const fs::path& dir, const ExportPlan& plan) {
  const HfDirectory d(dir.string());
  for (const ExportUnit& u : plan.units)
    for (const SafeTensor& t : u.tensors)
      if (!d.has(t.name)) throw HfFormatError(dir.string() + ": written without " + t.name);
  if (d.names().size() != plan.tensors())
    throw HfFormatError(dir.string() + ": " + std::to_string(d.names().size()) + " tensors written, " +
                        std::to_string(plan.tensors()) + " planned");
}

}  // namespace

int run_export(const ExportOptions& o) {
  uint64_t max_shard_bytes = 0;
  if (!parse_shard_bytes(o.max_shard_size, &max_shard_bytes))
    return usage_error("export: --max-shard-size: got \"" + o.max_shard_size + "\", expected a whole number of bytes "
                       "from 1 to 1e18, in digits or E notation (5000000000 or 5e9; no unit suffix such as GB)");
  if (const std::string why = unwritable_reason(o.out_dir); !why.empty()) return usage_error("export: " + why);
  std::unique_ptr<CheckpointParams> ck;
  try {
    ck = std::make_unique<CheckpointParams>(o.checkpoint);
  } catch (const CheckpointError& e) {
    return usage_error(std::string("export: ") + e.what());
  }
  const ModelConfig& m = ck->config().model;
  if (const std::string why = hf_export_refusal(m); !why.empty())
    return usage_error("export: " + ck->dir() + " has no DeepSeek-V3 form: " + why);
  const ParamTable table = build_param_table(m);
  const ExportPlan plan = plan_export(m, table, o.dtype, max_shard_bytes);

  // Written into a staging directory beside the target, under the target's lock, and moved in whole
  // once verified (app/hf_output.h): a failure or a kill leaves the earlier export as it was.
  std::error_code ec;
  const std::string kept = fs::is_directory(o.out_dir, ec) ? " (" + o.out_dir + " is as it was)" : "";
  auto failed = [&](int status, const char* what) {
    std::fprintf(stderr, "fp8moe: error: export: %s%s\n", what, kept.c_str());
    return status;
  };
  try {
    ExportTarget target(o.out_dir);
    try {
      write_export(*ck, table, plan, o.dtype, target.staging());
      verify_export(target.staging(), plan);
      target.commit(export_file);
    } catch (const CheckpointError& e) {  // a damaged checkpoint, a non-finite weight
      return failed(kExitUsage, e.what());
    }
  } catch (const OutputRefused& e) {  // a path that cannot be used, another export at work
    return failed(kExitUsage, e.what());
  } catch (const HfFormatError& e) {  // writing the files: a full disk, an I/O error
    return failed(kExitFailure, e.what());
  } catch (const fs::filesystem_error& e) {
    return failed(kExitFailure, e.what());
  }
  const bool fp8 = o.dtype == "fp8";
  std::printf("export: %s (step %lld) -> %s: %zu tensors, %s of %s data in %zu safetensors file%s, config.json "
              "(deepseek_v3%s), model.safetensors.index.json\n",
              ck->dir().c_str(), (long long)ck->step(), o.out_dir.c_str(), plan.tensors(), gigabytes(double(plan.total)).c_str(),
              fp8 ? "FP8 E4M3 (128 x 128 blocks) + BF16" : o.dtype == "fp32" ? "FP32" : "BF16", plan.files.size(),
              plan.files.size() == 1 ? "" : "s", fp8 ? ", quantization_config fp8" : "");
  if (m.moe.capacity_factor > 0)
    std::printf("note: model.moe.capacity_factor %g dropped tokens in training; inference engines route every token\n",
                m.moe.capacity_factor);
  return kExitOk;
}

}  // namespace fp8moe
