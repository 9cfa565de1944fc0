#include "io/checkpoint.h"

#include <fcntl.h>
#include <hdf5.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <sstream>
#include <utility>

#include "io/config.h"
#include "kernels/check.h"
#include "kernels/fp8.h"
#include "parallel/mpi_session.h"

namespace fp8moe {
namespace fs = std::filesystem;
namespace {

constexpr const char* kChecksumScheme =
    "sum mod 2^64 over elements of splitmix64(splitmix64(i) ^ bits), i = row-major global index, "
    "bits = the stored element's bytes as an unsigned little-endian integer";

// ---------------------------------------------------------------- HDF5 handles and errors

class H5Handle {
 public:
  H5Handle() = default;
  H5Handle(hid_t id, herr_t (*close)(hid_t)) : id_(id), close_(close) {}
  H5Handle(H5Handle&& o) noexcept : id_(std::exchange(o.id_, -1)), close_(o.close_) {}
  H5Handle& operator=(H5Handle&& o) noexcept {
    if (this != &o) {
      reset();
      id_ = std::exchange(o.id_, -1);
      close_ = o.close_;
    }
    return *this;
  }
  H5Handle(const H5Handle&) = delete;
  H5Handle& operator=(const H5Handle&) = delete;
  ~H5Handle() { reset(); }
  hid_t get() const { return id_; }
  herr_t reset() {
    const herr_t r = id_ >= 0 && close_ ? close_(id_) : 0;
    id_ = -1;
    return r;
  }

 private:
  hid_t id_ = -1;
  herr_t (*close_)(hid_t) = nullptr;
};

// The innermost and the outermost description on HDF5's error stack (then cleared).
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

// Error reports go into the exception, not to stderr.
void quiet_hdf5() { H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr); }

template <class T>
T h5(T result, const std::string& where, const std::string& what) {
  if (result < 0) throw CheckpointError(where + ": " + what + " (HDF5: " + h5_error_text() + ")");
  return result;
}

// ---------------------------------------------------------------- element types

enum class Dt { f32, bf16, i64 };

size_t dt_size(Dt t) { return t == Dt::bf16 ? 2 : t == Dt::f32 ? 4 : 8; }
const char* dt_name(Dt t) { return t == Dt::bf16 ? "bfloat16" : t == Dt::f32 ? "float32" : "int64"; }

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

bool dt_of(hid_t type, Dt* out) {
  for (Dt t : {Dt::f32, Dt::bf16, Dt::i64})
    if (H5Tequal(type, file_type(t)) > 0) return *out = t, true;
  return false;
}

// ---------------------------------------------------------------- checksums

inline uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}
inline uint64_t term(uint64_t i, uint64_t bits) { return splitmix64(splitmix64(i) ^ bits); }

// Sum of the terms of elements [0, n) of `data` (element type t), whose global indices start at
// `first`. One loop per element width, so that the compiler vectorises it.
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

uint64_t checksum_part(const void* data, Dt t, int64_t n, int64_t first) {
  switch (t) {  // little-endian host: the stored bytes as an unsigned integer
    case Dt::bf16: return checksum_u16(static_cast<const uint16_t*>(data), n, first);
    case Dt::f32: return checksum_u32(static_cast<const uint32_t*>(data), n, first);
    default: return checksum_u64(static_cast<const uint64_t*>(data), n, first);
  }
}

// The terms of rows [r0, r0 + n) x columns [c0, c0 + nc) of a tensor with `cols` columns, held
// row-major (n, nc) in data.
uint64_t checksum_block(const void* data, Dt t, int64_t r0, int64_t n, int64_t c0, int64_t nc, int64_t cols) {
  if (nc == cols) return checksum_part(data, t, n * nc, r0 * cols);
  uint64_t sum = 0;
  for (int64_t r = 0; r < n; ++r)
    sum += checksum_part(static_cast<const unsigned char*>(data) + size_t(r * nc) * dt_size(t), t, nc, (r0 + r) * cols + c0);
  return sum;
}

// ---------------------------------------------------------------- agreement between ranks

// Runs one step of a save or a load on this rank, then agrees with the other ranks of `comm`
// (MPI_COMM_NULL: this process alone): when any rank threw a CheckpointError, every rank throws
// the lowest failing rank's, of the same type (CheckpointMismatch stays one). Every step that a
// collective call follows goes through here, so that no rank goes on into it alone.
template <class Step>
void on_every_rank(MPI_Comm comm, Step&& step) {
  enum Kind : int { kNone = 0, kError = 1, kMismatch = 2 };
  int kind = kNone;
  std::string error;
  try {
    step();
  } catch (const CheckpointMismatch& e) {
    kind = kMismatch, error = e.what();
  } catch (const CheckpointError& e) {
    kind = kError, error = e.what();
  }
  if (kind != kNone && error.empty()) error = "unknown checkpoint error";  // first_error goes by the text
  if (comm != MPI_COMM_NULL) error = first_error(comm, error, &kind);
  if (error.empty()) return;
  if (kind == kMismatch) throw CheckpointMismatch(error);
  if (kind == kError) throw CheckpointError(error);
}

// Rows [r0, r0 + n) of a tensor with `rows` rows that this rank writes (and verifies): an even
// split over the ranks, every row to exactly one of them.
struct Rows {
  int64_t r0 = 0, n = 0;
};
Rows my_rows(int64_t rows, int rank, int size) {
  const RowRange r = replica_rows(rows, rank, size);  // the same split as ZeRO-1's
  return {r.begin, r.end - r.begin};
}

// ---------------------------------------------------------------- fault injection

class FaultPoint {
 public:
  explicit FaultPoint(int rank) {
    const char* v = std::getenv("FP8MOE_CKPT_KILL");
    int r = -1;
    long long k = -1;
    if (v && std::sscanf(v, "%d:%lld", &r, &k) == 2 && r == rank) k_ = k;
  }
  void hit() {
    if (k_ > 0 && ++count_ == k_) {
      std::fflush(nullptr);
      ::raise(SIGKILL);
    }
  }

 private:
  long long k_ = -1, count_ = 0;
};

// ---------------------------------------------------------------- attributes

