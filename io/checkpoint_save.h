// The phases of a save (io/checkpoint_save.cpp) that save_checkpoint and AsyncCheckpointer
// (io/checkpoint_async.cpp) share: what a save writes (SavePlan: its tensors and their datasets),
// where (SaveTarget), the root attributes (SaveMeta), and the two halves of every save:
// prepare_save on the calling thread, then run_save, on the writer thread for an asynchronous
// save. Internal to io/checkpoint*.cpp.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "io/checkpoint_common.h"
#include "io/checkpoint_faults.h"

namespace fp8moe::ckpt {

// One tensor of a save: this rank's block of a (rows, cols) tensor, in backend memory (staged
// through the host buffer) or host memory (the delayed-scaling arrays), and where it goes.
struct SavedTensor {
  int64_t slot = -1;           // its slot in a stacked dataset (SavePlan::dataset_of: which)
  Dt dt = Dt::f32;
  int64_t rows = 1, cols = 1;  // the global shape
  const void* data = nullptr;  // the block: rows [row0, ...) x columns [c0, c0 + nc), row-major
  bool device = false;         // data is backend memory: never dereferenced here
  int64_t row0 = 0;
  Rows mine;                   // the rows of the block this rank writes
  int64_t c0 = 0, nc = -1;     // nc -1: every column
  int64_t width() const { return nc < 0 ? cols : nc; }
  // The address of (row, column c0 + col) of the block (arithmetic only).
  const unsigned char* at(int64_t row, int64_t col = 0) const {
    return static_cast<const unsigned char*>(data) + size_t((row - row0) * width() + col) * dt_size(dt);
  }
};

// One dataset of a save: 2-D with one tensor, or stacked with one tensor per slot (in slot order).
struct SavedDataset {
  std::string path;
  Dt dt = Dt::f32;
  int64_t slots = 0, rows = 1, cols = 1;
  std::shared_ptr<const std::vector<int64_t>> layers;  // a per-block family's blocks (Place::layers)
  std::vector<size_t> tensors;  // indices into SavePlan::tensors
};

struct SavePlan {
  std::vector<SavedTensor> tensors;
  std::vector<SavedDataset> datasets;  // in file order: each where its first tensor is
  std::vector<size_t> dataset_of;      // per tensor
};

// The root attributes (io/checkpoint.h), captured when the save starts: an asynchronous save's
// writer must not read the trainer's objects, which training goes on changing.
struct SaveMeta {
  int64_t step = 0, samples = 0, tokens = 0, seed = 0, good_steps = 0, updates = 0, skipped = 0;
  double last_val_loss = 0, loss_scale = 1;
  std::string config, layout, created;
};

// Where a save writes, and how long closing the file may take.
struct SaveTarget {
  int rank = 0, size = 1;
  std::string dir, name;                 // checkpoint.dir, step_N
  std::string final_dir, tmp_dir, path;  // <dir>/step_N, <dir>/step_N.tmp, <tmp_dir>/checkpoint.h5
  // The watchdog's limit on a close that may never return (parallel/watchdog.h): after a failed
  // write, at most 5 s; for a close of a file written without error, runtime.timeout_s.
  double limit = 600, failed_limit = 5;
  int keep_last = 1;
  int64_t staging_bytes = kCheckpointStagingBytes;
};

// A save as the main thread prepares it: where it goes, the delayed-scaling arrays, the tensors
// (in backend memory, or copied to host memory: copy_to_host) and the root attributes.
struct SaveJob {
  SaveTarget t;
  ScalingArrays sc;
  SavePlan sp;
  SaveMeta meta;
};

// The tensors of the model and the optimizer that this rank writes (t: its rank and the ranks'
// number), in file order, and the datasets they go in: the same for every save of a run (an
// AsyncCheckpointer keeps them).
SavePlan plan_tensors(const TrainerState& s, const SaveTarget& t);

// The calling thread's part of every save: collective over comm (the delayed-scaling state's
// allgather, the creation time's broadcast). `tensors`: plan_tensors(s, ...) of an earlier save,
// or nullptr.
std::unique_ptr<SaveJob> prepare_save(MPI_Comm comm, const TrainerState& s, const SavePlan* tensors);

// The rest, from the empty step_N.tmp/ to the commit: collective over comm. be: the backend of
// tensors still in its memory (a synchronous save), nullptr when every tensor is in host memory
// (an asynchronous save's copy). Returns the committed directory; throws CheckpointError.
std::string run_save(MPI_Comm comm, SaveJob& job, Backend* be, FaultPoint& fault);

}  // namespace fp8moe::ckpt
