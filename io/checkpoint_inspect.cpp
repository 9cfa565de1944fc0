// The serial readers of io/checkpoint.h: inspect_checkpoint for `fp8moe ckpt`, which lists every
// dataset, recomputes the checksums in pieces and checks the datasets against the stored config,
// collecting problems instead of stopping at the first; CheckpointParams for `fp8moe export`; and
// the comparison of a checkpoint's config with the current one (io/checkpoint_common.h), which a
// load reports a mismatch with.
#include "io/checkpoint.h"

#include <hdf5.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <map>
#include <set>
#include <sstream>

#include "io/checkpoint_common.h"
#include "io/config.h"
#include "io/hdf5_file.h"

namespace fp8moe {
namespace ckpt {

std::map<std::string, std::string> flat_yaml(const std::string& yaml) {
  std::map<std::string, std::string> out;
  std::vector<std::string> stack;
  std::istringstream in(yaml);
  for (std::string line; std::getline(in, line);) {
    const size_t indent = line.find_first_not_of(' ');
    if (indent == std::string::npos || line[indent] == '#') continue;
    const size_t colon = line.find(':', indent);
    if (colon == std::string::npos) continue;
    stack.resize(indent / 2);
    const std::string key = line.substr(indent, colon - indent);
    std::string value = colon + 1 < line.size() ? line.substr(colon + 2) : "";
    std::string full;
    for (const auto& s : stack) full += s + ".";
    if (value.empty()) stack.push_back(key);
    else out[full + key] = value;
  }
  return out;
}

std::vector<std::string> model_differences(const Config& stored, const Config& current) {
  const auto a = flat_yaml(config_to_yaml(stored)), b = flat_yaml(config_to_yaml(current));
  std::vector<std::string> diff;
  for (const auto& [k, v] : a)
    if (k.rfind("model.", 0) == 0 && k != "model.init_std" && k != "model.mtp_loss_weight" && b.count(k) &&
        b.at(k) != v)
      diff.push_back(k + ": checkpoint " + v + ", config " + b.at(k));
  return diff;
}

namespace {

// "layers.12.moe.experts.3.w1" -> "layers.*.moe.experts.*.w1".
std::string name_pattern(const std::string& name) {
  std::string out;
  for (size_t i = 0; i < name.size();) {
    const bool number = std::isdigit(static_cast<unsigned char>(name[i])) && (i == 0 || name[i - 1] == '.');
    if (!number) {
      out += name[i++];
      continue;
    }
    while (i < name.size() && std::isdigit(static_cast<unsigned char>(name[i]))) ++i;
    out += '*';
  }
  return out;
}

std::set<std::string> param_names(const ModelConfig& m) {
  std::set<std::string> out;
  for (const ParamSpec& p : build_param_table(m).params) out.insert(p.name);
  return out;
}

// "\n  only in the <where>: <pattern> (<count> tensors)" for the names of x not in y, by pattern.
std::string only_in(const std::set<std::string>& x, const std::set<std::string>& y, const char* where) {
  std::map<std::string, int64_t> groups;
  for (const std::string& n : x)
    if (!y.count(n)) ++groups[name_pattern(n)];
  std::string out;
  for (const auto& [g, count] : groups)
    out += "\n  only in the " + std::string(where) + ": " + g + " (" + std::to_string(count) +
           (count == 1 ? " tensor)" : " tensors)");
  return out;
}

}  // namespace

std::string tensor_differences(const ModelConfig& stored, const ModelConfig& current) {
  const std::set<std::string> a = param_names(stored), b = param_names(current);
  return only_in(a, b, "checkpoint") + only_in(b, a, "config's model");
}

}  // namespace ckpt

using namespace ckpt;

namespace {

// Runs `fn`; a CheckpointError it throws becomes one of the report's problems.
template <class Fn>
void attempt(CheckpointReport& rep, Fn&& fn) {
  try {
    fn();
  } catch (const CheckpointError& e) {
    rep.problems.push_back(e.what());
  }
}

// The root attributes of io/checkpoint.h that the report shows.
void read_root(hid_t f, CheckpointReport& rep) {
  attempt(rep, [&] { rep.format_version = read_attr_i64(f, "format_version", rep.file); });
  attempt(rep, [&] { check_version(f, rep.file); });
  attempt(rep, [&] { rep.step = read_attr_i64(f, "step", rep.file); });
  attempt(rep, [&] { rep.samples = read_attr_i64(f, "samples", rep.file); });
  attempt(rep, [&] { rep.tokens = read_attr_i64(f, "tokens", rep.file); });
  attempt(rep, [&] { rep.layout = read_attr_str(f, "layout", rep.file); });
  attempt(rep, [&] { rep.code_version = read_attr_str(f, "code_version", rep.file); });
  attempt(rep, [&] { rep.config_yaml = read_attr_str(f, "config", rep.file); });
}

// Every dataset in the file ("/params/embed.weight", ...).
std::vector<std::string> dataset_paths(hid_t f, CheckpointReport& rep) {
  std::vector<std::string> paths;
  auto visit = [](hid_t, const char* name, const H5O_info_t* info, void* data) -> herr_t {
    if (info->type == H5O_TYPE_DATASET) static_cast<std::vector<std::string>*>(data)->push_back(std::string("/") + name);
    return 0;
  };
  if (H5Ovisit(f, H5_INDEX_NAME, H5_ITER_INC, visit, &paths) < 0)
    rep.problems.push_back(rep.file + ": cannot list the datasets (HDF5: " + h5_error_text() + ")");
  return paths;
}

// The checksum of dataset ds (nd dimensions `dims`, element type dt), recomputed in pieces of
// about 64 MB of whole rows: of slot `slot` alone in a stacked dataset (nd 3; indices from 0 in
// each slot), of everything else.
uint64_t recompute_checksum(hid_t ds, hid_t type, Dt dt, int nd, const hsize_t* dims, int64_t slot, const std::string& at) {
  int64_t n = 1;
  for (int i = nd == 3 ? 1 : 0; i < nd; ++i) n *= int64_t(dims[i]);
  const bool rows_of = nd >= 2;  // selected by rows (a slot's, or the 2-D dataset's)
  const int64_t cols = rows_of ? int64_t(dims[nd - 1]) : n, rows = rows_of ? int64_t(dims[nd - 2]) : 1;
  const int64_t step_rows = std::max<int64_t>(1, (int64_t(1) << 26) / std::max<int64_t>(1, cols * int64_t(dt_size(dt))));
  std::vector<unsigned char> buf;
  uint64_t sum = 0;
  for (int64_t r0 = 0; r0 < rows && cols > 0; r0 += step_rows) {
    const int64_t nr = std::min(step_rows, rows - r0);
    buf.resize(size_t(nr * cols) * dt_size(dt));
    const hsize_t start[3] = {hsize_t(slot), hsize_t(r0), 0}, count[3] = {1, hsize_t(nr), hsize_t(cols)};
    const int skip = nd == 3 ? 0 : 1;
    H5Handle fsel(h5(H5Dget_space(ds), at, "H5Dget_space"), H5Sclose);
    if (rows_of)
      h5(H5Sselect_hyperslab(fsel.get(), H5S_SELECT_SET, start + skip, nullptr, count + skip, nullptr), at, "select");
    const hsize_t elems = hsize_t(nr * cols);
    H5Handle mem(h5(H5Screate_simple(1, &elems, nullptr), at, "H5Screate_simple"), H5Sclose);
    h5(H5Dread(ds, type, mem.get(), rows_of ? fsel.get() : H5S_ALL, H5P_DEFAULT, buf.data()), at, "read failed");
    sum += checksum_part(buf.data(), dt, nr * cols, r0 * cols);
  }
  return sum;
}

// One dataset's shape, type, size and stored checksum (a stacked one's: its slots', and a per-block
// family's blocks); with `verify`, each recomputed, a stacked dataset's damage named down to the
// slot (the expert, or the block).
DatasetReport inspect_dataset(hid_t f, const std::string& p, bool verify, CheckpointReport& rep) {
  DatasetReport d;
  d.path = p;
  attempt(rep, [&] {
    const std::string at = rep.file + ": dataset " + p;
    H5Handle ds(h5(H5Dopen2(f, p.c_str(), H5P_DEFAULT), at, "cannot open"), H5Dclose);
    H5Handle space(h5(H5Dget_space(ds.get()), at, "H5Dget_space"), H5Sclose);
    hsize_t dims[8] = {};
    const int nd = h5(H5Sget_simple_extent_dims(space.get(), dims, nullptr), at, "no shape");
    if (nd > 3) throw CheckpointError(at + ": " + std::to_string(nd) + " dimensions");
    int64_t n = 1;
    for (int i = 0; i < nd; ++i) d.shape.push_back(int64_t(dims[i])), n *= int64_t(dims[i]);
    H5Handle type(h5(H5Dget_type(ds.get()), at, "H5Dget_type"), H5Tclose);
    Dt dt;
    if (!dt_of(type.get(), &dt)) throw CheckpointError(at + ": unexpected element type");
    d.dtype = dt_name(dt);
    d.bytes = n * int64_t(dt_size(dt));
    d.slots = nd == 3 ? int64_t(dims[0]) : 0;
    const std::vector<uint64_t> stored = d.slots > 0 ? read_attr_u64s(ds.get(), "checksums", d.slots, at)
                                                     : std::vector<uint64_t>{read_attr_u64(ds.get(), "checksum", at)};
    // A per-block family's blocks, as many as the attribute holds (ckpt verify compares them with
    // the stored config's).
    if (d.slots > 0 && H5Aexists(ds.get(), "layers") > 0) d.layers = read_attr_i64s(ds.get(), "layers", -1, at);
    for (uint64_t v : stored) d.stored_checksum += v;
    if (!verify) return;
    d.checked = true, d.ok = true;
    for (size_t e = 0; e < stored.size(); ++e) {
      const uint64_t got = recompute_checksum(ds.get(), type.get(), dt, nd, dims, int64_t(e), at);
      d.computed_checksum += got;
      if (got == stored[e]) continue;
      d.ok = false;
      const std::string slot = e < d.layers.size() ? ", layer " + std::to_string(d.layers[e]) : ", expert " + std::to_string(e);
      rep.problems.push_back(at + (d.slots > 0 ? slot : "") + checksum_mismatch(stored[e], got));
    }
  });
  return d;
}

// Everything a load of the checkpoint's own config needs is there, with its shape (the layout of
// the file's format version).
void check_expected_datasets(hid_t f, CheckpointReport& rep) {
  attempt(rep, [&] {
    const Config cfg = stored_config(f, rep.file);
    std::map<std::string, const DatasetReport*> by_path;
    for (const auto& d : rep.datasets) by_path[d.path] = &d;
    std::set<std::string> seen;
    auto expect = [&](const Place& pl, int64_t rows, int64_t cols) {
      if (!seen.insert(pl.path).second) return;
      const std::vector<int64_t> shape =
          pl.slots > 0 ? std::vector<int64_t>{pl.slots, rows, cols} : std::vector<int64_t>{rows, cols};
      const std::string at = rep.file + ": dataset " + pl.path;
      auto it = by_path.find(pl.path);
      if (it == by_path.end()) rep.problems.push_back(at + " is missing");
      else if (it->second->shape != shape) rep.problems.push_back(at + " has the wrong shape");
      else if (pl.layers && it->second->layers != *pl.layers)
        rep.problems.push_back(at + ": holds " + layers_text(it->second->layers) + ", expected " + layers_text(*pl.layers));
    };
    const ParamTable table = build_param_table(cfg.model);
    const DatasetLayout layout(table, cfg.model.moe.n_experts, int(rep.format_version));
    for (const ParamSpec& p : table.params)
      for (int which = -1; which < (p.trainable ? 2 : 0); ++which) expect(layout.place(p, which), p.rows, p.cols);
  });
}

}  // namespace

CheckpointReport inspect_checkpoint(const std::string& path, bool verify) {
  quiet_hdf5();
  const std::string dir = resolve_checkpoint_dir(path);
  CheckpointReport rep;
  rep.file = dir + "/" + kCheckpointFile;
  H5Handle file = open_file(rep.file, MPI_COMM_NULL);
  read_root(file.get(), rep);
  for (const std::string& p : dataset_paths(file.get(), rep)) rep.datasets.push_back(inspect_dataset(file.get(), p, verify, rep));
  const bool version_ok = rep.format_version >= kCheckpointOldestFormatVersion && rep.format_version <= kCheckpointFormatVersion;
  if (verify && !rep.config_yaml.empty() && version_ok) check_expected_datasets(file.get(), rep);
  return rep;
}

struct CheckpointParams::Impl {
  std::string dir, file_path;
  H5Handle file;
  Config cfg;
  int64_t step = 0;
  std::unique_ptr<DatasetLayout> layout;
};

CheckpointParams::CheckpointParams(const std::string& path) : impl_(std::make_unique<Impl>()) {
  quiet_hdf5();
  impl_->dir = resolve_checkpoint_dir(path);
  impl_->file_path = impl_->dir + "/" + kCheckpointFile;
  impl_->file = open_file(impl_->file_path, MPI_COMM_NULL);
  const int version = check_version(impl_->file.get(), impl_->file_path);
  impl_->cfg = stored_config(impl_->file.get(), impl_->file_path);
  impl_->layout = std::make_unique<DatasetLayout>(build_param_table(impl_->cfg.model), impl_->cfg.model.moe.n_experts, version);
  impl_->step = read_attr_i64(impl_->file.get(), "step", impl_->file_path);
}

CheckpointParams::~CheckpointParams() = default;
const std::string& CheckpointParams::dir() const { return impl_->dir; }
const Config& CheckpointParams::config() const { return impl_->cfg; }
int64_t CheckpointParams::step() const { return impl_->step; }

std::vector<float> CheckpointParams::read(const ParamSpec& p) const {
  const Place pl = impl_->layout->place(p, -1);
  const OpenDataset d = open_dataset(impl_->file.get(), pl, p.rows, p.cols, {Dt::f32}, impl_->file_path);
  std::vector<float> out(size_t(p.numel()));
  read_blocks(d, H5P_DEFAULT, {Slab{pl.slot, Rows{0, p.rows}, 0, p.cols}}, out.data());
  const uint64_t sum = checksum_block(out.data(), Dt::f32, 0, p.rows, 0, p.cols, p.cols);
  if (sum != d.stored_checksum(pl.slot))
    throw CheckpointError(impl_->file_path + ": " + tensor_text(pl) + checksum_mismatch(d.stored_checksum(pl.slot), sum));
  return out;
}

}  // namespace fp8moe
