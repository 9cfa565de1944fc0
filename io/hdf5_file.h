// The HDF5 layer of the checkpoints (io/checkpoint.h has the file layout): handles and errors, the
// element types (bfloat16 as an HDF5 float), the dataset checksums, attributes, parallel files
// (MPI-IO, collective transfers) and the datasets that each rank writes and reads in blocks of
// rows, whole or one slot of a stacked dataset (io/checkpoint_staging.cpp stages them through a
// bounded host buffer).
// Internal to io/checkpoint*.cpp. Every failure throws CheckpointError naming the file.
#pragma once

#include <hdf5.h>
#include <mpi.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "io/checkpoint.h"
#include "model/param_table.h"

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

// Rows [r0, r0 + n) of a tensor.
struct Rows {
  int64_t r0 = 0, n = 0;
};

// A rectangle of a dataset: rows `rows` x columns [c0, c0 + nc) of slot `slot` of a stacked
// dataset, or of a 2-D dataset (slot -1).
struct Slab {
  int64_t slot = -1;
  Rows rows;
  int64_t c0 = 0, nc = 0;
  bool empty() const { return rows.n <= 0 || nc <= 0; }
  int64_t numel() const { return empty() ? 0 : rows.n * nc; }
};

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

// Where a tensor lives in a file of format `version` (io/checkpoint.h): its dataset and, in a
// stacked dataset, its slot of `slots`. slot -1: a 2-D dataset of its own.
struct Place {
  std::string path;
  int64_t slot = -1, slots = 0;
  // A per-block family's stacked dataset (version 3): the block of each slot, its `layers`
  // attribute. Null for a routed experts' dataset (slot = the expert) and a 2-D one.
  std::shared_ptr<const std::vector<int64_t>> layers;
};

// The datasets of a model's tensors in a file of format `version`. Version 1: every tensor a 2-D
// dataset of its own. Version 2: a MoE block's routed experts stacked, slot e expert e
// ("layers.3.moe.experts.17.w1" in slot 17 of "layers.3.moe.experts.w1"). Version 3: as version
// 2, and every other tensor of a main-model block (layers.N.*; an MTP module's stay 2-D) stacked
// with the same tensor of the other blocks that have it ("layers.3.attn.wq" in "layers.attn.wq"),
// slot k the k-th of those blocks in order.
class DatasetLayout {
 public:
  DatasetLayout(const ParamTable& table, int64_t n_experts, int version);
  // which -1: the parameter; 0, 1: its first and second moments.
  Place place(const ParamSpec& p, int which) const;

 private:
  int64_t n_experts_ = 0;
  int version_ = 1;
  // "layers.attn.wq" -> the blocks that have it, ascending.
  std::unordered_map<std::string, std::shared_ptr<std::vector<int64_t>>> families_;
};

// "dataset <path>", or "dataset <path>, expert <e>" / ", layer <block>" in a stacked one: a
// tensor, for messages.
std::string tensor_text(const Place& p);

// "layers 3-60" / "layers 0, 2, 5" / "no `layers` attribute" (empty): a `layers` attribute's
// blocks, for messages.
std::string layers_text(const std::vector<int64_t>& layers);

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
// An array attribute of n values; another count throws.
std::vector<uint64_t> read_attr_u64s(hid_t obj, const std::string& name, int64_t n, const std::string& where);
// n -1: any number of values.
std::vector<int64_t> read_attr_i64s(hid_t obj, const std::string& name, int64_t n, const std::string& where);
double read_attr_f64(hid_t obj, const std::string& name, const std::string& where);
std::string read_attr_str(hid_t obj, const std::string& name, const std::string& where);

// ---------------------------------------------------------------- root attributes of a load

// The root attributes that a load and inspect_checkpoint check: format_version, returned (throws,
// naming it and the versions this build reads, unless it is one of them) and the stored config
// (throws when it is not valid).
int check_version(hid_t file, const std::string& where);
Config stored_config(hid_t file, const std::string& where);

// ---------------------------------------------------------------- files

// A new file, created collectively over comm through MPI-IO (fails when it exists).
H5Handle create_file(const std::string& path, MPI_Comm comm);

// comm == MPI_COMM_NULL: a serial open (the tools), else collective over comm.
H5Handle open_file(const std::string& path, MPI_Comm comm);

// A dataset transfer property list for collective MPI-IO.
H5Handle collective_xfer(const std::string& where);

// ---------------------------------------------------------------- datasets, in blocks of rows

// A dataset of a save, created collectively with its global shape, (rows, cols), or (slots, rows,
// cols) when slots > 0 (a stacked dataset), no fill and its attributes (`checksum` 0 for now, or
// `checksums`, one 0 per slot; `encoding` for bfloat16); its data are written block by block
// (write_blocks), its checksums once every rank has written (write_checksums).
// A per-block family's dataset (layers: its blocks, one per slot) also gets its `layers` attribute.
H5Handle create_dataset(hid_t file, const std::string& path, Dt t, int64_t slots, int64_t rows, int64_t cols,
                        const std::string& where, const std::vector<int64_t>* layers = nullptr);

// Writes `blocks` of dataset ds (element type t) from buf, which holds them one after another, each
// row-major (rows.n, nc): several blocks in one call only of distinct slots in ascending order (the
// file's order, which HDF5 follows). Collective: every rank makes the same number of calls per
// dataset; empty blocks select nothing (a rank with less to write than the others).
void write_blocks(hid_t ds, hid_t dxpl, Dt t, const std::vector<Slab>& blocks, const void* buf, const std::string& at);

// Sets the checksum attribute of a written dataset to the global sums, one per slot (one for a 2-D
// dataset); every rank passes the same values. Collective.
void write_checksums(hid_t file, const std::string& path, const std::vector<uint64_t>& sums, const std::string& where);

// A dataset opened for reading, its shape and element type checked, its checksums read.
struct OpenDataset {
  H5Handle ds;
  std::string at;  // "<file>: dataset <path>", for messages
  Dt dt = Dt::f32;
  int64_t slots = 0, rows = 0, cols = 0;  // slots 0: a 2-D dataset
  std::vector<uint64_t> stored_checksums; // one per slot (one for a 2-D dataset)
  uint64_t stored_checksum(int64_t slot) const { return stored_checksums[size_t(std::max<int64_t>(0, slot))]; }
};
// Throws when the dataset is missing, its shape is not (rows, cols) (slots 0) or (slots, rows,
// cols), its type not in `allowed`, or (layers set: a per-block family's) its `layers` attribute
// not those blocks.
OpenDataset open_dataset(hid_t file, const std::string& path, int64_t slots, int64_t rows, int64_t cols,
                         std::initializer_list<Dt> allowed, const std::string& where,
                         const std::vector<int64_t>* layers = nullptr);
// The same, for tensor place `pl` of shape (rows, cols).
inline OpenDataset open_dataset(hid_t file, const Place& pl, int64_t rows, int64_t cols, std::initializer_list<Dt> allowed,
                                const std::string& where) {
  return open_dataset(file, pl.path, pl.slots, rows, cols, allowed, where, pl.layers.get());
}

// Reads `blocks` into buf as write_blocks lays them out, in the stored element type (no
// conversion: collective transfers stay collective). Collective as write_blocks.
void read_blocks(const OpenDataset& d, hid_t dxpl, const std::vector<Slab>& blocks, void* buf);

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