void write_attr_raw(hid_t obj, const std::string& name, hid_t file_t, hid_t mem_t, const void* v, const std::string& where) {
  H5Handle space(h5(H5Screate(H5S_SCALAR), where, "H5Screate"), H5Sclose);
  H5Handle a(h5(H5Acreate2(obj, name.c_str(), file_t, space.get(), H5P_DEFAULT, H5P_DEFAULT), where,
                "cannot create attribute " + name),
             H5Aclose);
  h5(H5Awrite(a.get(), mem_t, v), where, "cannot write attribute " + name);
}
void write_attr(hid_t obj, const std::string& name, int64_t v, const std::string& where) {
  write_attr_raw(obj, name, H5T_STD_I64LE, H5T_NATIVE_INT64, &v, where);
}
void write_attr_u64(hid_t obj, const std::string& name, uint64_t v, const std::string& where) {
  write_attr_raw(obj, name, H5T_STD_U64LE, H5T_NATIVE_UINT64, &v, where);
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

H5Handle open_attr(hid_t obj, const std::string& name, const std::string& where) {
  if (H5Aexists(obj, name.c_str()) <= 0) throw CheckpointError(where + ": attribute " + name + " is missing");
  return H5Handle(h5(H5Aopen(obj, name.c_str(), H5P_DEFAULT), where, "cannot open attribute " + name), H5Aclose);
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

// ---------------------------------------------------------------- files

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

H5Handle create_file(const std::string& path, MPI_Comm comm) {
  H5Handle fapl(h5(H5Pcreate(H5P_FILE_ACCESS), path, "H5Pcreate"), H5Pclose);
  h5(H5Pset_fapl_mpio(fapl.get(), comm, io_hints()), path, "H5Pset_fapl_mpio");
  h5(H5Pset_all_coll_metadata_ops(fapl.get(), true), path, "H5Pset_all_coll_metadata_ops");
  h5(H5Pset_coll_metadata_write(fapl.get(), true), path, "H5Pset_coll_metadata_write");
  return H5Handle(h5(H5Fcreate(path.c_str(), H5F_ACC_EXCL, H5P_DEFAULT, fapl.get()), path, "cannot create the file"),
                  H5Fclose);
}

// The checks a rank can make alone before opening: every rank makes them and they agree (with
// first_error) before the collective open, so that no rank is left waiting in it alone.
std::string file_problem(const std::string& path) {
  std::error_code ec;
  if (!fs::is_regular_file(path, ec)) return path + ": no such file";
  if (H5Fis_hdf5(path.c_str()) <= 0) {
    H5Eclear2(H5E_DEFAULT);
    return path + ": not an HDF5 file (or not readable)";
  }
  return "";
}

// comm == MPI_COMM_NULL: a serial open (the tools), else collective over comm.
H5Handle open_file(const std::string& path, MPI_Comm comm) {
  std::string problem = file_problem(path);
  if (comm != MPI_COMM_NULL) problem = first_error(comm, problem);
  if (!problem.empty()) throw CheckpointError(problem);
  H5Handle fapl(h5(H5Pcreate(H5P_FILE_ACCESS), path, "H5Pcreate"), H5Pclose);
  if (comm != MPI_COMM_NULL) {
    h5(H5Pset_fapl_mpio(fapl.get(), comm, io_hints()), path, "H5Pset_fapl_mpio");
    h5(H5Pset_all_coll_metadata_ops(fapl.get(), true), path, "H5Pset_all_coll_metadata_ops");
  }
  return H5Handle(h5(H5Fopen(path.c_str(), H5F_ACC_RDONLY, fapl.get()), path, "cannot open the file"), H5Fclose);
}

H5Handle collective_xfer(const std::string& where) {
  H5Handle dxpl(h5(H5Pcreate(H5P_DATASET_XFER), where, "H5Pcreate"), H5Pclose);
  h5(H5Pset_dxpl_mpio(dxpl.get(), H5FD_MPIO_COLLECTIVE), where, "H5Pset_dxpl_mpio");
  return dxpl;
}

// One dataset of a save: a whole (rows, cols) tensor held by this rank.
struct Tensor {
  std::string path;
  Dt dt = Dt::f32;
  int64_t rows = 1, cols = 1;  // the global shape
  const void* data = nullptr;  // this rank's block: rows [row0, ...) x columns [c0, c0 + nc), row-major
  int64_t row0 = 0;
  Rows mine;                   // the rows of the block this rank writes
  int64_t c0 = 0, nc = -1;     // nc -1: every column
  int64_t width() const { return nc < 0 ? cols : nc; }
  const unsigned char* at(int64_t row) const {
    return static_cast<const unsigned char*>(data) + size_t((row - row0) * width()) * dt_size(dt);
  }
};

// Creates the dataset with its checksum attribute and writes this rank's rows (collective).
void write_dataset(hid_t file, hid_t dxpl, const Tensor& t, uint64_t checksum, const std::string& where) {
  const Rows mine = t.mine;
  const std::string at = where + ": dataset " + t.path;
  const hsize_t dims[2] = {hsize_t(t.rows), hsize_t(t.cols)};
  H5Handle space(h5(H5Screate_simple(2, dims, nullptr), at, "H5Screate_simple"), H5Sclose);
  H5Handle lcpl(h5(H5Pcreate(H5P_LINK_CREATE), at, "H5Pcreate"), H5Pclose);
  h5(H5Pset_create_intermediate_group(lcpl.get(), 1), at, "H5Pset_create_intermediate_group");
  H5Handle dcpl(h5(H5Pcreate(H5P_DATASET_CREATE), at, "H5Pcreate"), H5Pclose);
  h5(H5Pset_fill_time(dcpl.get(), H5D_FILL_TIME_NEVER), at, "H5Pset_fill_time");
  H5Handle ds(h5(H5Dcreate2(file, t.path.c_str(), file_type(t.dt), space.get(), lcpl.get(), dcpl.get(), H5P_DEFAULT), at,
                 "cannot create"),
              H5Dclose);
  write_attr_u64(ds.get(), "checksum", checksum, at);
  if (t.dt == Dt::bf16) write_attr(ds.get(), "encoding", std::string("bfloat16"), at);
  const hsize_t start[2] = {hsize_t(mine.r0), hsize_t(t.c0)}, count[2] = {hsize_t(mine.n), hsize_t(t.width())};
  H5Handle mem(h5(H5Screate_simple(2, mine.n > 0 ? count : dims, nullptr), at, "H5Screate_simple"), H5Sclose);
  const unsigned char dummy = 0;
  const void* buf = &dummy;
  if (mine.n > 0 && t.width() > 0) {
    h5(H5Sselect_hyperslab(space.get(), H5S_SELECT_SET, start, nullptr, count, nullptr), at, "H5Sselect_hyperslab");
    buf = t.at(mine.r0);
  } else {
    h5(H5Sselect_none(space.get()), at, "H5Sselect_none");
    h5(H5Sselect_none(mem.get()), at, "H5Sselect_none");
  }
  h5(H5Dwrite(ds.get(), file_type(t.dt), mem.get(), space.get(), dxpl, buf), at, "write failed");
}

struct DatasetRead {
  Dt dt = Dt::f32;
  uint64_t stored_checksum = 0;
  // The whole tensor as stored, in the vector of its type.
  std::vector<float> f32;
  std::vector<uint16_t> bf16;
  std::vector<int64_t> i64;
  void* dest = nullptr;  // set when read into the caller's buffer instead
  const void* data() const {
    if (dest) return dest;
    return dt == Dt::f32 ? static_cast<const void*>(f32.data())
                         : dt == Dt::bf16 ? static_cast<const void*>(bf16.data()) : static_cast<const void*>(i64.data());
  }
};

// Reads rows [part.r0, part.r0 + part.n) x columns [c0, c0 + nc) of a (rows, cols) dataset in its
// stored element type (no conversion: collective transfers stay collective). `allowed` lists the
// types it may have. When it is stored as dest_dt and dest is set, the data goes straight into
// dest (part.n x nc).
DatasetRead read_dataset(hid_t file, hid_t dxpl, const std::string& path, int64_t rows, int64_t cols, Rows part,
                         int64_t c0, int64_t nc, std::initializer_list<Dt> allowed, const std::string& where, Dt dest_dt,
                         void* dest) {
  const std::string at = where + ": dataset " + path;
  if (H5Lexists(file, path.c_str(), H5P_DEFAULT) <= 0) {
    H5Eclear2(H5E_DEFAULT);
    throw CheckpointError(at + " is missing");
  }
  H5Handle ds(h5(H5Dopen2(file, path.c_str(), H5P_DEFAULT), at, "cannot open"), H5Dclose);
  H5Handle space(h5(H5Dget_space(ds.get()), at, "H5Dget_space"), H5Sclose);
  hsize_t dims[2] = {0, 0};
  if (H5Sget_simple_extent_ndims(space.get()) != 2 || H5Sget_simple_extent_dims(space.get(), dims, nullptr) < 0 ||
      int64_t(dims[0]) != rows || int64_t(dims[1]) != cols)
    throw CheckpointError(at + ": shape (" + std::to_string(dims[0]) + ", " + std::to_string(dims[1]) +
                          "), expected (" + std::to_string(rows) + ", " + std::to_string(cols) + ")");
  H5Handle type(h5(H5Dget_type(ds.get()), at, "H5Dget_type"), H5Tclose);
  DatasetRead r;
  if (!dt_of(type.get(), &r.dt) || std::find(allowed.begin(), allowed.end(), r.dt) == allowed.end())
    throw CheckpointError(at + ": unexpected element type");
  r.stored_checksum = read_attr_u64(ds.get(), "checksum", at);
  const size_t n = size_t(part.n * nc);
  const hsize_t start[2] = {hsize_t(part.r0), hsize_t(c0)}, count[2] = {hsize_t(part.n), hsize_t(nc)};
  H5Handle mem(h5(H5Screate_simple(2, part.n > 0 ? count : dims, nullptr), at, "H5Screate_simple"), H5Sclose);
  if (n > 0) {
    h5(H5Sselect_hyperslab(space.get(), H5S_SELECT_SET, start, nullptr, count, nullptr), at, "H5Sselect_hyperslab");
  } else {
    h5(H5Sselect_none(space.get()), at, "H5Sselect_none");
    h5(H5Sselect_none(mem.get()), at, "H5Sselect_none");
  }
  void* buf = nullptr;
  if (dest && r.dt == dest_dt && n > 0) {
    r.dest = dest;
    h5(H5Dread(ds.get(), file_type(r.dt), mem.get(), space.get(), dxpl, dest), at, "read failed");
    return r;
  }
  switch (r.dt) {
    case Dt::f32: r.f32.resize(n + 1), buf = r.f32.data(); break;  // + 1: never a null buffer
    case Dt::bf16: r.bf16.resize(n + 1), buf = r.bf16.data(); break;
    case Dt::i64: r.i64.resize(n + 1), buf = r.i64.data(); break;
  }
  h5(H5Dread(ds.get(), file_type(r.dt), mem.get(), space.get(), dxpl, buf), at, "read failed");
  r.f32.resize(r.f32.empty() ? 0 : n), r.bf16.resize(r.bf16.empty() ? 0 : n), r.i64.resize(r.i64.empty() ? 0 : n);
  return r;
}

// ---------------------------------------------------------------- file system

void fsync_path(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw CheckpointError(path + ": cannot open for fsync: " + std::strerror(errno));
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0) throw CheckpointError(path + ": fsync failed: " + std::strerror(err));
}

const std::regex& step_dir_pattern() {
  static const std::regex re("step_([0-9]{8})");
  return re;
}

// Committed checkpoints of a directory, newest (highest step) first.
std::vector<std::pair<int64_t, std::string>> committed_checkpoints(const std::string& dir) {
  std::vector<std::pair<int64_t, std::string>> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    std::smatch m;
    const std::string name = e.path().filename().string();
    if (e.is_directory(ec) && std::regex_match(name, m, step_dir_pattern())) out.emplace_back(std::stoll(m[1]), name);
  }
  std::sort(out.rbegin(), out.rend());
  return out;
}

