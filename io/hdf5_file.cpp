// The HDF5 layer of the checkpoints (io/hdf5_file.h): HDF5 errors as CheckpointError, the
// bfloat16 type, the checksum loops, attributes, files opened through MPI-IO, and the datasets
// each rank writes and reads by rows.
#include "io/hdf5_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <exception>
#include <filesystem>

#include "io/config.h"
#include "kernels/check.h"
#include "parallel/mpi_session.h"

namespace fp8moe::ckpt {
namespace fs = std::filesystem;

// ---------------------------------------------------------------- HDF5 handles and errors

std::string h5_error_text() {
  struct Acc {
    std::string inner, outer;
  } acc;
  H5Ewalk2(
      H5E_DEFAULT, H5E_WALK_UPWARD,
      [](unsigned n, const H5E_error2_t* e, void* data) -> herr_t {
        auto* a = static_cast<Acc*>(data);
        const std::string d = e->desc ? e->desc : "";
        if (n == 0) a->inner = d;
        a->outer = d;
        return 0;
      },
      &acc);
  H5Eclear2(H5E_DEFAULT);
  if (acc.inner.empty()) return "no detail";
  return acc.inner == acc.outer ? acc.inner : acc.inner + "; " + acc.outer;
}

void quiet_hdf5() { H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr); }

// ---------------------------------------------------------------- element types

size_t dt_size(Dt t) { return t == Dt::bf16 ? 2 : t == Dt::f32 ? 4 : 8; }
const char* dt_name(Dt t) { return t == Dt::bf16 ? "bfloat16" : t == Dt::f32 ? "float32" : "int64"; }

namespace {

// bfloat16 as an HDF5 floating-point type (sign bit 15, 8 exponent bits at 7, 7 mantissa bits,
// bias 127): h5dump and h5py read it as a float.
hid_t bf16_type() {
  static const hid_t t = [] {
    const hid_t b = H5Tcopy(H5T_IEEE_F32LE);
    H5_CHECK(H5Tset_fields(b, 15, 7, 8, 0, 7));
    H5_CHECK(H5Tset_precision(b, 16));
    H5_CHECK(H5Tset_size(b, 2));
    H5_CHECK(H5Tset_ebias(b, 127));
    return b;
  }();
  return t;
}

hid_t file_type(Dt t) { return t == Dt::bf16 ? bf16_type() : t == Dt::f32 ? H5T_IEEE_F32LE : H5T_STD_I64LE; }

}  // namespace

bool dt_of(hid_t type, Dt* out) {
  for (Dt t : {Dt::f32, Dt::bf16, Dt::i64})
    if (H5Tequal(type, file_type(t)) > 0) return *out = t, true;
  return false;
}

// ---------------------------------------------------------------- checksums

namespace {

inline uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}
inline uint64_t term(uint64_t i, uint64_t bits) { return splitmix64(splitmix64(i) ^ bits); }

// checksum_part's sums, one loop per element width, so that the compiler vectorises it.
// Compiled twice: for x86-64-v4 (AVX-512: 64-bit vector multiplies, ~8x faster) and the baseline,
// chosen at load time by the CPU.
#define FP8MOE_CHECKSUM_LOOP(NAME, U)                                                  \
  __attribute__((target_clones("arch=x86-64-v4", "default"))) uint64_t NAME(const U* data, int64_t n, \
                                                                             int64_t first) { \
    uint64_t sum = 0;                                                                  \
    _Pragma("omp parallel for simd reduction(+ : sum) schedule(static)")              \
    for (int64_t i = 0; i < n; ++i) sum += term(uint64_t(first + i), uint64_t(data[i])); \
    return sum;                                                                        \
  }
FP8MOE_CHECKSUM_LOOP(checksum_u16, uint16_t)
FP8MOE_CHECKSUM_LOOP(checksum_u32, uint32_t)
FP8MOE_CHECKSUM_LOOP(checksum_u64, uint64_t)
#undef FP8MOE_CHECKSUM_LOOP

}  // namespace

uint64_t checksum_part(const void* data, Dt t, int64_t n, int64_t first) {
  switch (t) {  // little-endian host: the stored bytes as an unsigned integer
    case Dt::bf16: return checksum_u16(static_cast<const uint16_t*>(data), n, first);
    case Dt::f32: return checksum_u32(static_cast<const uint32_t*>(data), n, first);
    default: return checksum_u64(static_cast<const uint64_t*>(data), n, first);
  }
}

