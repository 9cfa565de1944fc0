// save_checkpoint (io/checkpoint.h), in phases: where the save goes (an empty step_N.tmp/), the
// datasets this rank writes, their staging and the room the file needs, the file written
// (metadata, every dataset through the staging buffer, the checksums) and closed, read back, and
// committed (io/checkpoint_commit.h). The HDF5 layer is io/hdf5_file.h, the staging
// io/checkpoint_staging.cpp.
#include <algorithm>
#include <ctime>
#include <filesystem>
#include <functional>

#include "io/checkpoint_commit.h"
#include "io/checkpoint_common.h"
#include "io/config.h"
#include "kernels/check.h"

namespace fp8moe {
namespace fs = std::filesystem;
using namespace ckpt;
namespace {

constexpr int kExitFailure = 1;  // app/exit_codes.h

// One dataset of a save: this rank's block of a (rows, cols) tensor, in backend memory (staged
// through the host buffer) or host memory (the delayed-scaling arrays).
struct SavedDataset {
  std::string path;
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

// Where a save writes, and how long closing the file may take.
struct SaveTarget {
  int rank = 0, size = 1;
  std::string dir, name;                 // checkpoint.dir, step_N
  std::string final_dir, tmp_dir, path;  // <dir>/step_N, <dir>/step_N.tmp, <tmp_dir>/checkpoint.h5
  // The watchdog's limit on a close that may never return (parallel/watchdog.h): after a failed
  // write, at most 5 s; for a close of a file written without error, runtime.timeout_s.
  double limit = 600, failed_limit = 5;
};

SaveTarget save_target(MPI_Comm comm, const Config& cfg, int64_t step) {
  SaveTarget t;
  MPI_CHECK(MPI_Comm_rank(comm, &t.rank));
  MPI_CHECK(MPI_Comm_size(comm, &t.size));
  t.dir = cfg.checkpoint.dir, t.name = checkpoint_name(step);
  t.final_dir = t.dir + "/" + t.name, t.tmp_dir = t.final_dir + ".tmp";
  t.path = t.tmp_dir + "/" + kCheckpointFile;
  t.limit = cfg.runtime.timeout_s > 0 ? cfg.runtime.timeout_s : 600.0;
  t.failed_limit = std::min(t.limit, 5.0);
  return t;
}

// Phase 1: an empty step_N.tmp/, made by rank 0 (a crashed earlier save of this step removed).
void make_tmp_dir(MPI_Comm comm, const SaveTarget& t) {
  on_every_rank(comm, [&] {
    if (t.rank != 0) return;
    std::error_code ec;
    fs::create_directories(t.dir, ec);
    if (!ec) fs::remove_all(t.tmp_dir, ec);
    if (!ec) fs::create_directory(t.tmp_dir, ec);
    if (ec) throw CheckpointError(t.tmp_dir + ": cannot create: " + ec.message());
  });
}

// Phase 2: the datasets, in file order: every parameter's block, each moment's (the optimizer's
// owned rows of this rank's block, global rows sh.r0 + ...; sharded, ZeRO-1, each rank writes
// those), then the delayed-scaling arrays `sc` (host memory, written whole by the even split).
// The parameters and moments stay in the model's backend memory.
std::vector<SavedDataset> plan_datasets(const TrainerState& s, const SaveTarget& t, const ScalingArrays& sc) {
  const ParamTable& table = s.model->table();
  std::vector<SavedDataset> tensors;
  for (size_t i = 0; i < table.params.size(); ++i) {
    const ParamSpec& p = table.params[i];
    const Shard& sh = s.model->shard(i);
    const Rows mine = !sh.held() ? Rows{0, 0}
                      : s.write_rows.empty() ? my_rows(p.rows, t.rank, t.size)
                                             : rows_of(s.write_rows[i]);
    tensors.push_back({param_dataset(p.name), Dt::f32, p.rows, p.cols, s.model->store().param(i), true, sh.r0, mine,
                       sh.c0, sh.cols});
  }
  const Dt moment_dt = s.opt->bf16_moments() ? Dt::bf16 : Dt::f32;
  for (int w = 0; w < 2; ++w)
    for (size_t i = 0; i < table.params.size(); ++i) {
      const ParamSpec& p = table.params[i];
      if (!p.trainable) continue;
      const std::string dpath = moment_dataset(w, p.name);
      const Shard& sh = s.model->shard(i);
      const RowRange o = s.opt->owned(i);
      const Rows mine = !s.moment_write_rows.empty() ? rows_of(s.moment_write_rows[i])
                        : s.opt->sharded()           ? Rows{sh.r0 + o.begin, o.end - o.begin}
                                                     : my_rows(p.rows, t.rank, t.size);
      FP8MOE_ASSERT(mine.n == 0 || (mine.r0 >= sh.r0 + o.begin && mine.r0 + mine.n <= sh.r0 + o.end), "checkpoint: ",
                    dpath, " rows to write outside the optimizer's rows");
      tensors.push_back(
          {dpath, moment_dt, p.rows, p.cols, s.opt->moment(w, i).raw(), true, sh.r0 + o.begin, mine, sh.c0, sh.cols});
    }
  const int64_t n_sc = int64_t(sc.names.size());
  auto whole = [&](std::string path, Dt dt, int64_t cols, const void* data) {
    tensors.push_back({std::move(path), dt, n_sc, cols, data, false, 0, my_rows(n_sc, t.rank, t.size)});
  };
  if (n_sc > 0) {
    whole("/fp8/amax_history", Dt::f32, sc.len, sc.history.data());
    whole("/fp8/scale", Dt::f32, 2, sc.scale.data());
    whole("/fp8/steps", Dt::i64, 1, sc.steps.data());
  }
  return tensors;
}

// Phase 3: each dataset's rows this rank writes, in chunks through one host buffer of at most
// checkpoint.staging_bytes (io/checkpoint.h); the ranks agree on each dataset's number of chunks
// (the most any rank has: one allreduce), since a collective write needs the same number of calls
// on every rank.
StagingPlan plan_save_staging(MPI_Comm comm, const std::vector<SavedDataset>& tensors, int64_t bound) {
  std::vector<StagedBlock> blocks;
  for (const SavedDataset& d : tensors) blocks.push_back({d.mine, d.width(), dt_size(d.dt)});
  return plan_staging(comm, blocks, bound);
}

// Phase 4: room for the file, before any rank writes: the datasets' bytes, and for HDF5's metadata
// 2 KiB a dataset (measured: about 520 bytes), the config text and 64 KiB.
void check_room(MPI_Comm comm, const SaveTarget& t, const Config& cfg, const std::vector<SavedDataset>& tensors) {
  double need = 65536 + double(config_to_yaml(cfg).size() + 2048 * tensors.size());
  for (const SavedDataset& d : tensors) need += double(d.rows) * double(d.cols) * double(dt_size(d.dt));
  on_every_rank(comm, [&] {
    if (t.rank == 0) check_space(t.tmp_dir, int64_t(need));
  });
}

// The `created` attribute: rank 0's clock (attribute data must agree over the ranks).
std::string creation_time(MPI_Comm comm, int rank) {
  std::string created;
  if (rank == 0) {
    const std::time_t now = std::time(nullptr);
    char when[32];
    std::strftime(when, sizeof when, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
    created = when;
  }
  broadcast_string(comm, created, 0);
  return created;
}

// The root attributes (io/checkpoint.h), in this order.
void write_metadata(hid_t f, const TrainerState& s, const std::string& created, const std::string& path) {
  const Config& cfg = *s.cfg;
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
  write_attr(f, "created", created, path);
}

// What the writing and the reading back share: the datasets, their staging and its buffer.
struct Staging {
  const std::vector<SavedDataset>& tensors;
  const StagingPlan& plan;
  Backend& be;
  HostBuffer<unsigned char>& buffer;
};

// Phase 5a: dataset i, created collectively, then its rows chunk by chunk (downloaded through the
// staging buffer, or from host memory), agreeing after every chunk so that no rank goes on into
// the next write alone. Adds the chunks' checksum terms to *sum (the terms add up). `last`, when
// set, runs in the dataset's final step, after the dataset is closed.
void write_dataset(MPI_Comm comm, const SaveTarget& t, const Staging& st, hid_t file, hid_t dxpl, size_t i,
                   uint64_t* sum, const std::function<void()>& last) {
  const SavedDataset& d = st.tensors[i];
  const std::string at = t.path + ": dataset " + d.path;
  const int64_t steps = st.plan.steps[i];
  H5Handle ds;
  for (int64_t k = 0; k < steps; ++k)
    on_every_rank(comm, [&] {
      if (k == 0) ds = create_dataset(file, d.path, d.dt, d.rows, d.cols, t.path);
      const Chunk ch = chunk_at(st.plan.chunks[i], k);
      const void* buf = nullptr;
      if (!ch.empty()) {
        if (d.device) {
          st.be.download(st.buffer.data(), d.at(ch.rows.r0, ch.col), size_t(ch.rows.n * ch.w) * dt_size(d.dt));
          st.be.sync();
          buf = st.buffer.data();
        } else {
          buf = d.at(ch.rows.r0, ch.col);
        }
        *sum += checksum_chunk(buf, d.dt, ch, d.mine, d.c0, d.cols);
      }
      write_block(ds.get(), dxpl, d.dt, d.rows, d.cols, ch.rows, d.c0 + ch.col, ch.w, buf, at);
      if (k + 1 < steps) return;
      ds.reset();
      if (last) last();
    });
}

// Closing the file: HDF5's close runs collectives (metadata flush, MPI-IO close), and a close that
// fails on one rank, or a write that failed on some, can leave the ranks in different ones. So
// every close is guarded. After a failed write (`failure`), a close that does not finish ends the
// job with the save's message (exit 1). After none, it is a file system that filled during the
// close (exit 1, as for a failed write) or a rank that stopped (exit 4, requeue-able, as the
// watchdog would), told apart by the space left when the guard fires. A close that fails leaves
// HDF5 unable to shut down, so that ends the job too.
void close_file(H5Handle& file, H5Handle& dxpl, const SaveTarget& t, const std::string& failure, double guard_s) {
  const WatchScope guard("closing a checkpoint file", guard_s,
                         [failure, path = t.path, tmp_dir = t.tmp_dir, guard_s]() -> WatchVerdict {
    const std::string tail = " (the previous checkpoint is intact); closing " + path +
                             " did not finish on every rank: ending the job";
    if (!failure.empty()) return {kExitFailure, "checkpoint save failed: " + failure + tail};
    const int64_t left = free_bytes(tmp_dir);
    if (left >= 0 && left < (int64_t(1) << 20))
      return {kExitFailure, "checkpoint save failed: " + tmp_dir + ": the file system is full (" +
                                std::to_string(left) + " bytes free)" + tail};
    return {kWatchdogExit, "checkpoint save failed: closing " + path + " took longer than " +
                               std::to_string(int(guard_s)) + " s, with space left: a rank is stopped, " +
                               "dead or hung (the previous checkpoint is intact): ending the job (exit " +
                               std::to_string(kWatchdogExit) + ", requeue-able)"};
  });
  dxpl.reset();
  if (file.reset() < 0)
    abort_job("rank " + std::to_string(t.rank) + ": checkpoint save failed: " +
                  (failure.empty() ? "closing the file failed" : failure) +
                  " (the previous checkpoint is intact); HDF5 could not close " + t.path + " (" + h5_error_text() +
                  "): ending the job",
              kExitFailure);
}

// Phase 5: the file, written by every rank collectively: the root attributes, every dataset, the
// /fp8 names with the last one, then the checksum attributes once one allreduce made the sums
// global (every rank writes the same values); closed under the guard. Returns the checksums.
// Fault points: each dataset written, the close (io/checkpoint_faults.h).
std::vector<uint64_t> write_file(MPI_Comm comm, const TrainerState& s, const SaveTarget& t, const Staging& st,
                                 const ScalingArrays& sc, const std::string& created, FaultPoint& fault) {
  const std::vector<SavedDataset>& tensors = st.tensors;
  std::vector<uint64_t> sums(tensors.size(), 0);
  H5Handle file, dxpl;
  auto scaling_names = [&] {  // the /fp8 group exists once its datasets do
    H5Handle g(h5(H5Gopen2(file.get(), "/fp8", H5P_DEFAULT), t.path, "cannot open group /fp8"), H5Gclose);
    write_attr(g.get(), "tensors", join_lines(sc.names), t.path + ": /fp8");
    write_attr(g.get(), "history_len", sc.len, t.path + ": /fp8");
  };
  try {
    on_every_rank(comm, [&] {
      file = create_file(t.path, comm);
      dxpl = collective_xfer(t.path);
      write_metadata(file.get(), s, created, t.path);
    });
    for (size_t i = 0; i < tensors.size(); ++i) {
      const bool names_after = i + 1 == tensors.size() && !sc.names.empty();
      write_dataset(comm, t, st, file.get(), dxpl.get(), i, &sums[i],
                    names_after ? std::function<void()>(scaling_names) : nullptr);
      fault.hit();
      if (i == 0) fault.fill_at("first-dataset");
      if (i == tensors.size() / 2) fault.fill_at("middle");
    }
    MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, sums.data(), int(sums.size()), MPI_UINT64_T, MPI_SUM, comm));
    on_every_rank(comm, [&] {
      for (size_t i = 0; i < tensors.size(); ++i) write_checksum(file.get(), tensors[i].path, sums[i], t.path);
    });
    fault.fill_at("before-close");
  } catch (const CheckpointError& e) {  // every rank is here: on_every_rank agreed
    close_file(file, dxpl, t, e.what(), t.failed_limit);
    throw;
  }
  close_file(file, dxpl, t, "", t.limit);
  on_every_rank(comm, [&] { fault.hit(); });
  return sums;
}

// Phase 6: the file read back before the commit, every rank its own rows through the same chunks:
// a write that did not reach the file (MPI-IO can report a failed write that HDF5 does not pass
// on) never becomes a checkpoint.
void read_back(MPI_Comm comm, const SaveTarget& t, const Staging& st, const std::vector<uint64_t>& sums) {
  const std::vector<SavedDataset>& tensors = st.tensors;
  const std::string why = ": not every write reached the file system (is it full?)";
  H5Handle file, dxpl;
  std::vector<uint64_t> back(tensors.size(), 0), attr(tensors.size(), 0);
  auto reading_back = [&](auto&& step) {
    try {
      step();
    } catch (const CheckpointError& e) {
      throw CheckpointError(std::string("reading the written file back: ") + e.what() + why);
    }
  };
  on_every_rank(comm, [&] {
    reading_back([&] {
      file = open_file(t.path, comm);
      dxpl = collective_xfer(t.path);
    });
  });
  for (size_t i = 0; i < tensors.size(); ++i) {
    const SavedDataset& d = tensors[i];
    OpenDataset od;
    for (int64_t k = 0; k < st.plan.steps[i]; ++k)
      on_every_rank(comm, [&] {
        reading_back([&] {
          if (k == 0) od = open_dataset(file.get(), d.path, d.rows, d.cols, {d.dt}, t.path);
          const Chunk ch = chunk_at(st.plan.chunks[i], k);
          read_block(od, dxpl.get(), ch.rows, d.c0 + ch.col, ch.w, st.buffer.data());
          back[i] += checksum_chunk(st.buffer.data(), d.dt, ch, d.mine, d.c0, d.cols);
          attr[i] = od.stored_checksum;
        });
      });
  }
  MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, back.data(), int(back.size()), MPI_UINT64_T, MPI_SUM, comm));
  for (size_t i = 0; i < tensors.size(); ++i)
    if (back[i] != sums[i] || attr[i] != sums[i])
      throw CheckpointError("reading the written file back: " + t.path + ": dataset " + tensors[i].path +
                            checksum_mismatch(sums[i], back[i] != sums[i] ? back[i] : attr[i]) + why);
}

}  // namespace