// What <dir>/latest names ("" when missing), and a complaint when it is not a checkpoint.
std::string read_latest(const std::string& dir, std::string* problem) {
  const std::string path = dir + "/latest";
  std::error_code ec;
  if (!fs::exists(path, ec)) return *problem = path + " does not exist", "";
  std::ifstream in(path);
  std::string name;
  std::getline(in, name);
  if (!std::regex_match(name, step_dir_pattern()) || !fs::is_directory(dir + "/" + name, ec)) {
    std::string shown = name.substr(0, 40);
    for (char& c : shown)
      if (c < 32 || c > 126) c = '?';
    return *problem = path + " does not name a checkpoint directory (it holds \"" + shown + "\")", "";
  }
  return name;
}

// ---------------------------------------------------------------- config comparison

// Flattens config_to_yaml's output into "a.b.c" -> "value".
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

// The model keys that differ ("model.d_model: checkpoint 256, config 128"); model.init_std only
// matters at initialisation and may differ.
std::vector<std::string> model_differences(const Config& stored, const Config& current) {
  const auto a = flat_yaml(config_to_yaml(stored)), b = flat_yaml(config_to_yaml(current));
  std::vector<std::string> diff;
  for (const auto& [k, v] : a)
    if (k.rfind("model.", 0) == 0 && k != "model.init_std" && b.count(k) && b.at(k) != v)
      diff.push_back(k + ": checkpoint " + v + ", config " + b.at(k));
  return diff;
}

Config stored_config(hid_t file, const std::string& where) {
  const std::string yaml = read_attr_str(file, "config", where);
  try {
    return load_config(ConfigSource{where + " (stored config)", yaml, {}}, 0);
  } catch (const std::exception& e) {
    throw CheckpointError(where + ": the stored config is not valid: " + e.what());
  }
}

void check_version(hid_t file, const std::string& where) {
  const int64_t v = read_attr_i64(file, "format_version", where);
  if (v != kCheckpointFormatVersion)
    throw CheckpointError(where + ": format version " + std::to_string(v) + ", this build reads version " +
                          std::to_string(kCheckpointFormatVersion));
}

// ---------------------------------------------------------------- delayed-scaling state

const char* const kScalingFields[3] = {"x", "w", "dy"};