uint64_t checksum_block(const void* data, Dt t, int64_t r0, int64_t n, int64_t c0, int64_t nc, int64_t cols) {
  if (nc == cols) return checksum_part(data, t, n * nc, r0 * cols);
  uint64_t sum = 0;
  for (int64_t r = 0; r < n; ++r)
    sum += checksum_part(static_cast<const unsigned char*>(data) + size_t(r * nc) * dt_size(t), t, nc, (r0 + r) * cols + c0);
  return sum;
}

std::string checksum_mismatch(uint64_t stored, uint64_t computed) {
  char buf[96];
  std::snprintf(buf, sizeof buf, " (stored %016llx, computed %016llx)", (unsigned long long)stored,
                (unsigned long long)computed);
  return std::string(": checksum mismatch: the data is corrupt") + buf;
}

// ---------------------------------------------------------------- attributes

namespace {

void write_attr_raw(hid_t obj, const std::string& name, hid_t file_t, hid_t mem_t, const void* v, const std::string& where) {
  H5Handle space(h5(H5Screate(H5S_SCALAR), where, "H5Screate"), H5Sclose);
  H5Handle a(h5(H5Acreate2(obj, name.c_str(), file_t, space.get(), H5P_DEFAULT, H5P_DEFAULT), where,
                "cannot create attribute " + name),
             H5Aclose);
  h5(H5Awrite(a.get(), mem_t, v), where, "cannot write attribute " + name);
}

void write_attr_u64(hid_t obj, const std::string& name, uint64_t v, const std::string& where) {
  write_attr_raw(obj, name, H5T_STD_U64LE, H5T_NATIVE_UINT64, &v, where);
}

void write_attr_array(hid_t obj, const std::string& name, hid_t file_t, hid_t mem_t, size_t count, const void* v,
                      const std::string& where) {
  const hsize_t n = count;
  H5Handle space(h5(H5Screate_simple(1, &n, nullptr), where, "H5Screate_simple"), H5Sclose);
  H5Handle a(h5(H5Acreate2(obj, name.c_str(), file_t, space.get(), H5P_DEFAULT, H5P_DEFAULT), where,
                "cannot create attribute " + name),
             H5Aclose);
  h5(H5Awrite(a.get(), mem_t, v), where, "cannot write attribute " + name);
}

void write_attr_u64s(hid_t obj, const std::string& name, const std::vector<uint64_t>& v, const std::string& where) {
  write_attr_array(obj, name, H5T_STD_U64LE, H5T_NATIVE_UINT64, v.size(), v.data(), where);
}

H5Handle open_attr(hid_t obj, const std::string& name, const std::string& where) {
  if (H5Aexists(obj, name.c_str()) <= 0) throw CheckpointError(where + ": attribute " + name + " is missing");
  return H5Handle(h5(H5Aopen(obj, name.c_str(), H5P_DEFAULT), where, "cannot open attribute " + name), H5Aclose);
}

}  // namespace

void write_attr(hid_t obj, const std::string& name, int64_t v, const std::string& where) {
  write_attr_raw(obj, name, H5T_STD_I64LE, H5T_NATIVE_INT64, &v, where);
}
void write_attr(hid_t obj, const std::string& name, double v, const std::string& where) {
  write_attr_raw(obj, name, H5T_IEEE_F64LE, H5T_NATIVE_DOUBLE, &v, where);
}
void write_attr(hid_t obj, const std::string& name, const std::string& v, const std::string& where) {
  H5Handle t(h5(H5Tcopy(H5T_C_S1), where, "H5Tcopy"), H5Tclose);
  h5(H5Tset_size(t.get(), std::max<size_t>(1, v.size())), where, "H5Tset_size");
  h5(H5Tset_strpad(t.get(), H5T_STR_NULLPAD), where, "H5Tset_strpad");
  std::string buf = v.empty() ? std::string(1, '\0') : v;
  write_attr_raw(obj, name, t.get(), t.get(), buf.data(), where);
}

