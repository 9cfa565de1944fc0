// What the checkpoint save (io/checkpoint_save.cpp) and load (io/checkpoint_load.cpp) share: the
// agreement between ranks, the rows a rank writes, the staging of tensors through one bounded host
// buffer (io/checkpoint_staging.cpp), the delayed-scaling state as arrays
// (io/checkpoint_scaling.cpp) and the comparison of a stored config with the current one
// (io/checkpoint_inspect.cpp). Internal to io/checkpoint*.cpp.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "io/checkpoint.h"
#include "io/hdf5_file.h"
#include "parallel/mpi_session.h"
#include "parallel/watchdog.h"

namespace fp8moe::ckpt {

// ---------------------------------------------------------------- agreement between ranks

// Runs one step of a save or a load on this rank, then agrees with the other ranks of `comm`
// (MPI_COMM_NULL: this process alone): when any rank threw a CheckpointError, every rank throws
// the lowest failing rank's, of the same type (CheckpointMismatch and CheckpointUnreadable stay so).
// Every step that a collective call follows goes through here, so that no rank goes on into it alone.
template <class Step>
void on_every_rank(MPI_Comm comm, Step&& step) {
  enum Kind : int { kNone = 0, kError = 1, kMismatch = 2, kUnreadable = 3 };
  int kind = kNone;
  std::string error;
  try {
    const WatchScope watch("checkpoint I/O");  // HDF5's collectives inside: the watchdog's limit applies
    step();
  } catch (const CheckpointMismatch& e) {
    kind = kMismatch, error = e.what();
  } catch (const CheckpointUnreadable& e) {
    kind = kUnreadable, error = e.what();
  } catch (const CheckpointError& e) {
    kind = kError, error = e.what();
  }
  if (kind != kNone && error.empty()) error = "unknown checkpoint error";  // first_error goes by the text
  if (comm != MPI_COMM_NULL) error = first_error(comm, error, &kind);
  if (error.empty()) return;
  if (kind == kMismatch) throw CheckpointMismatch(error);
  if (kind == kUnreadable) throw CheckpointUnreadable(error);
  if (kind == kError) throw CheckpointError(error);
}

// The rows of a tensor with `rows` rows that this rank writes (and verifies): an even split over
// the ranks, every row to exactly one of them.
inline Rows rows_of(RowRange r) { return {r.begin, r.end - r.begin}; }
inline Rows my_rows(int64_t rows, int rank, int size) {
  return rows_of(replica_rows(rows, rank, size));  // the same split as ZeRO-1's (model/placement.h)
}

// ---------------------------------------------------------------- staging (io/checkpoint_staging.cpp)

// A block of one dataset (rows `rows` of the global tensor, `width` columns) cut into chunks that
// fit a staging buffer of `buffer` bytes: as many whole rows as fit, or, when one row does not
// fit, every row in pieces of the buffer's size. A chunk is a rectangle, contiguous in the
// block's row-major memory, and so one hyperslab.
struct Chunks {
  Rows rows;
  int64_t width = 0;
  int64_t rows_per = 1;  // whole rows per chunk (pieces == 1)
  int64_t pieces = 1;    // pieces per row, of `piece` elements (the last one shorter)
  int64_t piece = 0;
  int64_t count = 0;
};
struct Chunk {
  Rows rows;               // global rows
  int64_t col = 0, w = 0;  // columns [col, col + w) of the block
  bool empty() const { return rows.n <= 0 || w <= 0; }
};

Chunks chunks_of(Rows rows, int64_t width, size_t elem, int64_t buffer);
// Chunk k; k >= c.count (a rank with fewer chunks than the others): an empty one.
Chunk chunk_at(const Chunks& c, int64_t k);

// The checksum terms of the rows of chunk `ch` (held in buf, (ch.rows.n, ch.w) row-major) that lie
// in `mine`; c0: the block's first global column, cols the tensor's.
uint64_t checksum_chunk(const void* buf, Dt t, const Chunk& ch, Rows mine, int64_t c0, int64_t cols);

// Moments stored in the other dtype than train.moments_dtype, converted in place in the staging
// buffer (n elements; it holds n FP32 values): FP32 -> BF16 round-to-nearest-even front to back
// (each BF16 lands at or before its FP32), BF16 -> FP32 exactly back to front.
void convert_in_place(unsigned char* buf, Dt from, Dt to, int64_t n);

// One tensor's block as the staging sees it: the rows moved, its width, the bytes of an element in
// the buffer and the dataset it belongs to (an index into the save's or load's datasets).
struct StagedBlock {
  Rows rows;
  int64_t width = 0;
  size_t elem = 4;
  size_t dataset = 0;
};

// One part of a collective call: chunk `ch` of block `block`, at element `offset` of the buffer.
struct Piece {
  size_t block = 0;
  Chunk ch;
  int64_t offset = 0;
};
// One collective write or read of a dataset: its segments one after another in the buffer.
struct Call {
  std::vector<Piece> segments;
  int64_t elems = 0;
};

// The calls of every dataset of a save or a load through a buffer of at most `bound` bytes
// (checkpoint.staging_bytes). A block that fits the buffer whole shares a call with the blocks of
// its dataset before it while their sum fits (a stacked dataset's slots: one call for all of a
// rank's when they fit); a block that does not is cut into chunks (chunks_of), a call each. The
// blocks of one dataset come in their slots' order. steps: the number of collective calls each
// dataset takes, the most any rank of `comm` has (one allreduce; MPI_COMM_NULL: this rank's), at
// least 1, since every rank creates or opens every dataset, even with nothing to move.
struct StagingPlan {
  std::vector<std::vector<Call>> calls;  // per dataset, this rank's
  std::vector<int64_t> steps;            // per dataset
  int64_t buffer_bytes = 0;              // this rank's largest call: the staging buffer's size
  // Call k of dataset d on this rank; an empty one beyond its calls.
  const Call& call(size_t d, int64_t k) const {
    static const Call none;
    return size_t(k) < calls[d].size() ? calls[d][size_t(k)] : none;
  }
};
StagingPlan plan_staging(MPI_Comm comm, const std::vector<StagedBlock>& blocks, size_t n_datasets, int64_t bound);

// ---------------------------------------------------------------- delayed scaling (io/checkpoint_scaling.cpp)

// The /fp8 datasets: one row per scaled tensor "<weight>.<x|w|dy>".
struct ScalingArrays {
  std::vector<std::string> names;  // "<weight>.<x|w|dy>"
  int64_t len = 0;
  std::vector<float> history, scale;  // (n, len), (n, 2)
  std::vector<int64_t> steps;         // (n, 1)
};

// Every rank's delayed-scaling entries of the weights it holds, merged (replicas hold identical
// copies: their amax values are reduced): each rank serialises its own, one allgather. Collective.
std::map<std::string, HostLinearScaling> gather_scaling(MPI_Comm comm, Transformer& model);
ScalingArrays pack_scaling(const std::map<std::string, HostLinearScaling>& state);
// The entries of `a` (read from `path`) for the weights of `table` that `model` holds (every one
// without a model), into `out`. Throws CheckpointError for a row of an unknown tensor field.
void unpack_scaling(const ScalingArrays& a, const ParamTable& table, const Transformer* model, const std::string& path,
                    std::map<std::string, HostLinearScaling>* out);
// The `tensors` attribute of /fp8: the names, one a line.
std::string join_lines(const std::vector<std::string>& v);

// ---------------------------------------------------------------- config comparison (io/checkpoint_inspect.cpp)

// Flattens config_to_yaml's output into "a.b.c" -> "value".
std::map<std::string, std::string> flat_yaml(const std::string& yaml);
// The model keys that differ ("model.d_model: checkpoint 256, config 128"); model.init_std only
// matters at initialisation and model.mtp_loss_weight is a schedule (DeepSeek-V3: 0.3, then 0.1):
// they may differ.
std::vector<std::string> model_differences(const Config& stored, const Config& current);
// The parameter names of one model but not the other, with layer and expert numbers as `*` and
// a count ("\n  only in the checkpoint: layers.*.attn.wk (4 tensors)"); "" when both have the same.
std::string tensor_differences(const ModelConfig& stored, const ModelConfig& current);

}  // namespace fp8moe::ckpt