DelayedScaling& scaling_field(LinearScaling& s, int f) { return f == 0 ? s.x : f == 1 ? s.w : s.dy; }
const DelayedScaling& scaling_field(const LinearScaling& s, int f) { return f == 0 ? s.x : f == 1 ? s.w : s.dy; }

struct ScalingArrays {
  std::vector<std::string> names;  // "<weight>.<x|w|dy>"
  int64_t len = 0;
  std::vector<float> history, scale;  // (n, len), (n, 2)
  std::vector<int64_t> steps;         // (n, 1)
};

// Every rank's delayed-scaling entries of the weights it holds, merged (replicas hold identical
// copies: their amax values are reduced): each rank serialises its own, one allgather. Collective.
std::map<std::string, LinearScaling> gather_scaling(MPI_Comm comm, Transformer& model) {
  std::string mine;
  auto put = [&](const void* p, size_t n) { mine.append(static_cast<const char*>(p), n); };
  for (auto& [weight, s] : model.fp8_scaling()) {
    const int64_t i = model.table().index_of(weight);
    if (i < 0 || !model.holds(size_t(i))) continue;
    for (int f = 0; f < 3; ++f) {
      const DelayedScaling& d = scaling_field(s, f);
      if (d.history.empty()) continue;  // never recorded
      const int64_t len = int64_t(d.history.size()), n = int64_t(weight.size());
      put(&n, 8), put(weight.data(), weight.size()), put(&f, sizeof f), put(&len, 8);
      put(d.history.data(), size_t(len) * 4), put(&d.steps, 8), put(&d.scale, 4), put(&d.last_used, 4);
    }
  }
  int size = 1;
  MPI_CHECK(MPI_Comm_size(comm, &size));
  int len = int(mine.size());
  std::vector<int> lens(static_cast<size_t>(size)), offs(static_cast<size_t>(size), 0);
  MPI_CHECK(MPI_Allgather(&len, 1, MPI_INT, lens.data(), 1, MPI_INT, comm));
  for (int r = 1; r < size; ++r) offs[size_t(r)] = offs[size_t(r - 1)] + lens[size_t(r - 1)];
  std::string all(size_t(offs.back() + lens.back()), '\0');
  MPI_CHECK(MPI_Allgatherv(mine.data(), len, MPI_CHAR, all.data(), lens.data(), offs.data(), MPI_CHAR, comm));
  std::map<std::string, LinearScaling> merged;
  for (size_t at = 0; at < all.size();) {
    auto get = [&](void* p, size_t n) { std::memcpy(p, all.data() + at, n), at += n; };
    int64_t n = 0, hl = 0;
    int f = 0;
    get(&n, 8);
    std::string weight(all.data() + at, size_t(n));
    at += size_t(n);
    get(&f, sizeof f), get(&hl, 8);
    DelayedScaling d;
    d.history.resize(size_t(hl));
    get(d.history.data(), size_t(hl) * 4), get(&d.steps, 8), get(&d.scale, 4), get(&d.last_used, 4);
    scaling_field(merged[weight], f) = std::move(d);  // a replica's copy: the same values
  }
  return merged;
}

ScalingArrays pack_scaling(const std::map<std::string, LinearScaling>& state) {
  ScalingArrays a;
  for (auto& [weight, s] : state)
    for (int f = 0; f < 3; ++f) {
      const DelayedScaling& d = scaling_field(s, f);
      if (d.history.empty()) continue;
      FP8MOE_ASSERT(a.len == 0 || int64_t(d.history.size()) == a.len, "amax histories of different lengths");
      a.len = int64_t(d.history.size());
      a.names.push_back(weight + "." + kScalingFields[f]);
      a.history.insert(a.history.end(), d.history.begin(), d.history.end());
      a.scale.push_back(d.scale);
      a.scale.push_back(d.last_used);
      a.steps.push_back(d.steps);
    }
  return a;
}

std::string join_lines(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& x : v) s += x + "\n";
  return s;
}

// ---------------------------------------------------------------- the load

// What a load reads. The tensors go straight into their destinations (no second copy of the
// model in memory); everything else is applied only when the whole load verified. After a failed
// load the destinations hold a mix: the caller loads another checkpoint over them or stops.
struct Staged {
  Config stored;
  std::vector<std::vector<float>>* params = nullptr;  // sized here for a weights-only load
  AdamW* opt = nullptr;                                // nullptr: no optimizer state (generation)
  const Transformer* model = nullptr;                  // which parameters are held (nullptr: all)
  std::vector<RowRange> write_rows, moment_rows;       // as TrainerState's (empty: the defaults)
  std::map<std::string, LinearScaling> scaling;
  bool have_scaling = false;
  std::string note;  // said by rank 0 after the load
  size_t verified = 0;  // datasets whose checksum was compared
  TrainProgress progress;
  float loss_scale = 1;
  int64_t good_steps = 0, updates = 0, skipped = 0;
};