int64_t read_attr_i64(hid_t obj, const std::string& name, const std::string& where) {
  H5Handle a = open_attr(obj, name, where);
  int64_t v = 0;
  h5(H5Aread(a.get(), H5T_NATIVE_INT64, &v), where, "cannot read attribute " + name);
  return v;
}
uint64_t read_attr_u64(hid_t obj, const std::string& name, const std::string& where) {
  H5Handle a = open_attr(obj, name, where);
  uint64_t v = 0;
  h5(H5Aread(a.get(), H5T_NATIVE_UINT64, &v), where, "cannot read attribute " + name);
  return v;
}
namespace {
// An array attribute as mem_t values (type T): n of them (another count throws), or any number (n -1).
template <class T>
std::vector<T> read_attr_array(hid_t obj, const std::string& name, int64_t n, hid_t mem_t, const std::string& where) {
  H5Handle a = open_attr(obj, name, where);
  H5Handle space(h5(H5Aget_space(a.get()), where, "attribute " + name), H5Sclose);
  const hssize_t count = H5Sget_simple_extent_npoints(space.get());
  if (count < 0) throw CheckpointError(where + ": attribute " + name + " has no readable size");
  if (n >= 0 && count != hssize_t(n))
    throw CheckpointError(where + ": attribute " + name + " does not hold " + std::to_string(n) + " values");
  std::vector<T> v(static_cast<size_t>(count));
  if (count > 0) h5(H5Aread(a.get(), mem_t, v.data()), where, "cannot read attribute " + name);
  return v;
}
}  // namespace
std::vector<uint64_t> read_attr_u64s(hid_t obj, const std::string& name, int64_t n, const std::string& where) {
  return read_attr_array<uint64_t>(obj, name, n, H5T_NATIVE_UINT64, where);
}
std::vector<int64_t> read_attr_i64s(hid_t obj, const std::string& name, int64_t n, const std::string& where) {
  return read_attr_array<int64_t>(obj, name, n, H5T_NATIVE_INT64, where);
}
double read_attr_f64(hid_t obj, const std::string& name, const std::string& where) {
  H5Handle a = open_attr(obj, name, where);
  double v = 0;
  h5(H5Aread(a.get(), H5T_NATIVE_DOUBLE, &v), where, "cannot read attribute " + name);
  return v;
}
std::string read_attr_str(hid_t obj, const std::string& name, const std::string& where) {
  H5Handle a = open_attr(obj, name, where);
  H5Handle t(h5(H5Aget_type(a.get()), where, "attribute " + name), H5Tclose);
  if (H5Tget_class(t.get()) != H5T_STRING || H5Tis_variable_str(t.get()) > 0)
    throw CheckpointError(where + ": attribute " + name + " is not a fixed-length string");
  std::string s(H5Tget_size(t.get()), '\0');
  h5(H5Aread(a.get(), t.get(), s.data()), where, "cannot read attribute " + name);
  s.resize(std::strlen(s.c_str()));
  return s;
}

// ---------------------------------------------------------------- root attributes of a load

Config stored_config(hid_t file, const std::string& where) {
  const std::string yaml = read_attr_str(file, "config", where);
  try {
    return load_config(ConfigSource{where + " (stored config)", yaml, {}}, 0);
  } catch (const std::exception& e) {
    throw CheckpointError(where + ": the stored config is not valid: " + e.what());
  }
}

int check_version(hid_t file, const std::string& where) {
  const int64_t v = read_attr_i64(file, "format_version", where);
  if (v < kCheckpointOldestFormatVersion || v > kCheckpointFormatVersion)
    throw CheckpointError(where + ": format version " + std::to_string(v) + ", this build reads versions " +
                          std::to_string(kCheckpointOldestFormatVersion) + " to " +
                          std::to_string(kCheckpointFormatVersion));
  return int(v);
}

// ---------------------------------------------------------------- dataset names

namespace {

// A routed expert's tensor's name in the stacked form: "layers.3.moe.experts.17.w1" ->
// "layers.3.moe.experts.w1" (the expert's number and its dot removed); other names unchanged.
std::string stacked_name(const std::string& name) {
  static const std::string key = ".moe.experts.";
  const size_t at = name.find(key);
  if (at == std::string::npos) return name;
  size_t end = at + key.size();
  while (end < name.size() && std::isdigit(static_cast<unsigned char>(name[end]))) ++end;
  if (end == at + key.size() || end >= name.size() || name[end] != '.') return name;
  return name.substr(0, at + key.size()) + name.substr(end + 1);
}

// A per-block tensor's family ("layers.3.attn.wq" -> "layers.attn.wq"); "" for any other tensor
// (outside the blocks, a routed expert's, the MTP modules').
std::string layer_family(const ParamSpec& p) {
  if (p.layer < 0 || p.expert >= 0) return "";
  const std::string head = "layers." + std::to_string(p.layer) + ".";
  if (p.name.compare(0, head.size(), head) != 0) return "";
  return "layers." + p.name.substr(head.size());
}

}  // namespace

