// Sharded HDF5 checkpoints (docs/ARCHITECTURE.md, README "Checkpoints"): one directory
// <checkpoint.dir>/step_<8 digits>/ holding checkpoint.h5, written by all ranks in parallel through
// MPI-IO with collective transfers. Every dataset has its tensor's GLOBAL shape; each rank writes
// and reads only hyperslabs (rows of the global tensor), so a checkpoint saved under one layout
// loads under another. Commit protocol: write step_N.tmp/, close, all ranks agree, fsync, rename to
// step_N/, fsync the directory, atomically replace <dir>/latest, then prune beyond keep_last.
//
// File layout (format version 3):
//   /params/<name>        float32 (rows, cols)   every ParamTable entry outside the main model's
//                                                blocks (embed.weight, final_norm.weight,
//                                                head.weight, the MTP modules' "mtp.0.eh_proj",
//                                                "mtp.0.attn.wq", ...) but the routed experts'
//   /params/<family>      float32 (n, rows, cols)   one per tensor of the main model's blocks
//                         (layers.N.*) but the routed experts', the same tensor of every block
//                         that has it stacked, slot k the k-th of those blocks; <family>
//                         is the name without the block's number ("layers.attn.wq" holds
//                         layers.0.attn.wq, layers.1.attn.wq, ...); its int64 attribute `layers`
//                         lists the blocks slot by slot ("layers.moe.router": 3, 4, ..., 60 when
//                         the first 3 blocks are dense)
//   /params/<stacked>     float32 (n_experts, rows, cols)   one per MoE block (an MTP module's
//                         too) and expert weight:
//                         expert e's tensor in slot e; <stacked> is the tensors' name without the
//                         expert's number ("layers.3.moe.experts.w1" holds layers.3.moe.experts.*.w1)
//   /optim/m/<...>        float32 or bfloat16    AdamW first moments, trainable parameters only,
//   /optim/v/<...>                               second moments: the same datasets as /params
//   /fp8/amax_history     float32 (n, len)       delayed scaling, one row per scaled tensor
//   /fp8/scale            float32 (n, 2)         (scale of the next step, scale the last step used)
//   /fp8/steps            int64 (n, 1)           amax values recorded so far
//   /fp8 attribute `tensors`: the n tensor names, one per line ("layers.0.attn.wq.x")
// Every 2-D dataset has a uint64 attribute `checksum`: sum over elements, modulo 2^64, of
// splitmix64(splitmix64(i) ^ bits) with i the element's row-major GLOBAL index and bits its stored
// bytes as an unsigned integer. The sum does not depend on who wrote which part. A stacked dataset
// has `checksums`, uint64 (n): slot k's is that formula over slot k's (rows, cols) tensor alone (i
// from 0 in each slot), so damage is named down to the expert or the block.
// Older formats: version 1 (fp8moe before 2026-12-06) stored every tensor in a 2-D dataset of its
// own, the routed experts' too ("/params/layers.3.moe.experts.17.w1"); version 2 (2026-12-06)
// stacked the routed experts only. A tensor's checksum is the same value in every version (its
// slot's, or its dataset's). Every reader here reads all three (DatasetLayout, io/hdf5_file.h);
// a save writes version 3.
// Root attributes: format_version, step, samples, tokens, seed, loss_scale, loss_scale_good_steps,
// adam_updates, adam_skipped, last_val_loss, config (YAML), layout, code_version, checksum_scheme.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "model/config.h"
#include "model/optimizer.h"
#include "model/transformer.h"