std::string save_checkpoint(MPI_Comm comm, const TrainerState& s) {
  // The watchdog's mark for the whole save: its limit applies between the watched calls inside too
  // (the checksum reductions, HDF5's own collectives).
  const WatchScope watch("checkpoint save");
  quiet_hdf5();
  const Config& cfg = *s.cfg;
  const SaveTarget t = save_target(comm, cfg, s.progress->step);
  FaultPoint fault(t.rank, t.dir);
  make_tmp_dir(comm, t);
  const ScalingArrays sc = pack_scaling(gather_scaling(comm, *s.model));
  const std::vector<SavedDataset> tensors = plan_datasets(s, t, sc);
  const StagingPlan plan = plan_save_staging(comm, tensors, cfg.checkpoint.staging_bytes);
  HostBuffer<unsigned char> buffer(s.model->backend(), plan.buffer_bytes);  // pinned under CUDA
  const Staging st{tensors, plan, s.model->backend(), buffer};
  check_room(comm, t, cfg, tensors);
  const std::string created = creation_time(comm, t.rank);
  const std::vector<uint64_t> sums = write_file(comm, s, t, st, sc, created, fault);
  read_back(comm, t, st, sums);
  // Commit (rank 0): fsync, rename, fsync the directory, replace `latest`, prune.
  on_every_rank(comm, [&] {
    if (t.rank == 0) commit_checkpoint(t.dir, t.name, cfg.checkpoint.keep_last, fault);
  });
  return t.final_dir;
}

}  // namespace fp8moe