// Reads one checkpoint into `st` (collective over comm; MPI_COMM_NULL: serial, this process holds
// everything). The checksums are checked over this rank's rows and summed over the ranks.
void load_into(const std::string& dir, MPI_Comm comm, const Config* current, Staged* st) {
  quiet_hdf5();
  int rank = 0, size = 1;
  if (comm != MPI_COMM_NULL) {
    MPI_CHECK(MPI_Comm_rank(comm, &rank));
    MPI_CHECK(MPI_Comm_size(comm, &size));
  }
  const std::string path = dir + "/" + kCheckpointFile;
  H5Handle file, dxpl;
  // Phase 1: open, attributes, config (the same on every rank; still agreed on).
  on_every_rank(comm, [&] {
    file = open_file(path, comm);
    if (comm != MPI_COMM_NULL) dxpl = collective_xfer(path);
    check_version(file.get(), path);
    st->stored = stored_config(file.get(), path);
    st->progress.step = read_attr_i64(file.get(), "step", path);
    st->progress.samples = read_attr_i64(file.get(), "samples", path);
    st->progress.tokens = read_attr_i64(file.get(), "tokens", path);
    st->progress.last_val_loss = read_attr_f64(file.get(), "last_val_loss", path);
    st->loss_scale = float(read_attr_f64(file.get(), "loss_scale", path));
    st->good_steps = read_attr_i64(file.get(), "loss_scale_good_steps", path);
    st->updates = read_attr_i64(file.get(), "adam_updates", path);
    st->skipped = read_attr_i64(file.get(), "adam_skipped", path);
    if (current) {
      const auto diff = model_differences(st->stored, *current);
      if (!diff.empty()) {
        std::string m = path + ": the checkpoint is of another model; differing keys:";
        for (const auto& d : diff) m += "\n  " + d;
        throw CheckpointMismatch(m);
      }
    }
  });

  const Config& cfg = current ? *current : st->stored;
  const ParamTable table = build_param_table(cfg.model);
  const hid_t xfer = comm != MPI_COMM_NULL ? dxpl.get() : H5P_DEFAULT;
  std::vector<std::string> names;
  std::vector<uint64_t> stored, partial;
  // One dataset: read, keep this rank's checksum part, agree that every rank read it.
  // part: the rows to read (default: all); mine: the rows whose checksum terms this rank adds
  // (default: its even share; they must lie inside part and cover the tensor once over the ranks).
  // (c0, nc): the columns (nc -1: all).
  auto read = [&](const std::string& dpath, int64_t rows, int64_t cols, std::initializer_list<Dt> allowed,
                  Dt dest_dt = Dt::f32, void* dest = nullptr, Rows part = {-1, 0}, Rows mine = {-1, 0},
                  int64_t c0 = 0, int64_t nc = -1) {
    if (part.r0 < 0) part = {0, rows};
    if (mine.r0 < 0) mine = comm != MPI_COMM_NULL ? my_rows(rows, rank, size) : Rows{0, rows};
    if (nc < 0) nc = cols;
    DatasetRead r;
    on_every_rank(comm, [&] {
      r = read_dataset(file.get(), xfer, dpath, rows, cols, part, c0, nc, allowed, path, dest_dt, dest);
      names.push_back(dpath);
      stored.push_back(r.stored_checksum);
      partial.push_back(mine.n == 0 ? 0
                                    : checksum_block(static_cast<const unsigned char*>(r.data()) +
                                                         size_t((mine.r0 - part.r0) * nc) * dt_size(r.dt),
                                                     r.dt, mine.r0, mine.n, c0, nc, cols));
    });
    return r;
  };

  auto& params = *st->params;
  params.resize(table.params.size());
  auto rows_of = [](RowRange r) { return Rows{r.begin, r.end - r.begin}; };
  // This rank's block of each parameter (the whole tensor without a model: generation).
  auto shard = [&](size_t i) { return st->model ? st->model->shard(i) : Shard{0, table.params[i].rows, 0, table.params[i].cols}; };
  for (size_t i = 0; i < table.params.size(); ++i) {
    const ParamSpec& p = table.params[i];
    const Shard sh = shard(i);
    params[i].resize(size_t(sh.numel()));
    read("/params/" + p.name, p.rows, p.cols, {Dt::f32}, Dt::f32, params[i].data(),
         sh.held() ? Rows{sh.r0, sh.rows} : Rows{0, 0},
         !sh.held() ? Rows{0, 0} : st->write_rows.empty() ? Rows{-1, 0} : rows_of(st->write_rows[i]), sh.c0, sh.cols);
  }
  if (st->opt) {
    AdamW& opt = *st->opt;
    const bool bf16 = opt.bf16_moments();
    for (size_t i = 0; i < table.params.size(); ++i) {
      const ParamSpec& p = table.params[i];
      if (!p.trainable) continue;
      for (int which = 0; which < 2; ++which) {
        // The rows of this rank's block its optimizer owns (all of them without ZeRO).
        const Shard sh = shard(i);
        const RowRange o = opt.owned(i);
        const Rows part{sh.r0 + o.begin, o.end - o.begin};
        const size_t n = size_t(part.n * sh.cols);
        auto& m32 = opt.moment_fp32(which, i);
        auto& m16 = opt.moment_bf16(which, i);
        FP8MOE_ASSERT((bf16 ? m16.size() : m32.size()) == n, "moments of ", p.name, " not allocated");
        const DatasetRead r = read(std::string(which == 0 ? "/optim/m/" : "/optim/v/") + p.name, p.rows, p.cols,
                                   {Dt::f32, Dt::bf16}, bf16 ? Dt::bf16 : Dt::f32,
                                   bf16 ? static_cast<void*>(m16.data()) : static_cast<void*>(m32.data()), part,
                                   !st->moment_rows.empty() ? rows_of(st->moment_rows[i])
                                   : opt.sharded()          ? part
                                                            : Rows{-1, 0},
                                   sh.c0, sh.cols);
        // Stored in the other dtype than train.moments_dtype: decode exactly, encode round-to-nearest-even.
        if (bf16 && r.dt == Dt::f32)
          for (size_t j = 0; j < n; ++j) m16[j] = bf16_encode(r.f32[j]);
        else if (!bf16 && r.dt == Dt::bf16)
          for (size_t j = 0; j < n; ++j) m32[j] = bf16_decode(r.bf16[j]);
      }
    }
    // Delayed scaling: used when this run uses delayed scaling with the same history length.
    const bool has_fp8 = H5Lexists(file.get(), "/fp8", H5P_DEFAULT) > 0;
    H5Eclear2(H5E_DEFAULT);
    if (has_fp8 && cfg.fp8.recipe == Fp8Recipe::delayed) {
      std::string tensors;
      int64_t len = 0;
      on_every_rank(comm, [&] {
        H5Handle g(h5(H5Gopen2(file.get(), "/fp8", H5P_DEFAULT), path, "cannot open group /fp8"), H5Gclose);
        tensors = read_attr_str(g.get(), "tensors", path + ": /fp8");
        len = read_attr_i64(g.get(), "history_len", path + ": /fp8");
      });
      std::vector<std::string> tnames;
      std::istringstream in(tensors);
      for (std::string line; std::getline(in, line);) tnames.push_back(line);
      const int64_t n = int64_t(tnames.size());
      if (len == cfg.fp8.amax_history_len) {
        DatasetRead h = read("/fp8/amax_history", n, len, {Dt::f32});
        DatasetRead s = read("/fp8/scale", n, 2, {Dt::f32});
        DatasetRead k = read("/fp8/steps", n, 1, {Dt::i64});
        for (int64_t i = 0; i < n; ++i) {
          const std::string& full = tnames[size_t(i)];
          const size_t dot = full.rfind('.');
          const std::string field = dot == std::string::npos ? "" : full.substr(dot + 1);
          const int f = field == "x" ? 0 : field == "w" ? 1 : field == "dy" ? 2 : -1;
          if (f < 0) throw CheckpointError(path + ": /fp8 names an unknown tensor \"" + full + "\"");
          const int64_t w = table.index_of(full.substr(0, dot));
          if (w < 0 || (st->model && !st->model->holds(size_t(w)))) continue;  // not a weight of this rank
          DelayedScaling& d = scaling_field(st->scaling[full.substr(0, dot)], f);
          d.history.resize(size_t(len));
          std::copy_n(h.f32.begin() + i * len, len, d.history.begin());
          d.scale = s.f32[size_t(i * 2)];
          d.last_used = s.f32[size_t(i * 2 + 1)];
          d.steps = k.i64[size_t(i)];
        }
        st->have_scaling = true;
      } else {
        st->note = "note: the checkpoint's amax histories have length " + std::to_string(len) +
                   ", fp8.amax_history_len is " + std::to_string(cfg.fp8.amax_history_len) +
                   ": delayed scaling starts afresh";
      }
    }
  }
  // The checksums, summed over the ranks that each checked a part.
  if (comm != MPI_COMM_NULL)
    MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, partial.data(), int(partial.size()), MPI_UINT64_T, MPI_SUM, comm));
  for (size_t i = 0; i < names.size(); ++i) {
    if (partial[i] != stored[i]) {
      char buf[96];
      std::snprintf(buf, sizeof buf, " (stored %016llx, computed %016llx)", (unsigned long long)stored[i],
                    (unsigned long long)partial[i]);
      throw CheckpointError(path + ": dataset " + names[i] + ": checksum mismatch: the data is corrupt" + buf);
    }
    ++st->verified;
  }
}

