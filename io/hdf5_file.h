// The HDF5 layer of the checkpoints (io/checkpoint.h has the file layout): handles and errors, the
// element types (bfloat16 as an HDF5 float), the dataset checksums, attributes, parallel files
// (MPI-IO, collective transfers) and the datasets that each rank writes and reads in blocks of
// rows (io/checkpoint_staging.cpp stages them through a bounded host buffer).
// Internal to io/checkpoint*.cpp. Every failure throws CheckpointError naming the file.
#pragma once

#include <hdf5.h>
#include <mpi.h>

#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "io/checkpoint.h"

namespace fp8moe::ckpt {

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
std::string h5_error_text();

// Error reports go into the exception, not to stderr.
void quiet_hdf5();

template <class T>
T h5(T result, const std::string& where, const std::string& what) {
  if (result < 0) throw CheckpointError(where + ": " + what + " (HDF5: " + h5_error_text() + ")");
  return result;
}

// ---------------------------------------------------------------- element types

enum class Dt { f32, bf16, i64 };

size_t dt_size(Dt t);
const char* dt_name(Dt t);

// The element type of a dataset's HDF5 type (float32, the bfloat16 type, int64); false for any
// other.
bool dt_of(hid_t type, Dt* out);

// ---------------------------------------------------------------- dataset names (io/checkpoint.h)

inline std::string param_dataset(const std::string& name) { return "/params/" + name; }
// which 0: the first moment (/optim/m/), 1: the second (/optim/v/).
inline std::string moment_dataset(int which, const std::string& name) {
  return (which == 0 ? "/optim/m/" : "/optim/v/") + name;
}

// ---------------------------------------------------------------- checksums

inline constexpr const char* kChecksumScheme =
    "sum mod 2^64 over elements of splitmix64(splitmix64(i) ^ bits), i = row-major global index, "
    "bits = the stored element's bytes as an unsigned little-endian integer";

// Sum of the terms of elements [0, n) of `data` (element type t), whose global indices start at
// `first`.
uint64_t checksum_part(const void* data, Dt t, int64_t n, int64_t first);

// The terms of rows [r0, r0 + n) x columns [c0, c0 + nc) of a tensor with `cols` columns, held
// row-major (n, nc) in data.
uint64_t checksum_block(const void* data, Dt t, int64_t r0, int64_t n, int64_t c0, int64_t nc, int64_t cols);
// ": checksum mismatch: the data is corrupt (stored ..., computed ...)", for a dataset's message.
std::string checksum_mismatch(uint64_t stored, uint64_t computed);

// ---------------------------------------------------------------- attributes

void write_attr(hid_t obj, const std::string& name, int64_t v, const std::string& where);
void write_attr(hid_t obj, const std::string& name, double v, const std::string& where);
void write_attr(hid_t obj, const std::string& name, const std::string& v, const std::string& where);

// A missing or unreadable attribute throws.
int64_t read_attr_i64(hid_t obj, const std::string& name, const std::string& where);
uint64_t read_attr_u64(hid_t obj, const std::string& name, const std::string& where);
double read_attr_f64(hid_t obj, const std::string& name, const std::string& where);
std::string read_attr_str(hid_t obj, const std::string& name, const std::string& where);

// ---------------------------------------------------------------- root attributes of a load

// The root attributes that a load and inspect_checkpoint check: format_version (throws unless it
// is kCheckpointFormatVersion) and the stored config (throws when it is not valid).
void check_version(hid_t file, const std::string& where);
Config stored_config(hid_t file, const std::string& where);

// ---------------------------------------------------------------- files

// A new file, created collectively over comm through MPI-IO (fails when it exists).
H5Handle create_file(const std::string& path, MPI_Comm comm);

// comm == MPI_COMM_NULL: a serial open (the tools), else collective over comm.
H5Handle open_file(const std::string& path, MPI_Comm comm);

// A dataset transfer property list for collective MPI-IO.
H5Handle collective_xfer(const std::string& where);

// Rows [r0, r0 + n) of a tensor.
struct Rows {
  int64_t r0 = 0, n = 0;
};

// ---------------------------------------------------------------- datasets, in blocks of rows

// A dataset of a save, created collectively with its global (rows, cols) shape, no fill and its
// attributes (`checksum` 0 for now, `encoding` for bfloat16); its data are written block by block
// (write_block), its checksum once every rank has written (write_checksum).
H5Handle create_dataset(hid_t file, const std::string& path, Dt t, int64_t rows, int64_t cols, const std::string& where);

// Writes rows [part.r0, part.r0 + part.n) x columns [c0, c0 + nc) of dataset ds (global shape
// (rows, cols), element type t) from buf, which holds them row-major (part.n, nc). Collective:
// every rank makes the same number of calls per dataset; part.n == 0 or nc == 0 selects nothing
// (a rank with less to write than the others).
void write_block(hid_t ds, hid_t dxpl, Dt t, int64_t rows, int64_t cols, Rows part, int64_t c0, int64_t nc,
                 const void* buf, const std::string& at);

// Sets the `checksum` attribute of a written dataset to the global sum (every rank passes the same
// value). Collective.
void write_checksum(hid_t file, const std::string& path, uint64_t checksum, const std::string& where);

// A dataset opened for reading, its shape and element type checked, its checksum attribute read.
struct OpenDataset {
  H5Handle ds;
  std::string at;  // "<file>: dataset <path>", for messages
  Dt dt = Dt::f32;
  int64_t rows = 0, cols = 0;
  uint64_t stored_checksum = 0;
};
// Throws when the dataset is missing, its shape is not (rows, cols) or its type not in `allowed`.
OpenDataset open_dataset(hid_t file, const std::string& path, int64_t rows, int64_t cols,
                         std::initializer_list<Dt> allowed, const std::string& where);

// Reads rows [part.r0, part.r0 + part.n) x columns [c0, c0 + nc) into buf, row-major (part.n, nc),
// in the stored element type (no conversion: collective transfers stay collective). Collective as
// write_block; part.n == 0 or nc == 0 selects nothing.
void read_block(const OpenDataset& d, hid_t dxpl, Rows part, int64_t c0, int64_t nc, void* buf);

struct DatasetRead {
  Dt dt = Dt::f32;
  uint64_t stored_checksum = 0;
  // The rows read, as stored, in the vector of their type.
  std::vector<float> f32;
  std::vector<uint16_t> bf16;
  std::vector<int64_t> i64;
  const void* data() const {
    return dt == Dt::f32 ? static_cast<const void*>(f32.data())
                         : dt == Dt::bf16 ? static_cast<const void*>(bf16.data()) : static_cast<const void*>(i64.data());
  }
};

// open_dataset, then read_block of rows `part`, all columns, into host vectors (the small
// host-side datasets: /fp8/*).
DatasetRead read_dataset(hid_t file, hid_t dxpl, const std::string& path, int64_t rows, int64_t cols, Rows part,
                         std::initializer_list<Dt> allowed, const std::string& where);

}  // namespace fp8moe::ckpt