DatasetLayout::DatasetLayout(const ParamTable& table, int64_t n_experts, int version)
    : n_experts_(n_experts), version_(version) {
  if (version_ < 3) return;  // no per-block family stacked
  std::unordered_map<std::string, const ParamSpec*> first;  // a family's first tensor
  for (const ParamSpec& p : table.params) {
    const std::string family = layer_family(p);
    if (family.empty()) continue;
    auto& blocks = families_[family];
    if (!blocks) blocks = std::make_shared<std::vector<int64_t>>(), first[family] = &p;
    const ParamSpec& f = *first[family];
    // One dataset: the same shape, and moments for every slot or none.
    FP8MOE_ASSERT((blocks->empty() || blocks->back() < p.layer) && p.rows == f.rows && p.cols == f.cols &&
                      p.trainable == f.trainable,
                  "checkpoint: ", p.name, " is out of block order, or unlike ", f.name);
    blocks->push_back(p.layer);
  }
}

Place DatasetLayout::place(const ParamSpec& p, int which) const {
  Place pl;
  std::string name = p.name;
  if (version_ >= 2 && p.expert >= 0) {
    name = stacked_name(p.name), pl.slot = p.expert, pl.slots = n_experts_;
  } else if (const auto it = families_.find(layer_family(p)); it != families_.end()) {  // version 3
    const std::vector<int64_t>& blocks = *it->second;
    name = it->first;
    pl.slot = std::lower_bound(blocks.begin(), blocks.end(), int64_t(p.layer)) - blocks.begin();
    pl.slots = int64_t(blocks.size());
    FP8MOE_ASSERT(pl.slot < pl.slots && blocks[size_t(pl.slot)] == p.layer, "checkpoint: ", p.name,
                  " is not in the table this layout was made from");
    pl.layers = it->second;
  }
  pl.path = which < 0 ? param_dataset(name) : moment_dataset(which, name);
  return pl;
}

std::string tensor_text(const Place& p) {
  std::string t = "dataset " + p.path;
  if (p.slot >= 0)
    t += p.layers ? ", layer " + std::to_string((*p.layers)[size_t(p.slot)]) : ", expert " + std::to_string(p.slot);
  return t;
}

std::string layers_text(const std::vector<int64_t>& layers) {
  if (layers.empty()) return "no `layers` attribute";
  bool run = true;
  for (size_t i = 1; i < layers.size(); ++i) run = run && layers[i] == layers[i - 1] + 1;
  if (run && layers.size() > 2)
    return "layers " + std::to_string(layers.front()) + "-" + std::to_string(layers.back());
  std::string t = layers.size() == 1 ? "layer " : "layers ";
  for (size_t i = 0; i < layers.size(); ++i) t += (i ? ", " : "") + std::to_string(layers[i]);
  return t;
}

// ---------------------------------------------------------------- files

namespace {

// MPI-IO hints: 128 MiB collective buffers (the default 32 MiB makes Open MPI's OMPIO write a
// 1 GB checkpoint at half speed; ROMIO reads the same standard key).
MPI_Info io_hints() {
  static const MPI_Info info = [] {
    MPI_Info i;
    MPI_CHECK(MPI_Info_create(&i));
    MPI_CHECK(MPI_Info_set(i, "cb_buffer_size", "134217728"));
    return i;
  }();
  return info;
}

// The checks a rank can make alone before opening: every rank makes them and they agree (with
// first_error) before the collective open, so that no rank is left waiting in it alone. What is
// wrong with the file at `path` ("" when it looks like HDF5); *unreadable: the problem is an I/O
// or permission error, not damage.
std::string file_problem(const std::string& path, bool* unreadable) {
  std::error_code ec;
  *unreadable = false;
  if (!fs::is_regular_file(path, ec)) {
    *unreadable = ec && ec != std::errc::no_such_file_or_directory;
    return *unreadable ? path + ": cannot read: " + ec.message() : path + ": no such file";
  }
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  char byte = 0;
  const ssize_t got = fd < 0 ? -1 : ::pread(fd, &byte, 1, 0);
  const int err = errno;
  if (fd >= 0) ::close(fd);
  if (got < 0) {
    *unreadable = true;
    return path + ": cannot read: " + std::strerror(err);
  }
  if (H5Fis_hdf5(path.c_str()) <= 0) {
    H5Eclear2(H5E_DEFAULT);
    return path + ": not an HDF5 file";
  }
  return "";
}

}  // namespace