namespace fp8moe {

constexpr int kCheckpointFormatVersion = 3;        // what a save writes
constexpr int kCheckpointOldestFormatVersion = 1;  // the oldest a load reads
constexpr const char* kCheckpointFile = "checkpoint.h5";

// A checkpoint that cannot be used: missing, truncated, corrupt, foreign. The message names the
// file and, where one is at fault, the dataset.
struct CheckpointError : std::runtime_error {
  using std::runtime_error::runtime_error;
};
// A valid checkpoint of another model (differing shape keys): older checkpoints will not help.
struct CheckpointMismatch : CheckpointError {
  using CheckpointError::CheckpointError;
};
// A checkpoint, `latest` or checkpoint directory that exists but cannot be read (permission, I/O
// error): not damage, so no reason to fall back to an older checkpoint or to start afresh. The
// message names the path and the error.
struct CheckpointUnreadable : CheckpointError {
  using CheckpointError::CheckpointError;
};

// The trainer's progress besides the tensors.
struct TrainProgress {
  int64_t step = 0;     // optimizer steps completed
  int64_t samples = 0;  // sequences consumed: the position of the next step's data
  int64_t tokens = 0;   // tokens consumed
  double last_val_loss = 0.0 / 0.0;
};

// What a save writes and a load fills: the trainer's own objects.
struct TrainerState {
  const Config* cfg = nullptr;  // the current run's config (stored with the checkpoint)
  Transformer* model = nullptr;
  AdamW* opt = nullptr;
  LossScaler* scaler = nullptr;
  TrainProgress* progress = nullptr;
  std::string layout;  // "tensor 1 x pipeline 1 x expert 1 x data 2" (informational)
  // Per parameter, the rows this rank writes to (and checks in) a checkpoint, for the parameters
  // and for their Adam moments; over the ranks, every row exactly once. Parameters the model does
  // not hold here (model->holds) are neither read nor written. Empty: rank r of the communicator
  // writes replica_rows(rows, r, size) of every parameter, and of the moments too unless the
  // optimizer is sharded (then its owned rows).
  std::vector<RowRange> write_rows, moment_write_rows;
};

// "step_00000042"
std::string checkpoint_name(int64_t step);

// The host memory a save or a load moves tensors through, per rank, whatever the model's size: one
// buffer of at most checkpoint.staging_bytes (Backend::allocate_host: pinned under CUDA; the
// config validates it: at least 8 bytes, one element of every type). Each dataset's rows go
// through it in chunks (as many whole rows as fit; a row that does not fit, in pieces). This is
// the key's default (model/config.h), and the bound of a load that has no current config.
constexpr int64_t kCheckpointStagingBytes = int64_t(64) << 20;
static_assert(kCheckpointStagingBytes == CheckpointConfig{}.staging_bytes, "checkpoint.staging_bytes' default");

// Saves progress->step into cfg.checkpoint.dir with the commit protocol, then deletes committed
// checkpoints beyond keep_last (oldest first, never the one `latest` names) and leftover *.tmp
// directories. Collective over `comm` (every rank of the job); each rank writes its write_rows,
// downloaded from the model's backend chunk by chunk through the staging buffer (above: s.cfg's
// checkpoint.staging_bytes); the ranks agree beforehand on every dataset's number of writes
// (collective writes), and write the checksum attributes once every dataset's data is written and
// the sums are global.
// Returns the committed directory. Before writing, checks that the file fits; after closing it,
// every rank reads its rows back and the checksums must match before the commit.
// Throws CheckpointError on every rank when any rank failed; the previous checkpoint is intact. A
// close that fails or does not finish ends the job (exit 1; exit 4 when a rank stopped during a
// close with space left): HDF5 cannot go on after it (docs/ARCHITECTURE.md, "Failures").
//
// Fault points for the tests, only in their build fp8moe-faults (io/checkpoint_faults.h; the
// product reads none of these): FP8MOE_CKPT_KILL=RANK:K makes rank RANK send itself SIGKILL at its
// K-th save event (each dataset written; then, on rank 0, the file closed, the agreement, the
// fsync, the rename, the directory fsync, latest.tmp written, latest renamed, each deletion);
// FP8MOE_CKPT_STOP=RANK:K the same with SIGSTOP; FP8MOE_CKPT_FILL=RANK:POINT fills the checkpoint
// directory's file system (a tmpfs only) at a point of the save.
std::string save_checkpoint(MPI_Comm comm, const TrainerState& s);

// The bytes of the state this rank writes (the rows it writes of every parameter and moment):
// what AsyncCheckpointer::start copies. Not collective.
int64_t checkpoint_copy_bytes(MPI_Comm comm, const TrainerState& s);

// An asynchronous save (checkpoint.async): start() copies what this rank writes of the step's
// state into host memory (one buffer, pinned under CUDA, allocated at the first save and grown
// only when a later one needs more: start() returns this rank's share of the checkpoint,
// `fp8moe plan` prints it) on the calling thread, then a writer thread of its own writes, reads
// back and commits it exactly as save_checkpoint does (the same phases and commit order; its
// fault points are save_checkpoint's after one more, halfway through the copy), over a duplicate
// of the communicator (MPI_THREAD_MULTIPLE), its calls watched in the watchdog's background lane,
// its OpenMP team one thread. Training goes on meanwhile: the copy is all it waits for. Any other
// exception on the writer ends the job, as on the main thread.
// finished(): this rank's writer is done (the ranks' writers end together, at the commit's
// agreement; callers agree on it before they wait). wait(): joins the writer and returns the
// committed directory, or throws its CheckpointError, the same on every rank (the previous
// checkpoint intact); "" when nothing is in flight. start() requires nothing in flight, and the
// destructor joins a writer still running. Construction and start() are collective over comm.
class AsyncCheckpointer {
 public:
  AsyncCheckpointer(MPI_Comm comm, Backend& be);
  ~AsyncCheckpointer();
  AsyncCheckpointer(const AsyncCheckpointer&) = delete;
  AsyncCheckpointer& operator=(const AsyncCheckpointer&) = delete;
  // Returns the bytes copied. Fault point (fp8moe-faults): halfway through the copy.
  int64_t start(MPI_Comm comm, const TrainerState& s);
  bool in_flight() const;
  bool finished() const;
  std::string wait();
  int64_t host_bytes() const;       // the host copy's size

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// checkpoint.resume: "none" starts fresh; "auto" loads <dir>/latest when the directory holds
// checkpoints, and when that one is missing or damaged says so on stderr and falls back to the
// newest older valid one (a directory, `latest` or file that cannot be read is an error:
// CheckpointUnreadable, never a fresh start or a fall-back); a path loads that checkpoint (a step
// directory, or a checkpoint.dir with a `latest`). Verifies the format version, the model's shape
// keys (CheckpointMismatch naming each differing key) and every dataset's checksum. Collective
// over `comm`. The tensors are read chunk by chunk through the staging buffer (above: s.cfg's
// checkpoint.staging_bytes) and uploaded straight into the model's parameters and the optimizer's
// moments; the rest (progress, loss scale, Adam counts, delayed scaling) is set only once the
// whole checkpoint verified. A checkpoint that fails may leave the tensors a mix: the next older
// one is then loaded over all of them, or this throws (the caller stops). Returns the directory
// loaded, or "" for a fresh start (nothing touched). Throws CheckpointError when nothing usable is
// found (auto) or the named checkpoint is unusable (path).
std::string resume_from_checkpoint(MPI_Comm comm, const TrainerState& s);

// ---- serial tools (no MPI needed) ----

// A checkpoint directory from a user's path: a step directory, or a checkpoint.dir whose `latest`
// names one. Throws CheckpointError.
std::string resolve_checkpoint_dir(const std::string& path);

struct DatasetReport {
  std::string path;                // "/params/embed"
  std::vector<int64_t> shape;
  std::string dtype;               // float32, bfloat16, int64
  int64_t bytes = 0;
  int64_t slots = 0;               // a stacked dataset's slots (0: a 2-D dataset)
  std::vector<int64_t> layers;     // a per-block family's blocks, slot by slot (empty: experts' slots)
  // The checksum; a stacked dataset's: the sum of its slots' (mod 2^64).
  uint64_t stored_checksum = 0;
  uint64_t computed_checksum = 0;  // when checked
  bool checked = false, ok = false;
};

struct CheckpointReport {
  std::string file;
  int64_t format_version = 0, step = 0, samples = 0, tokens = 0;
  std::string config_yaml, layout, code_version;
  std::vector<DatasetReport> datasets;
  std::vector<std::string> problems;  // empty: valid
};

// Reads the attributes and lists every dataset; with `verify`, recomputes every checksum and
// checks the datasets against the stored config's ParamTable. Throws CheckpointError when the
// file cannot be opened at all; other problems are listed in `problems`.
CheckpointReport inspect_checkpoint(const std::string& dir, bool verify);

// The stored config and parameters (FP32 masters) of a checkpoint, for generation: serial, every
// checksum of /params verified. Throws CheckpointError.
Config load_checkpoint_weights(const std::string& dir, std::vector<std::vector<float>>* params);

// A checkpoint's parameters one at a time (`fp8moe export`): serial, each read whole as FP32 and
// its checksum verified, so that a model of any size passes through one tensor's memory. Throws
// CheckpointError.
class CheckpointParams {
 public:
  explicit CheckpointParams(const std::string& path);  // a step directory or a checkpoint.dir
  ~CheckpointParams();
  CheckpointParams(const CheckpointParams&) = delete;
  CheckpointParams& operator=(const CheckpointParams&) = delete;
  const std::string& dir() const;  // the step directory read
  const Config& config() const;    // the stored config
  int64_t step() const;
  std::vector<float> read(const ParamSpec& p) const;  // (rows, cols) row-major

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// The checksum term of one element (exposed for tests).
uint64_t checksum_term(uint64_t global_index, uint64_t bits);

}  // namespace fp8moe