// The state besides the tensors (those are in place already).
void apply(Staged& st, const TrainerState& s) {
  s.opt->restore_counts(st.updates, st.skipped);
  // A fixed or absent loss scale comes from the config; a dynamic one continues.
  if (s.cfg->train.loss_scale.mode == LossScaleMode::dynamic && st.stored.train.loss_scale.mode == LossScaleMode::dynamic)
    s.scaler->restore(st.loss_scale, st.good_steps);
  s.model->fp8_scaling().clear();
  if (st.have_scaling) s.model->fp8_scaling() = std::move(st.scaling);
  *s.progress = st.progress;
}

}  // namespace

uint64_t checksum_term(uint64_t global_index, uint64_t bits) { return term(global_index, bits); }

std::string checkpoint_name(int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "step_%08lld", (long long)step);
  return buf;
}

std::string save_checkpoint(MPI_Comm comm, const TrainerState& s) {
  quiet_hdf5();
  int rank = 0, size = 1;
  MPI_CHECK(MPI_Comm_rank(comm, &rank));
  MPI_CHECK(MPI_Comm_size(comm, &size));
  const Config& cfg = *s.cfg;
  const std::string dir = cfg.checkpoint.dir, name = checkpoint_name(s.progress->step);
  const std::string final_dir = dir + "/" + name, tmp_dir = final_dir + ".tmp";
  const std::string path = tmp_dir + "/" + kCheckpointFile;
  FaultPoint fault(rank);

  on_every_rank(comm, [&] {
    if (rank != 0) return;
    std::error_code ec;
    fs::create_directories(dir, ec);
    if (!ec) fs::remove_all(tmp_dir, ec);  // a crashed earlier save of this step
    if (!ec) fs::create_directory(tmp_dir, ec);
    if (ec) throw CheckpointError(tmp_dir + ": cannot create: " + ec.message());
  });

  // The datasets, in file order, and their checksums (each rank sums its rows; one allreduce).
  const ParamTable& table = s.model->table();
  std::vector<Tensor> tensors;
  auto whole = [&](std::string path, Dt dt, int64_t rows, int64_t cols, const void* data) {
    tensors.push_back({std::move(path), dt, rows, cols, data, 0, my_rows(rows, rank, size)});
  };
  auto rows_of = [](RowRange r) { return Rows{r.begin, r.end - r.begin}; };
  for (size_t i = 0; i < table.params.size(); ++i) {
    const ParamSpec& p = table.params[i];
    const Shard& sh = s.model->shard(i);
    const Rows mine = !sh.held() ? Rows{0, 0}
                      : s.write_rows.empty() ? my_rows(p.rows, rank, size)
                                             : rows_of(s.write_rows[i]);
    tensors.push_back({"/params/" + p.name, Dt::f32, p.rows, p.cols, s.model->params()[i].data(), sh.r0, mine, sh.c0, sh.cols});
  }
  for (int w = 0; w < 2; ++w)
    for (size_t i = 0; i < table.params.size(); ++i) {
      const ParamSpec& p = table.params[i];
      if (!p.trainable) continue;
      const std::string dpath = std::string(w == 0 ? "/optim/m/" : "/optim/v/") + p.name;
      const void* data = s.opt->bf16_moments() ? static_cast<const void*>(s.opt->moment_bf16(w, i).data())
                                               : static_cast<const void*>(s.opt->moment_fp32(w, i).data());
      const Dt dt = s.opt->bf16_moments() ? Dt::bf16 : Dt::f32;
      // The moments hold the optimizer's owned rows of this rank's block (global rows sh.r0 + ...);
      // sharded (ZeRO-1), each rank writes those.
      const Shard& sh = s.model->shard(i);
      const RowRange o = s.opt->owned(i);
      const Rows mine = !s.moment_write_rows.empty() ? rows_of(s.moment_write_rows[i])
                        : s.opt->sharded()           ? Rows{sh.r0 + o.begin, o.end - o.begin}
                                                     : my_rows(p.rows, rank, size);
      FP8MOE_ASSERT(mine.n == 0 || (mine.r0 >= sh.r0 + o.begin && mine.r0 + mine.n <= sh.r0 + o.end), "checkpoint: ",
                    dpath, " rows to write outside the optimizer's rows");
      tensors.push_back({dpath, dt, p.rows, p.cols, data, sh.r0 + o.begin, mine, sh.c0, sh.cols});
    }
  const ScalingArrays sc = pack_scaling(gather_scaling(comm, *s.model));
  const int64_t n_sc = int64_t(sc.names.size());
  if (n_sc > 0) {
    whole("/fp8/amax_history", Dt::f32, n_sc, sc.len, sc.history.data());
    whole("/fp8/scale", Dt::f32, n_sc, 2, sc.scale.data());
    whole("/fp8/steps", Dt::i64, n_sc, 1, sc.steps.data());
  }
  std::vector<uint64_t> sums(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const Tensor& t = tensors[i];
    sums[i] = t.mine.n > 0 ? checksum_block(t.at(t.mine.r0), t.dt, t.mine.r0, t.mine.n, t.c0, t.width(), t.cols) : 0;
  }
  MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, sums.data(), int(sums.size()), MPI_UINT64_T, MPI_SUM, comm));

  std::string created;
  if (rank == 0) {
    const std::time_t now = std::time(nullptr);
    char when[32];
    std::strftime(when, sizeof when, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
    created = when;
  }
  broadcast_string(comm, created, 0);

  // Write (every rank, collectively), agreeing after every dataset so that no rank goes on alone.
  {
    H5Handle file, dxpl;
    on_every_rank(comm, [&] {
      file = create_file(path, comm);
      dxpl = collective_xfer(path);
      const hid_t f = file.get();
      const TrainProgress& pr = *s.progress;
      write_attr(f, "format_version", int64_t(kCheckpointFormatVersion), path);
      write_attr(f, "step", pr.step, path);
      write_attr(f, "samples", pr.samples, path);
      write_attr(f, "tokens", pr.tokens, path);
      write_attr(f, "seed", int64_t(cfg.train.seed), path);
      write_attr(f, "last_val_loss", pr.last_val_loss, path);
      write_attr(f, "loss_scale", double(s.scaler->scale()), path);
      write_attr(f, "loss_scale_good_steps", s.scaler->good_steps(), path);
      write_attr(f, "adam_updates", s.opt->updates(), path);
      write_attr(f, "adam_skipped", s.opt->skipped(), path);
      write_attr(f, "config", config_to_yaml(cfg), path);
      write_attr(f, "layout", s.layout, path);
      write_attr(f, "code_version", std::string("fp8moe " FP8MOE_VERSION), path);
      write_attr(f, "checksum_scheme", std::string(kChecksumScheme), path);
      write_attr(f, "created", created, path);  // rank 0's clock: attribute data must agree
    });
    for (size_t i = 0; i < tensors.size(); ++i) {
      on_every_rank(comm, [&] {
        write_dataset(file.get(), dxpl.get(), tensors[i], sums[i], path);
        if (i + 1 == tensors.size() && n_sc > 0) {
          H5Handle g(h5(H5Gopen2(file.get(), "/fp8", H5P_DEFAULT), path, "cannot open group /fp8"), H5Gclose);
          write_attr(g.get(), "tensors", join_lines(sc.names), path + ": /fp8");
          write_attr(g.get(), "history_len", sc.len, path + ": /fp8");
        }
      });
      fault.hit();
    }
    on_every_rank(comm, [&] {  // every rank wrote and closed
      dxpl.reset();
      const bool closed = file.reset() >= 0;
      fault.hit();
      if (!closed) throw CheckpointError(path + ": closing the file failed (HDF5: " + h5_error_text() + ")");
    });
  }

  // Commit (rank 0): fsync, rename, fsync the directory, replace `latest`, prune.
  on_every_rank(comm, [&] {
    if (rank != 0) return;
    try {
      fault.hit();
      fsync_path(path);
      fsync_path(tmp_dir);
      fault.hit();
      std::error_code ec;
      if (fs::exists(final_dir, ec)) {
        // Re-saving a step that exists (a resumed run): swap atomically, then drop the old copy.
        if (::renameat2(AT_FDCWD, tmp_dir.c_str(), AT_FDCWD, final_dir.c_str(), RENAME_EXCHANGE) != 0)
          throw CheckpointError(final_dir + ": cannot replace: " + std::strerror(errno));
        fs::remove_all(tmp_dir, ec);
      } else if (::rename(tmp_dir.c_str(), final_dir.c_str()) != 0) {
        throw CheckpointError(tmp_dir + ": cannot rename to " + final_dir + ": " + std::strerror(errno));
      }
      fault.hit();
      fsync_path(dir);
      fault.hit();
      const std::string latest = dir + "/latest", latest_tmp = latest + ".tmp";
      {
        std::ofstream out(latest_tmp, std::ios::trunc);
        out << name << "\n";
        out.flush();
        if (!out) throw CheckpointError(latest_tmp + ": cannot write");
      }
      fsync_path(latest_tmp);
      fault.hit();
      if (::rename(latest_tmp.c_str(), latest.c_str()) != 0)
        throw CheckpointError(latest_tmp + ": cannot rename to " + latest + ": " + std::strerror(errno));
      fsync_path(dir);
      fault.hit();
      // Only now: checkpoints beyond keep_last (oldest first; never the one just committed), and
      // leftovers of crashed saves.
      auto all = committed_checkpoints(dir);
      for (size_t i = all.size(); i-- > size_t(cfg.checkpoint.keep_last);) {
        if (all[i].second == name) continue;
        fs::remove_all(dir + "/" + all[i].second, ec);
        fault.hit();
      }
      for (const auto& e : fs::directory_iterator(dir, ec)) {
        const std::string f = e.path().filename().string();
        if (f.size() > 4 && f.compare(f.size() - 4, 4, ".tmp") == 0 && f.rfind("step_", 0) == 0) fs::remove_all(e.path(), ec);
      }
    } catch (const fs::filesystem_error& e) {
      throw CheckpointError(e.what());
    }
  });
  return final_dir;
}

