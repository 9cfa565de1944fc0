// save_checkpoint (io/checkpoint.h) and the phases of every save (io/checkpoint_save.h). On the
// calling thread (prepare_save): where the save goes, the delayed-scaling state, the tensors this
// rank writes and the datasets they go in (stacked: DatasetLayout, io/hdf5_file.h), the root
// attributes; for an asynchronous save, then, the copy of the tensors to host memory
// (io/checkpoint_async.cpp). Then (run_save, on the writer thread for an asynchronous save): an
// empty step_N.tmp/, the staging and the room the file needs, the file written (metadata, every
// dataset through the staging buffer, the checksums) and closed, read back, and committed
// (io/checkpoint_commit.h). The HDF5 layer is io/hdf5_file.h, the staging
// io/checkpoint_staging.cpp.
#include "io/checkpoint_save.h"

#include <algorithm>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <unordered_map>

#include "io/checkpoint_commit.h"
#include "io/config.h"
#include "kernels/check.h"

namespace fp8moe {
namespace fs = std::filesystem;
using namespace ckpt;
namespace {

constexpr int kExitFailure = 1;  // app/exit_codes.h

SaveTarget save_target(MPI_Comm comm, const Config& cfg, int64_t step) {
  SaveTarget t;
  MPI_CHECK(MPI_Comm_rank(comm, &t.rank));
  MPI_CHECK(MPI_Comm_size(comm, &t.size));
  t.dir = cfg.checkpoint.dir, t.name = checkpoint_name(step);
  t.final_dir = t.dir + "/" + t.name, t.tmp_dir = t.final_dir + ".tmp";
  t.path = t.tmp_dir + "/" + kCheckpointFile;
  t.limit = cfg.runtime.timeout_s > 0 ? cfg.runtime.timeout_s : 600.0;
  t.failed_limit = std::min(t.limit, 5.0);
  t.keep_last = cfg.checkpoint.keep_last;
  t.staging_bytes = cfg.checkpoint.staging_bytes;
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

// Adds tensor x to the plan, into dataset `place` (made where its first tensor is; `index`: the
// datasets' by path).
void add_tensor(SavePlan& plan, std::unordered_map<std::string, size_t>& index, const Place& place, const SavedTensor& x) {
  const auto [it, added] = index.emplace(place.path, plan.datasets.size());
  if (added) plan.datasets.push_back({place.path, x.dt, place.slots, x.rows, x.cols, place.layers, {}});
  SavedDataset& d = plan.datasets[it->second];
  FP8MOE_ASSERT(d.dt == x.dt && d.rows == x.rows && d.cols == x.cols && x.slot == place.slot &&
                    x.slot == (d.slots > 0 ? int64_t(d.tensors.size()) : -1),
                "checkpoint: ", d.path, ": tensors of another shape, or out of slot order");
  d.tensors.push_back(plan.tensors.size());
  plan.dataset_of.push_back(it->second);
  plan.tensors.push_back(x);
}

}  // namespace

// Phase 2a: the tensors of the model and the optimizer, in file order: every parameter's block,
// each moment's (the optimizer's owned rows of this rank's block, global rows sh.r0 + ...;
// sharded, ZeRO-1, each rank writes those); and the datasets they go in (format
// kCheckpointFormatVersion: a MoE block's routed experts stacked, each other tensor of the blocks
// with the same tensor of the other blocks). The parameters and moments stay in the model's
// backend memory. The same for every save of a run (AsyncCheckpointer keeps it).
SavePlan ckpt::plan_tensors(const TrainerState& s, const SaveTarget& t) {
  const ParamTable& table = s.model->table();
  const DatasetLayout layout(table, s.cfg->model.moe.n_experts, kCheckpointFormatVersion);
  SavePlan plan;
  std::unordered_map<std::string, size_t> index;
  for (size_t i = 0; i < table.params.size(); ++i) {
    const ParamSpec& p = table.params[i];
    const Shard& sh = s.model->shard(i);
    const Rows mine = !sh.held() ? Rows{0, 0}
                      : s.write_rows.empty() ? my_rows(p.rows, t.rank, t.size)
                                             : rows_of(s.write_rows[i]);
    const Place place = layout.place(p, -1);
    add_tensor(plan, index, place,
               {place.slot, Dt::f32, p.rows, p.cols, s.model->store().param(i), true, sh.r0, mine, sh.c0, sh.cols});
  }
  const Dt moment_dt = s.opt->bf16_moments() ? Dt::bf16 : Dt::f32;
  for (int w = 0; w < 2; ++w)
    for (size_t i = 0; i < table.params.size(); ++i) {
      const ParamSpec& p = table.params[i];
      if (!p.trainable) continue;
      const Place place = layout.place(p, w);
      const Shard& sh = s.model->shard(i);
      const RowRange o = s.opt->owned(i);
      const Rows mine = !s.moment_write_rows.empty() ? rows_of(s.moment_write_rows[i])
                        : s.opt->sharded()           ? Rows{sh.r0 + o.begin, o.end - o.begin}
                                                     : my_rows(p.rows, t.rank, t.size);
      FP8MOE_ASSERT(mine.n == 0 || (mine.r0 >= sh.r0 + o.begin && mine.r0 + mine.n <= sh.r0 + o.end), "checkpoint: ",
                    place.path, " rows to write outside the optimizer's rows");
      add_tensor(plan, index, place,
                 {place.slot, moment_dt, p.rows, p.cols, s.opt->moment(w, i).raw(), true, sh.r0 + o.begin, mine, sh.c0,
                  sh.cols});
    }
  for (const SavedDataset& d : plan.datasets)
    FP8MOE_ASSERT(d.tensors.size() == size_t(std::max<int64_t>(1, d.slots)), "checkpoint: ", d.path, ": ",
                  d.tensors.size(), " tensors for ", d.slots, " slots");
  return plan;
}

namespace {

// Phase 2b: the delayed-scaling arrays `sc` (host memory, written whole by the even split), each a
// dataset of its own after the rest.
void add_scaling(SavePlan& plan, const SaveTarget& t, const ScalingArrays& sc) {
  const int64_t n_sc = int64_t(sc.names.size());
  if (n_sc == 0) return;
  std::unordered_map<std::string, size_t> index;
  auto whole = [&](const char* path, Dt dt, int64_t cols, const void* data) {
    add_tensor(plan, index, Place{path, -1, 0, nullptr}, {-1, dt, n_sc, cols, data, false, 0, my_rows(n_sc, t.rank, t.size)});
  };
  whole("/fp8/amax_history", Dt::f32, sc.len, sc.history.data());
  whole("/fp8/scale", Dt::f32, 2, sc.scale.data());
  whole("/fp8/steps", Dt::i64, 1, sc.steps.data());
}

// "dataset <path>", "dataset <path>, expert <e>" or ", layer <block>": tensor j, for messages.
std::string tensor_text(const SavePlan& sp, size_t j) {
  const SavedDataset& d = sp.datasets[sp.dataset_of[j]];
  return tensor_text(Place{d.path, sp.tensors[j].slot, d.slots, d.layers});
}

// Phase 3: each tensor's rows this rank writes, in calls through one host buffer of at most
// checkpoint.staging_bytes (io/checkpoint.h); the ranks agree on each dataset's number of calls
// (the most any rank has: one allreduce), since a collective write needs the same number of calls
// on every rank.
StagingPlan plan_save_staging(MPI_Comm comm, const SavePlan& sp, int64_t bound) {
  std::vector<StagedBlock> blocks;
  for (size_t j = 0; j < sp.tensors.size(); ++j) {
    const SavedTensor& x = sp.tensors[j];
    blocks.push_back({x.mine, x.width(), dt_size(x.dt), sp.dataset_of[j]});
  }
  return plan_staging(comm, blocks, sp.datasets.size(), bound);
}

// Phase 4: room for the file, before any rank writes: the tensors' bytes, and for HDF5's metadata
// 2 KiB a dataset (measured: about 520 bytes), 8 bytes a tensor (its checksum), the config text and
// 64 KiB.
void check_room(MPI_Comm comm, const SaveTarget& t, const SaveMeta& meta, const SavePlan& sp) {
  double need = 65536 + double(meta.config.size() + 2048 * sp.datasets.size());
  for (const SavedTensor& x : sp.tensors) need += double(x.rows) * double(x.cols) * double(dt_size(x.dt)) + 8;
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
void write_metadata(hid_t f, const SaveMeta& m, const std::string& path) {
  write_attr(f, "format_version", int64_t(kCheckpointFormatVersion), path);
  write_attr(f, "step", m.step, path);
  write_attr(f, "samples", m.samples, path);
  write_attr(f, "tokens", m.tokens, path);
  write_attr(f, "seed", m.seed, path);
  write_attr(f, "last_val_loss", m.last_val_loss, path);
  write_attr(f, "loss_scale", m.loss_scale, path);
  write_attr(f, "loss_scale_good_steps", m.good_steps, path);
  write_attr(f, "adam_updates", m.updates, path);
  write_attr(f, "adam_skipped", m.skipped, path);
  write_attr(f, "config", m.config, path);
  write_attr(f, "layout", m.layout, path);
  write_attr(f, "code_version", std::string("fp8moe " FP8MOE_VERSION), path);
  write_attr(f, "checksum_scheme", std::string(kChecksumScheme), path);
  write_attr(f, "created", m.created, path);
}

SaveMeta save_meta(MPI_Comm comm, int rank, const TrainerState& s) {
  const TrainProgress& pr = *s.progress;
  SaveMeta m;
  m.step = pr.step, m.samples = pr.samples, m.tokens = pr.tokens, m.seed = int64_t(s.cfg->train.seed);
  m.last_val_loss = pr.last_val_loss, m.loss_scale = double(s.scaler->scale());
  m.good_steps = s.scaler->good_steps(), m.updates = s.opt->updates(), m.skipped = s.opt->skipped();
  m.config = config_to_yaml(*s.cfg), m.layout = s.layout;
  m.created = creation_time(comm, rank);
  return m;
}

// What the writing and the reading back share: the datasets, their staging and its buffer (be:
// the backend whose memory the device tensors are in; none when every tensor is in host memory).
struct Staging {
  const SavePlan& sp;
  const StagingPlan& plan;
  Backend* be;
  unsigned char* buffer;
};

// Phase 5a: dataset i, created collectively, then its tensors' rows call by call (each call's
// segments downloaded into the staging buffer one after another, one synchronisation, or copied
// from host memory), agreeing after every call so that no rank goes on into the next write alone.
// Adds each segment's checksum terms to its tensor's sum in sums (the terms add up). `last`, when
// set, runs in the dataset's final step, after the dataset is closed.
void write_dataset(MPI_Comm comm, const SaveTarget& t, const Staging& st, hid_t file, hid_t dxpl, size_t i,
                   std::vector<uint64_t>& sums, const std::function<void()>& last) {
  const SavedDataset& d = st.sp.datasets[i];
  const std::string at = t.path + ": dataset " + d.path;
  const int64_t steps = st.plan.steps[i];
  const size_t elem = dt_size(d.dt);
  H5Handle ds;
  for (int64_t k = 0; k < steps; ++k)
    on_every_rank(comm, [&] {
      if (k == 0) ds = create_dataset(file, d.path, d.dt, d.slots, d.rows, d.cols, t.path, d.layers.get());
      const Call& call = st.plan.call(i, k);
      std::vector<Slab> blocks;
      bool downloaded = false;
      for (const Piece& sg : call.segments) {
        const SavedTensor& x = st.sp.tensors[sg.block];
        const Chunk& ch = sg.ch;
        unsigned char* to = st.buffer + size_t(sg.offset) * elem;
        const size_t bytes = size_t(ch.rows.n * ch.w) * elem;
        if (x.device) st.be->download(to, x.at(ch.rows.r0, ch.col), bytes), downloaded = true;
        else std::memcpy(to, x.at(ch.rows.r0, ch.col), bytes);
        blocks.push_back({x.slot, ch.rows, x.c0 + ch.col, ch.w});
      }
      if (downloaded) st.be->sync();
      for (const Piece& sg : call.segments) {
        const SavedTensor& x = st.sp.tensors[sg.block];
        sums[sg.block] += checksum_chunk(st.buffer + size_t(sg.offset) * elem, d.dt, sg.ch, x.mine, x.c0, x.cols);
      }
      write_blocks(ds.get(), dxpl, d.dt, blocks, st.buffer, at);
      if (k + 1 < steps) return;
      ds.reset();
      if (last) last();
    });
}

// The checksums of dataset d's tensors, in slot order, from the per-tensor sums.
std::vector<uint64_t> dataset_sums(const SavedDataset& d, const std::vector<uint64_t>& sums) {
  std::vector<uint64_t> out;
  for (size_t j : d.tensors) out.push_back(sums[j]);
  return out;
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
std::vector<uint64_t> write_file(MPI_Comm comm, const SaveMeta& meta, const SaveTarget& t, const Staging& st,
                                 const ScalingArrays& sc, FaultPoint& fault) {
  const std::vector<SavedDataset>& datasets = st.sp.datasets;
  std::vector<uint64_t> sums(st.sp.tensors.size(), 0);
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
      write_metadata(file.get(), meta, t.path);
    });
    for (size_t i = 0; i < datasets.size(); ++i) {
      const bool names_after = i + 1 == datasets.size() && !sc.names.empty();
      write_dataset(comm, t, st, file.get(), dxpl.get(), i, sums,
                    names_after ? std::function<void()>(scaling_names) : nullptr);
      fault.hit();
      if (i == 0) fault.fill_at("first-dataset");
      if (i == datasets.size() / 2) fault.fill_at("middle");
    }
    MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, sums.data(), int(sums.size()), MPI_UINT64_T, MPI_SUM, comm));
    on_every_rank(comm, [&] {
      for (const SavedDataset& d : datasets) write_checksums(file.get(), d.path, dataset_sums(d, sums), t.path);
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

// Phase 6: the file read back before the commit, every rank its own rows through the same calls:
// a write that did not reach the file (MPI-IO can report a failed write that HDF5 does not pass
// on) never becomes a checkpoint. Each rank opens the closed file alone (no collective call, so
// no agreement per dataset: one for the whole read-back), reads every dataset's checksum
// attributes and its own rows; then one allreduce sums the checksums.
void read_back(MPI_Comm comm, const SaveTarget& t, const Staging& st, const std::vector<uint64_t>& sums) {
  const std::vector<SavedDataset>& datasets = st.sp.datasets;
  const std::vector<SavedTensor>& tensors = st.sp.tensors;
  const std::string why = ": not every write reached the file system (is it full?)";
  std::vector<uint64_t> back(tensors.size(), 0), attr(tensors.size(), 0);
  on_every_rank(comm, [&] {
    try {
      const H5Handle file = open_file(t.path, MPI_COMM_NULL);
      for (size_t i = 0; i < datasets.size(); ++i) {
        const WatchScope watch("checkpoint read-back");  // progress, dataset by dataset
        const SavedDataset& d = datasets[i];
        const size_t elem = dt_size(d.dt);
        const OpenDataset od = open_dataset(file.get(), d.path, d.slots, d.rows, d.cols, {d.dt}, t.path, d.layers.get());
        for (size_t j : d.tensors) attr[j] = od.stored_checksum(tensors[j].slot);
        for (const Call& call : st.plan.calls[i]) {
          std::vector<Slab> blocks;
          for (const Piece& sg : call.segments) {
            const SavedTensor& x = tensors[sg.block];
            blocks.push_back({x.slot, sg.ch.rows, x.c0 + sg.ch.col, sg.ch.w});
          }
          read_blocks(od, H5P_DEFAULT, blocks, st.buffer);
          for (const Piece& sg : call.segments) {
            const SavedTensor& x = tensors[sg.block];
            back[sg.block] += checksum_chunk(st.buffer + size_t(sg.offset) * elem, d.dt, sg.ch, x.mine, x.c0, x.cols);
          }
        }
      }
    } catch (const CheckpointError& e) {
      throw CheckpointError(std::string("reading the written file back: ") + e.what() + why);
    }
  });
  MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, back.data(), int(back.size()), MPI_UINT64_T, MPI_SUM, comm));
  for (size_t j = 0; j < tensors.size(); ++j)
    if (back[j] != sums[j] || attr[j] != sums[j])
      throw CheckpointError("reading the written file back: " + t.path + ": " + tensor_text(st.sp, j) +
                            checksum_mismatch(sums[j], back[j] != sums[j] ? back[j] : attr[j]) + why);
}

}  // namespace

std::unique_ptr<SaveJob> ckpt::prepare_save(MPI_Comm comm, const TrainerState& s, const SavePlan* tensors) {
  auto job = std::make_unique<SaveJob>();
  job->t = save_target(comm, *s.cfg, s.progress->step);
  job->sc = pack_scaling(gather_scaling(comm, *s.model));
  job->sp = tensors ? *tensors : plan_tensors(s, job->t);
  add_scaling(job->sp, job->t, job->sc);
  job->meta = save_meta(comm, job->t.rank, s);
  return job;
}

std::string ckpt::run_save(MPI_Comm comm, SaveJob& job, Backend* be, FaultPoint& fault) {
  // The watchdog's mark for the whole save: its limit applies between the watched calls inside too
  // (the checksum reductions, HDF5's own collectives).
  const WatchScope watch("checkpoint save");
  quiet_hdf5();
  const SaveTarget& t = job.t;
  make_tmp_dir(comm, t);
  const StagingPlan plan = plan_save_staging(comm, job.sp, t.staging_bytes);
  HostBuffer<unsigned char> pinned;  // pinned under CUDA
  std::vector<unsigned char> plain;  // host tensors only: no backend call off the main thread
  if (be) pinned = HostBuffer<unsigned char>(*be, plan.buffer_bytes);
  else plain.resize(size_t(plan.buffer_bytes));
  const Staging st{job.sp, plan, be, be ? pinned.data() : plain.data()};
  check_room(comm, t, job.meta, job.sp);
  const std::vector<uint64_t> sums = write_file(comm, job.meta, t, st, job.sc, fault);
  read_back(comm, t, st, sums);
  // Commit (rank 0): fsync, rename, fsync the directory, replace `latest`, prune.
  on_every_rank(comm, [&] {
    if (t.rank == 0) commit_checkpoint(t.dir, t.name, t.keep_last, fault);
  });
  return t.final_dir;
}

std::string save_checkpoint(MPI_Comm comm, const TrainerState& s) {
  const WatchScope watch("checkpoint save");
  const std::unique_ptr<SaveJob> job = prepare_save(comm, s, nullptr);
  FaultPoint fault(job->t.rank, job->t.dir);
  return run_save(comm, *job, &s.model->backend(), fault);
}

}  // namespace fp8moe