H5Handle create_file(const std::string& path, MPI_Comm comm) {
  H5Handle fapl(h5(H5Pcreate(H5P_FILE_ACCESS), path, "H5Pcreate"), H5Pclose);
  h5(H5Pset_fapl_mpio(fapl.get(), comm, io_hints()), path, "H5Pset_fapl_mpio");
  h5(H5Pset_all_coll_metadata_ops(fapl.get(), true), path, "H5Pset_all_coll_metadata_ops");
  h5(H5Pset_coll_metadata_write(fapl.get(), true), path, "H5Pset_coll_metadata_write");
  return H5Handle(h5(H5Fcreate(path.c_str(), H5F_ACC_EXCL, H5P_DEFAULT, fapl.get()), path, "cannot create the file"),
                  H5Fclose);
}

H5Handle open_file(const std::string& path, MPI_Comm comm) {
  bool unreadable = false;
  std::string problem = file_problem(path, &unreadable);
  if (comm != MPI_COMM_NULL) {
    int kind = unreadable ? 1 : 0;
    problem = first_error(comm, problem, &kind);
    unreadable = kind == 1;
  }
  if (!problem.empty() && unreadable) throw CheckpointUnreadable(problem);
  if (!problem.empty()) throw CheckpointError(problem);
  H5Handle fapl(h5(H5Pcreate(H5P_FILE_ACCESS), path, "H5Pcreate"), H5Pclose);
  if (comm != MPI_COMM_NULL) {
    h5(H5Pset_fapl_mpio(fapl.get(), comm, io_hints()), path, "H5Pset_fapl_mpio");
    h5(H5Pset_all_coll_metadata_ops(fapl.get(), true), path, "H5Pset_all_coll_metadata_ops");
  } else {
    // A serial open reads a closed file (the tools, and every rank's read-back of a save): no
    // file lock, which file systems mounted without flock (Lustre, NFS) would refuse.
    h5(H5Pset_file_locking(fapl.get(), false, true), path, "H5Pset_file_locking");
  }
  return H5Handle(h5(H5Fopen(path.c_str(), H5F_ACC_RDONLY, fapl.get()), path, "cannot open the file"), H5Fclose);
}

H5Handle collective_xfer(const std::string& where) {
  H5Handle dxpl(h5(H5Pcreate(H5P_DATASET_XFER), where, "H5Pcreate"), H5Pclose);
  h5(H5Pset_dxpl_mpio(dxpl.get(), H5FD_MPIO_COLLECTIVE), where, "H5Pset_dxpl_mpio");
  return dxpl;
}

namespace {

// Selects `blocks` in a dataset's file space (rank 2, or 3 for a stacked dataset) and returns the
// memory space: the blocks' elements one after another. Nothing selected in either for no
// elements.
H5Handle select_blocks(hid_t space, const std::vector<Slab>& blocks, const std::string& at) {
  const int nd = H5Sget_simple_extent_ndims(space);
  hsize_t dims[3] = {0, 0, 0};
  h5(nd == 2 || nd == 3 ? H5Sget_simple_extent_dims(space, dims, nullptr) : -1, at, "unexpected rank");
  const hsize_t slots = nd == 3 ? dims[0] : 0, rows = dims[nd - 2], cols = dims[nd - 1];
  hsize_t total = 0;
  int64_t last_slot = -1;
  h5(H5Sselect_none(space), at, "H5Sselect_none");
  for (const Slab& b : blocks) {
    if (b.empty()) continue;
    FP8MOE_ASSERT((nd == 2) == (b.slot < 0) && (b.slot < 0 || (hsize_t(b.slot) < slots && (total == 0 || b.slot > last_slot))) &&
                      b.rows.r0 >= 0 && hsize_t(b.rows.r0 + b.rows.n) <= rows && b.c0 >= 0 && hsize_t(b.c0 + b.nc) <= cols &&
                      (nd == 3 || total == 0),
                  at, ": block outside the dataset, or blocks out of the file's order");
    const hsize_t start[3] = {hsize_t(b.slot), hsize_t(b.rows.r0), hsize_t(b.c0)};
    const hsize_t count[3] = {1, hsize_t(b.rows.n), hsize_t(b.nc)};
    const int skip = nd == 3 ? 0 : 1;
    h5(H5Sselect_hyperslab(space, H5S_SELECT_OR, start + skip, nullptr, count + skip, nullptr), at, "H5Sselect_hyperslab");
    total += hsize_t(b.numel()), last_slot = b.slot;
  }
  const hsize_t one = std::max<hsize_t>(total, 1);
  H5Handle mem(h5(H5Screate_simple(1, &one, nullptr), at, "H5Screate_simple"), H5Sclose);
  if (total == 0) h5(H5Sselect_none(mem.get()), at, "H5Sselect_none");
  return mem;
}

int64_t total_elements(const std::vector<Slab>& blocks) {
  int64_t n = 0;
  for (const Slab& b : blocks) n += b.numel();
  return n;
}

}  // namespace