std::string resolve_checkpoint_dir(const std::string& path) {
  std::error_code ec;
  if (fs::is_regular_file(path + "/" + kCheckpointFile, ec)) return path;
  if (!fs::is_directory(path, ec)) throw CheckpointError(path + ": no such checkpoint directory");
  std::string problem;
  const std::string name = read_latest(path, &problem);
  if (name.empty())
    throw CheckpointError(path + ": neither a checkpoint (no " + kCheckpointFile + ") nor a checkpoint.dir: " + problem);
  return path + "/" + name;
}

std::string resume_from_checkpoint(MPI_Comm comm, const TrainerState& s) {
  const CheckpointConfig& c = s.cfg->checkpoint;
  if (c.resume == "none") return "";
  int rank = 0;
  MPI_CHECK(MPI_Comm_rank(comm, &rank));
  // Rank 0 lists the candidates, newest first; every rank tries them in that order.
  std::string list;
  on_every_rank(comm, [&] {
    if (rank != 0) return;
    if (c.resume != "auto") {
      list = resolve_checkpoint_dir(c.resume) + "\n";
    } else {
      std::error_code ec;
      const auto all = fs::is_directory(c.dir, ec) ? committed_checkpoints(c.dir) : decltype(committed_checkpoints(""))();
      std::string problem;
      const std::string latest = fs::is_directory(c.dir, ec) ? read_latest(c.dir, &problem) : "";
      if (!latest.empty()) list += c.dir + "/" + latest + "\n";
      else if (!all.empty())
        std::fprintf(stderr, "fp8moe: WARNING: %s; falling back to the newest valid checkpoint in %s\n",
                     problem.c_str(), c.dir.c_str());
      for (const auto& [step, name] : all)
        if (name != latest) list += c.dir + "/" + name + "\n";
    }
  });
  broadcast_string(comm, list, 0);
  std::vector<std::string> candidates;
  std::istringstream in(list);
  for (std::string line; std::getline(in, line);) candidates.push_back(line);
  if (candidates.empty()) return "";

  std::string failures;
  for (size_t i = 0; i < candidates.size(); ++i) {
    Staged st;
    st.params = &s.model->params();
    st.opt = s.opt;
    st.model = s.model;
    st.write_rows = s.write_rows;
    st.moment_rows = s.moment_write_rows;
    try {
      load_into(candidates[i], comm, s.cfg, &st);
    } catch (const CheckpointMismatch&) {
      throw;
    } catch (const CheckpointError& e) {
      if (c.resume != "auto") throw;
      failures += std::string("\n  ") + e.what();
      if (rank == 0)
        std::fprintf(stderr, "fp8moe: WARNING: checkpoint %s is unusable: %s\nfp8moe: WARNING: %s\n", candidates[i].c_str(),
                     e.what(),
                     i + 1 < candidates.size() ? ("falling back to " + candidates[i + 1]).c_str()
                                               : "no older checkpoint is left");
      continue;
    }
    apply(st, s);
    if (rank == 0) std::printf("%s: %zu datasets, every checksum verified\n", candidates[i].c_str(), st.verified);
    if (rank == 0 && !st.note.empty()) std::printf("%s\n", st.note.c_str());
    if (rank == 0 && i > 0)
      std::fprintf(stderr, "fp8moe: WARNING: resumed from %s, an OLDER checkpoint than the newest one\n",
                   candidates[i].c_str());
    return candidates[i];
  }
  throw CheckpointError("no usable checkpoint in " + c.dir + " (set checkpoint.resume: none to start afresh):" + failures);
}