H5Handle create_dataset(hid_t file, const std::string& path, Dt t, int64_t slots, int64_t rows, int64_t cols,
                        const std::string& where, const std::vector<int64_t>* layers) {
  const std::string at = where + ": dataset " + path;
  const hsize_t dims[3] = {hsize_t(slots), hsize_t(rows), hsize_t(cols)};
  H5Handle space(h5(slots > 0 ? H5Screate_simple(3, dims, nullptr) : H5Screate_simple(2, dims + 1, nullptr), at,
                    "H5Screate_simple"),
                 H5Sclose);
  H5Handle lcpl(h5(H5Pcreate(H5P_LINK_CREATE), at, "H5Pcreate"), H5Pclose);
  h5(H5Pset_create_intermediate_group(lcpl.get(), 1), at, "H5Pset_create_intermediate_group");
  H5Handle dcpl(h5(H5Pcreate(H5P_DATASET_CREATE), at, "H5Pcreate"), H5Pclose);
  h5(H5Pset_fill_time(dcpl.get(), H5D_FILL_TIME_NEVER), at, "H5Pset_fill_time");
  H5Handle ds(h5(H5Dcreate2(file, path.c_str(), file_type(t), space.get(), lcpl.get(), dcpl.get(), H5P_DEFAULT), at,
                 "cannot create"),
              H5Dclose);
  // The attributes now, laid out at their final size; the checksums' values come later.
  if (slots > 0) write_attr_u64s(ds.get(), "checksums", std::vector<uint64_t>(size_t(slots), 0), at);
  else write_attr_u64(ds.get(), "checksum", 0, at);
  if (t == Dt::bf16) write_attr(ds.get(), "encoding", std::string("bfloat16"), at);
  if (layers) {
    FP8MOE_ASSERT(int64_t(layers->size()) == slots, at, ": ", layers->size(), " layers for ", slots, " slots");
    write_attr_array(ds.get(), "layers", H5T_STD_I64LE, H5T_NATIVE_INT64, layers->size(), layers->data(), at);
  }
  return ds;
}

void write_blocks(hid_t ds, hid_t dxpl, Dt t, const std::vector<Slab>& blocks, const void* buf, const std::string& at) {
  H5Handle space(h5(H5Dget_space(ds), at, "H5Dget_space"), H5Sclose);
  const H5Handle mem = select_blocks(space.get(), blocks, at);
  const unsigned char dummy = 0;  // never a null buffer, even for an empty selection
  h5(H5Dwrite(ds, file_type(t), mem.get(), space.get(), dxpl, total_elements(blocks) > 0 ? buf : &dummy), at,
     "write failed");
}

void write_checksums(hid_t file, const std::string& path, const std::vector<uint64_t>& sums, const std::string& where) {
  const std::string at = where + ": dataset " + path;
  H5Handle ds(h5(H5Dopen2(file, path.c_str(), H5P_DEFAULT), at, "cannot open"), H5Dclose);
  const char* name = H5Aexists(ds.get(), "checksums") > 0 ? "checksums" : "checksum";
  H5Handle a(h5(H5Aopen(ds.get(), name, H5P_DEFAULT), at, std::string("cannot open attribute ") + name), H5Aclose);
  H5Handle space(h5(H5Aget_space(a.get()), at, "H5Aget_space"), H5Sclose);
  FP8MOE_ASSERT(H5Sget_simple_extent_npoints(space.get()) == hssize_t(sums.size()), at, ": ", sums.size(), " checksums");
  h5(H5Awrite(a.get(), H5T_NATIVE_UINT64, sums.data()), at, std::string("cannot write attribute ") + name);
}

OpenDataset open_dataset(hid_t file, const std::string& path, int64_t slots, int64_t rows, int64_t cols,
                         std::initializer_list<Dt> allowed, const std::string& where, const std::vector<int64_t>* layers) {
  OpenDataset d;
  d.at = where + ": dataset " + path;
  d.slots = slots, d.rows = rows, d.cols = cols;
  if (H5Lexists(file, path.c_str(), H5P_DEFAULT) <= 0) {
    H5Eclear2(H5E_DEFAULT);
    throw CheckpointError(d.at + " is missing");
  }
  d.ds = H5Handle(h5(H5Dopen2(file, path.c_str(), H5P_DEFAULT), d.at, "cannot open"), H5Dclose);
  H5Handle space(h5(H5Dget_space(d.ds.get()), d.at, "H5Dget_space"), H5Sclose);
  const int want_nd = slots > 0 ? 3 : 2;
  const std::vector<int64_t> want = slots > 0 ? std::vector<int64_t>{slots, rows, cols} : std::vector<int64_t>{rows, cols};
  hsize_t dims[3] = {0, 0, 0};
  const int nd = H5Sget_simple_extent_ndims(space.get());
  std::vector<int64_t> got;
  if (nd >= 1 && nd <= 3 && H5Sget_simple_extent_dims(space.get(), dims, nullptr) >= 0)
    for (int i = 0; i < nd; ++i) got.push_back(int64_t(dims[i]));
  if (nd != want_nd || got != want) {
    auto text = [](const std::vector<int64_t>& v) {
      std::string t = "(";
      for (size_t i = 0; i < v.size(); ++i) t += (i ? ", " : "") + std::to_string(v[i]);
      return t + ")";
    };
    H5Eclear2(H5E_DEFAULT);
    throw CheckpointError(d.at + ": shape " + text(got) + ", expected " + text(want));
  }
  H5Handle type(h5(H5Dget_type(d.ds.get()), d.at, "H5Dget_type"), H5Tclose);
  if (!dt_of(type.get(), &d.dt) || std::find(allowed.begin(), allowed.end(), d.dt) == allowed.end())
    throw CheckpointError(d.at + ": unexpected element type");
  d.stored_checksums = slots > 0 ? read_attr_u64s(d.ds.get(), "checksums", slots, d.at)
                                 : std::vector<uint64_t>{read_attr_u64(d.ds.get(), "checksum", d.at)};
  if (layers) {
    const std::vector<int64_t> held = read_attr_i64s(d.ds.get(), "layers", -1, d.at);
    if (held != *layers)
      throw CheckpointError(d.at + ": holds " + layers_text(held) + ", expected " + layers_text(*layers));
  }
  return d;
}

void read_blocks(const OpenDataset& d, hid_t dxpl, const std::vector<Slab>& blocks, void* buf) {
  H5Handle space(h5(H5Dget_space(d.ds.get()), d.at, "H5Dget_space"), H5Sclose);
  const H5Handle mem = select_blocks(space.get(), blocks, d.at);
  unsigned char dummy = 0;
  h5(H5Dread(d.ds.get(), file_type(d.dt), mem.get(), space.get(), dxpl, total_elements(blocks) > 0 ? buf : &dummy), d.at,
     "read failed");
}

DatasetRead read_dataset(hid_t file, hid_t dxpl, const std::string& path, int64_t rows, int64_t cols, Rows part,
                         std::initializer_list<Dt> allowed, const std::string& where) {
  const OpenDataset d = open_dataset(file, path, 0, rows, cols, allowed, where);
  DatasetRead r;
  r.dt = d.dt;
  r.stored_checksum = d.stored_checksum(-1);
  const size_t n = size_t(std::max<int64_t>(0, part.n) * cols);
  void* buf = nullptr;
  switch (r.dt) {
    case Dt::f32: r.f32.resize(n), buf = r.f32.data(); break;
    case Dt::bf16: r.bf16.resize(n), buf = r.bf16.data(); break;
    case Dt::i64: r.i64.resize(n), buf = r.i64.data(); break;
  }
  read_blocks(d, dxpl, {Slab{-1, part, 0, cols}}, buf);
  return r;
}

}  // namespace fp8moe::ckpt

namespace fp8moe {

// Declared in io/checkpoint.h.
uint64_t checksum_term(uint64_t global_index, uint64_t bits) { return ckpt::term(global_index, bits); }

}  // namespace fp8moe