Config load_checkpoint_weights(const std::string& dir, std::vector<std::vector<float>>* params) {
  Staged st;
  st.params = params;
  load_into(resolve_checkpoint_dir(dir), MPI_COMM_NULL, nullptr, &st);
  return st.stored;
}

CheckpointReport inspect_checkpoint(const std::string& path, bool verify) {
  quiet_hdf5();
  const std::string dir = resolve_checkpoint_dir(path);
  CheckpointReport rep;
  rep.file = dir + "/" + kCheckpointFile;
  H5Handle file = open_file(rep.file, MPI_COMM_NULL);
  const hid_t f = file.get();
  auto attempt = [&](auto&& fn) {
    try {
      fn();
    } catch (const CheckpointError& e) {
      rep.problems.push_back(e.what());
    }
  };
  attempt([&] { rep.format_version = read_attr_i64(f, "format_version", rep.file); });
  attempt([&] { check_version(f, rep.file); });
  attempt([&] { rep.step = read_attr_i64(f, "step", rep.file); });
  attempt([&] { rep.samples = read_attr_i64(f, "samples", rep.file); });
  attempt([&] { rep.tokens = read_attr_i64(f, "tokens", rep.file); });
  attempt([&] { rep.layout = read_attr_str(f, "layout", rep.file); });
  attempt([&] { rep.code_version = read_attr_str(f, "code_version", rep.file); });
  attempt([&] { rep.config_yaml = read_attr_str(f, "config", rep.file); });

  // Every dataset in the file.
  std::vector<std::string> paths;
  auto visit = [](hid_t, const char* name, const H5O_info_t* info, void* data) -> herr_t {
    if (info->type == H5O_TYPE_DATASET) static_cast<std::vector<std::string>*>(data)->push_back(std::string("/") + name);
    return 0;
  };
  if (H5Ovisit(f, H5_INDEX_NAME, H5_ITER_INC, visit, &paths) < 0)
    rep.problems.push_back(rep.file + ": cannot list the datasets (HDF5: " + h5_error_text() + ")");
  for (const std::string& p : paths) {
    DatasetReport d;
    d.path = p;
    attempt([&] {
      const std::string at = rep.file + ": dataset " + p;
      H5Handle ds(h5(H5Dopen2(f, p.c_str(), H5P_DEFAULT), at, "cannot open"), H5Dclose);
      H5Handle space(h5(H5Dget_space(ds.get()), at, "H5Dget_space"), H5Sclose);
      hsize_t dims[8] = {};
      const int nd = h5(H5Sget_simple_extent_dims(space.get(), dims, nullptr), at, "no shape");
      int64_t n = 1;
      for (int i = 0; i < nd; ++i) d.shape.push_back(int64_t(dims[i])), n *= int64_t(dims[i]);
      H5Handle type(h5(H5Dget_type(ds.get()), at, "H5Dget_type"), H5Tclose);
      Dt dt;
      if (!dt_of(type.get(), &dt)) throw CheckpointError(at + ": unexpected element type");
      d.dtype = dt_name(dt);
      d.bytes = n * int64_t(dt_size(dt));
      d.stored_checksum = read_attr_u64(ds.get(), "checksum", at);
      if (!verify) return;
      // In pieces of about 64 MB of whole rows.
      const int64_t cols = nd == 2 ? int64_t(dims[1]) : n, rows = nd == 2 ? int64_t(dims[0]) : 1;
      const int64_t step_rows = std::max<int64_t>(1, (int64_t(1) << 26) / std::max<int64_t>(1, cols * int64_t(dt_size(dt))));
      std::vector<unsigned char> buf;
      uint64_t sum = 0;
      for (int64_t r0 = 0; r0 < rows && cols > 0; r0 += step_rows) {
        const int64_t nr = std::min(step_rows, rows - r0);
        buf.resize(size_t(nr * cols) * dt_size(dt));
        const hsize_t start[2] = {hsize_t(r0), 0}, count[2] = {hsize_t(nr), hsize_t(cols)};
        H5Handle fsel(h5(H5Dget_space(ds.get()), at, "H5Dget_space"), H5Sclose);
        if (nd == 2) h5(H5Sselect_hyperslab(fsel.get(), H5S_SELECT_SET, start, nullptr, count, nullptr), at, "select");
        H5Handle mem(h5(H5Screate_simple(nd == 2 ? 2 : 1, nd == 2 ? count : count + 1, nullptr), at, "H5Screate_simple"),
                     H5Sclose);
        h5(H5Dread(ds.get(), type.get(), mem.get(), nd == 2 ? fsel.get() : H5S_ALL, H5P_DEFAULT, buf.data()), at,
           "read failed");
        sum += checksum_part(buf.data(), dt, nr * cols, r0 * cols);
      }
      d.checked = true;
      d.computed_checksum = sum;
      d.ok = sum == d.stored_checksum;
      if (!d.ok) {
        char b[96];
        std::snprintf(b, sizeof b, " (stored %016llx, computed %016llx)", (unsigned long long)d.stored_checksum,
                      (unsigned long long)sum);
        rep.problems.push_back(at + ": checksum mismatch: the data is corrupt" + b);
      }
    });
    rep.datasets.push_back(std::move(d));
  }
  if (verify && !rep.config_yaml.empty()) {
    // Everything a load of this checkpoint's own config needs is there, with its shape.
    attempt([&] {
      const Config cfg = stored_config(f, rep.file);
      std::map<std::string, const DatasetReport*> by_path;
      for (const auto& d : rep.datasets) by_path[d.path] = &d;
      auto expect = [&](const std::string& p, int64_t rows, int64_t cols) {
        auto it = by_path.find(p);
        if (it == by_path.end()) rep.problems.push_back(rep.file + ": dataset " + p + " is missing");
        else if (it->second->shape != std::vector<int64_t>{rows, cols})
          rep.problems.push_back(rep.file + ": dataset " + p + " has the wrong shape");
      };
      for (const ParamSpec& p : build_param_table(cfg.model).params) {
        expect("/params/" + p.name, p.rows, p.cols);
        if (p.trainable) expect("/optim/m/" + p.name, p.rows, p.cols), expect("/optim/v/" + p.name, p.rows, p.cols);
      }
    });
  }
  return rep;
}

}  // namespace fp8moe
