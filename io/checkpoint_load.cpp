// The loads of io/checkpoint.h: resume_from_checkpoint, load_checkpoint_weights and
// resolve_checkpoint_dir. One load, in phases: open the file and validate its attributes and
// config; plan the reads (every tensor's block and where it goes); read the tensors chunk by chunk
// through the staging buffer (io/checkpoint_staging.cpp) into their destinations; read the
// delayed-scaling state; compare the checksums; and, for a resume, apply the rest only once the
// whole load verified.
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <map>
#include <sstream>

#include "io/checkpoint_commit.h"
#include "io/checkpoint_common.h"
#include "kernels/check.h"

namespace fp8moe {
namespace fs = std::filesystem;
using namespace ckpt;
namespace {

// What a load keeps besides the tensors, applied (apply) only when the whole load verified. The
// tensors go straight into their destinations, chunk by chunk through the staging buffer: the
// model's parameter shards and the optimizer's moments (no second copy of the model in host
// memory), or `params` (generation). So a load that fails (a checksum, a missing dataset) leaves
// the tensors a mix of the checkpoint and what they held: resume_from_checkpoint then loads an
// older checkpoint over every one of them, or throws and the job stops (app/train_loop.cpp) —
// training never starts from a mix.
struct Staged {
  Config stored;
  std::vector<std::vector<float>> params;         // without a model (generation): every parameter, whole
  AdamW* opt = nullptr;                           // nullptr: no optimizer state (generation)
  Transformer* model = nullptr;                   // the destination (nullptr: `params`)
  std::vector<RowRange> write_rows, moment_rows;  // as TrainerState's (empty: the defaults)
  std::map<std::string, HostLinearScaling> scaling;
  bool have_scaling = false;
  std::string note;     // said by rank 0 after the load
  size_t verified = 0;  // datasets whose checksums were compared
  TrainProgress progress;
  float loss_scale = 1;
  int64_t good_steps = 0, updates = 0, skipped = 0;
};

// One tensor of a load and where it goes.
struct TensorLoad {
  Place place;                 // its dataset (stacked in formats 2 and 3: DatasetLayout), and its slot
  int64_t rows = 1, cols = 1;  // the global shape
  bool moment = false;         // stored as float32 or bfloat16; else float32
  Rows part;                   // the rows read: this rank's block (its optimizer's rows, for a moment)
  Rows mine;                   // the rows whose checksum terms this rank adds (inside part)
  int64_t c0 = 0, nc = 0;      // the block's columns
  Dt dest_dt = Dt::f32;
  void* dest = nullptr;        // (part.n, nc) row-major: backend memory, or host memory without a model
};

// One load's file and its checksums (collective over comm; MPI_COMM_NULL: serial, this process
// holds everything). Every tensor read adds its stored checksum and this rank's part of the
// computed one; the parts are summed over the ranks at the end.
struct Load {
  MPI_Comm comm = MPI_COMM_NULL;
  int rank = 0, size = 1;
  std::string path;  // <dir>/checkpoint.h5
  int version = kCheckpointFormatVersion;
  H5Handle file, dxpl;
  std::vector<std::string> names;  // tensor_text of each
  std::vector<uint64_t> stored, partial;
  size_t datasets = 0;             // datasets read

  Load(MPI_Comm c, std::string p) : comm(c), path(std::move(p)) {
    if (comm == MPI_COMM_NULL) return;
    MPI_CHECK(MPI_Comm_rank(comm, &rank));
    MPI_CHECK(MPI_Comm_size(comm, &size));
  }
  hid_t xfer() const { return comm != MPI_COMM_NULL ? dxpl.get() : H5P_DEFAULT; }
  // The even share of a tensor's rows whose checksum terms this rank adds (all of them alone).
  Rows default_mine(int64_t rows) const { return comm != MPI_COMM_NULL ? my_rows(rows, rank, size) : Rows{0, rows}; }
  void add_checksum(const std::string& dataset, uint64_t stored_sum, uint64_t part) {
    names.push_back(dataset);
    stored.push_back(stored_sum);
    partial.push_back(part);
  }
};

// Phase 1: the file opened, its version, config and progress read (the same on every rank; still
// agreed on), and the stored model compared with the current config's (CheckpointMismatch).
void open_and_validate(Load& l, const Config* current, Staged* st) {
  on_every_rank(l.comm, [&] {
    l.file = open_file(l.path, l.comm);
    if (l.comm != MPI_COMM_NULL) l.dxpl = collective_xfer(l.path);
    const hid_t f = l.file.get();
    l.version = check_version(f, l.path);
    st->stored = stored_config(f, l.path);
    st->progress.step = read_attr_i64(f, "step", l.path);
    st->progress.samples = read_attr_i64(f, "samples", l.path);
    st->progress.tokens = read_attr_i64(f, "tokens", l.path);
    st->progress.last_val_loss = read_attr_f64(f, "last_val_loss", l.path);
    st->loss_scale = float(read_attr_f64(f, "loss_scale", l.path));
    st->good_steps = read_attr_i64(f, "loss_scale_good_steps", l.path);
    st->updates = read_attr_i64(f, "adam_updates", l.path);
    st->skipped = read_attr_i64(f, "adam_skipped", l.path);
    if (!current) return;
    const auto diff = model_differences(st->stored, *current);
    if (diff.empty()) return;
    std::string m = l.path + ": the checkpoint is of another model; differing keys:";
    for (const auto& d : diff) m += "\n  " + d;
    m += tensor_differences(st->stored.model, current->model);
    throw CheckpointMismatch(m);
  });
}

// This rank's block of parameter i (the whole tensor without a model: generation).
Shard block_of(const Staged& st, const ParamTable& table, size_t i) {
  return st.model ? st.model->shard(i) : Shard{0, table.params[i].rows, 0, table.params[i].cols};
}

// Phase 2a: every parameter's block, into the model's shard or a host vector of st->params.
void plan_param_reads(const Load& l, const ParamTable& table, const DatasetLayout& layout, Staged* st,
                      std::vector<TensorLoad>* loads) {
  if (!st->model) st->params.resize(table.params.size());
  for (size_t i = 0; i < table.params.size(); ++i) {
    const ParamSpec& p = table.params[i];
    const Shard sh = block_of(*st, table, i);
    TensorLoad t;
    t.place = layout.place(p, -1), t.rows = p.rows, t.cols = p.cols;
    t.part = sh.held() ? Rows{sh.r0, sh.rows} : Rows{0, 0};
    t.mine = !sh.held() ? Rows{0, 0} : st->write_rows.empty() ? l.default_mine(p.rows) : rows_of(st->write_rows[i]);
    t.c0 = sh.c0, t.nc = sh.cols;
    if (st->model) {
      t.dest = st->model->store().param(i);
    } else {
      st->params[i].resize(size_t(sh.numel()));
      t.dest = st->params[i].data();
    }
    loads->push_back(std::move(t));
  }
}

// Phase 2b: both moments of every trainable parameter: the rows of this rank's block its
// optimizer owns (all of them without ZeRO), in the optimizer's moments dtype.
void plan_moment_reads(const Load& l, const ParamTable& table, const DatasetLayout& layout, const Staged& st,
                       std::vector<TensorLoad>* loads) {
  AdamW& opt = *st.opt;
  for (int which = 0; which < 2; ++which)
    for (size_t i = 0; i < table.params.size(); ++i) {
      const ParamSpec& p = table.params[i];
      if (!p.trainable) continue;
      const Shard sh = block_of(st, table, i);
      const RowRange o = opt.owned(i);
      TensorLoad t;
      t.place = layout.place(p, which), t.rows = p.rows, t.cols = p.cols, t.moment = true;
      t.part = {sh.r0 + o.begin, o.end - o.begin};
      t.mine = !st.moment_rows.empty() ? rows_of(st.moment_rows[i]) : opt.sharded() ? t.part : l.default_mine(p.rows);
      t.c0 = sh.c0, t.nc = sh.cols;
      t.dest_dt = opt.bf16_moments() ? Dt::bf16 : Dt::f32;
      t.dest = opt.moment(which, i).raw();
      FP8MOE_ASSERT(opt.moment(which, i).numel() == t.part.n * t.nc, "moments of ", p.name, " not allocated");
      loads->push_back(std::move(t));
    }
}

// Phase 2: the tensors to read: every parameter's block, then the optimizer's rows of both moments.
std::vector<TensorLoad> plan_reads(const Load& l, const ParamTable& table, int64_t n_experts, Staged* st) {
  const DatasetLayout layout(table, n_experts, l.version);
  std::vector<TensorLoad> loads;
  plan_param_reads(l, table, layout, st, &loads);
  if (st->opt) plan_moment_reads(l, table, layout, *st, &loads);
  return loads;
}

// The datasets of a load: each with its tensors (in slot order), in the order of their first.
struct LoadDataset {
  Place place;  // the first tensor's (path, slots)
  int64_t rows = 1, cols = 1;
  bool moment = false;
  std::vector<size_t> tensors;  // indices into the loads
};
std::vector<LoadDataset> group_datasets(const std::vector<TensorLoad>& loads, std::vector<size_t>* dataset_of) {
  std::vector<LoadDataset> out;
  std::map<std::string, size_t> index;
  for (size_t j = 0; j < loads.size(); ++j) {
    const TensorLoad& t = loads[j];
    const auto [it, added] = index.emplace(t.place.path, out.size());
    if (added) out.push_back({t.place, t.rows, t.cols, t.moment, {}});
    FP8MOE_ASSERT(out[it->second].tensors.empty() || t.place.slot > loads[out[it->second].tensors.back()].place.slot,
                  t.place.path, ": tensors out of slot order");
    out[it->second].tensors.push_back(j);
    dataset_of->push_back(it->second);
  }
  return out;
}

OpenDataset open_for(const Load& l, const LoadDataset& d) {
  return d.moment ? open_dataset(l.file.get(), d.place, d.rows, d.cols, {Dt::f32, Dt::bf16}, l.path)
                  : open_dataset(l.file.get(), d.place, d.rows, d.cols, {Dt::f32}, l.path);
}

// Call `call` of a dataset (opened as od) into the staging buffer: its segments one after another
// in the stored dtype; each segment's checksum terms added to its tensor's sum in sums; the whole
// call converted to the destinations' dtype; each segment uploaded into its place; one
// synchronisation (the uploads have read the buffer before the next call overwrites it).
void stage_call(const Load& l, const std::vector<TensorLoad>& loads, const OpenDataset& od, const Call& call,
                Backend& be, unsigned char* buf, std::vector<uint64_t>& sums) {
  std::vector<Slab> blocks;
  for (const Piece& sg : call.segments) {
    const TensorLoad& t = loads[sg.block];
    blocks.push_back({t.place.slot, sg.ch.rows, t.c0 + sg.ch.col, sg.ch.w});
  }
  read_blocks(od, l.xfer(), blocks, buf);
  if (call.segments.empty()) return;
  const size_t stored = dt_size(od.dt);
  for (const Piece& sg : call.segments) {
    const TensorLoad& t = loads[sg.block];
    sums[sg.block] += checksum_chunk(buf + size_t(sg.offset) * stored, od.dt, sg.ch, t.mine, t.c0, t.cols);
  }
  const Dt dest_dt = loads[call.segments[0].block].dest_dt;  // one dataset: one destination dtype
  convert_in_place(buf, od.dt, dest_dt, call.elems);
  const size_t es = dt_size(dest_dt);
  for (const Piece& sg : call.segments) {
    const TensorLoad& t = loads[sg.block];
    const Chunk& ch = sg.ch;
    be.upload(static_cast<unsigned char*>(t.dest) + size_t((ch.rows.r0 - t.part.r0) * t.nc + ch.col) * es,
              buf + size_t(sg.offset) * es, size_t(ch.rows.n * ch.w) * es);
  }
  be.sync();
}

// Phase 3: every tensor, dataset by dataset, agreed after every call: no rank goes on into the next
// read alone. Into a model: through one buffer of at most `bound` bytes, in calls of whole FP32
// elements (a moment's call holds either dtype), the same number of calls per dataset on every
// rank (one allreduce of the counts). Without a model (serial): each tensor's block in one read
// into its host vector.
void read_tensors(Load& l, const std::vector<TensorLoad>& loads, const Staged& st, int64_t bound) {
  Backend* be = st.model ? &st.model->backend() : nullptr;
  std::vector<size_t> dataset_of;
  const std::vector<LoadDataset> datasets = group_datasets(loads, &dataset_of);
  StagingPlan plan;
  if (be) {
    std::vector<StagedBlock> blocks;
    for (size_t j = 0; j < loads.size(); ++j) blocks.push_back({loads[j].part, loads[j].nc, 4, dataset_of[j]});
    plan = plan_staging(l.comm, blocks, datasets.size(), bound);
  } else {
    plan.steps.assign(datasets.size(), 1);
  }
  HostBuffer<unsigned char> stage = be ? HostBuffer<unsigned char>(*be, plan.buffer_bytes) : HostBuffer<unsigned char>();
  std::vector<uint64_t> sums(loads.size(), 0);
  for (size_t i = 0; i < datasets.size(); ++i) {
    const LoadDataset& d = datasets[i];
    OpenDataset od;
    for (int64_t k = 0; k < plan.steps[i]; ++k)
      on_every_rank(l.comm, [&] {
        if (k == 0) od = open_for(l, d);
        if (be) {
          stage_call(l, loads, od, plan.call(i, k), *be, stage.data(), sums);
        } else {
          for (size_t j : d.tensors) {
            const TensorLoad& t = loads[j];
            FP8MOE_ASSERT(od.dt == t.dest_dt, t.place.path, ": a host destination of another dtype");
            read_blocks(od, l.xfer(), {Slab{t.place.slot, t.part, t.c0, t.nc}}, t.dest);
            sums[j] += checksum_chunk(t.dest, od.dt, {t.part, 0, t.nc}, t.mine, t.c0, t.cols);
          }
        }
        if (k + 1 < plan.steps[i]) return;
        for (size_t j : d.tensors) l.add_checksum(tensor_text(loads[j].place), od.stored_checksum(loads[j].place.slot), sums[j]);
        ++l.datasets;
      });
  }
}

// A small host-side dataset (/fp8/*), read whole by every rank; this rank adds the checksum
// terms of its even share.
DatasetRead read_whole(Load& l, const std::string& dpath, int64_t rows, int64_t cols, std::initializer_list<Dt> allowed) {
  const Rows mine = l.default_mine(rows);
  DatasetRead r;
  on_every_rank(l.comm, [&] {
    r = read_dataset(l.file.get(), l.xfer(), dpath, rows, cols, {0, rows}, allowed, l.path);
    const auto* data = static_cast<const unsigned char*>(r.data());
    l.add_checksum("dataset " + dpath, r.stored_checksum,
                   mine.n == 0 ? 0
                               : checksum_block(data + size_t(mine.r0 * cols) * dt_size(r.dt), r.dt, mine.r0, mine.n, 0,
                                                cols, cols));
    ++l.datasets;
  });
  return r;
}

// Phase 4: the delayed-scaling state, used when this run uses delayed scaling with the same
// history length (else a note says it starts afresh).
void read_scaling(Load& l, const Config& cfg, const ParamTable& table, Staged* st) {
  const bool has_fp8 = H5Lexists(l.file.get(), "/fp8", H5P_DEFAULT) > 0;
  H5Eclear2(H5E_DEFAULT);
  if (!has_fp8 || cfg.fp8.recipe != Fp8Recipe::delayed) return;
  std::string tensors;
  ScalingArrays a;
  on_every_rank(l.comm, [&] {
    H5Handle g(h5(H5Gopen2(l.file.get(), "/fp8", H5P_DEFAULT), l.path, "cannot open group /fp8"), H5Gclose);
    tensors = read_attr_str(g.get(), "tensors", l.path + ": /fp8");
    a.len = read_attr_i64(g.get(), "history_len", l.path + ": /fp8");
  });
  std::istringstream in(tensors);
  for (std::string line; std::getline(in, line);) a.names.push_back(line);
  if (a.len != cfg.fp8.amax_history_len) {
    st->note = "note: the checkpoint's amax histories have length " + std::to_string(a.len) +
               ", fp8.amax_history_len is " + std::to_string(cfg.fp8.amax_history_len) + ": delayed scaling starts afresh";
    return;
  }
  const int64_t n = int64_t(a.names.size());
  a.history = read_whole(l, "/fp8/amax_history", n, a.len, {Dt::f32}).f32;
  a.scale = read_whole(l, "/fp8/scale", n, 2, {Dt::f32}).f32;
  a.steps = read_whole(l, "/fp8/steps", n, 1, {Dt::i64}).i64;
  unpack_scaling(a, table, st->model, l.path, &st->scaling);
  st->have_scaling = true;
}

// Phase 5: the checksums, summed over the ranks that each checked a part, against the stored ones.
void verify_checksums(Load& l, Staged* st) {
  if (l.comm != MPI_COMM_NULL)
    MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, l.partial.data(), int(l.partial.size()), MPI_UINT64_T, MPI_SUM, l.comm));
  for (size_t i = 0; i < l.names.size(); ++i)
    if (l.partial[i] != l.stored[i])
      throw CheckpointError(l.path + ": " + l.names[i] + checksum_mismatch(l.stored[i], l.partial[i]));
  st->verified = l.datasets;
}

// Reads one checkpoint into `st`. The checksums are checked over this rank's rows and summed over
// the ranks. The staging buffer's bound is the current config's checkpoint.staging_bytes (the
// default without one: a serial load reads each block whole anyway).
void load_into(const std::string& dir, MPI_Comm comm, const Config* current, Staged* st) {
  quiet_hdf5();
  Load l(comm, dir + "/" + kCheckpointFile);
  open_and_validate(l, current, st);
  const Config& cfg = current ? *current : st->stored;
  const ParamTable table = build_param_table(cfg.model);
  const std::vector<TensorLoad> loads = plan_reads(l, table, cfg.model.moe.n_experts, st);
  read_tensors(l, loads, *st, current ? current->checkpoint.staging_bytes : kCheckpointStagingBytes);
  if (st->opt) read_scaling(l, cfg, table, st);
  verify_checksums(l, st);
}

// A verified load: the state besides the tensors (those are in place already).
void apply(Staged& st, const TrainerState& s) {
  s.opt->restore_counts(st.updates, st.skipped);
  // A fixed or absent loss scale comes from the config; a dynamic one continues.
  if (s.cfg->train.loss_scale.mode == LossScaleMode::dynamic && st.stored.train.loss_scale.mode == LossScaleMode::dynamic)
    s.scaler->restore(st.loss_scale, st.good_steps);
  s.model->set_fp8_scaling(st.have_scaling ? st.scaling : std::map<std::string, HostLinearScaling>{});
  *s.progress = st.progress;
}

// The checkpoints a resume tries, in order: rank 0 lists them, newest first (`latest`'s first);
// every rank gets the list.
std::vector<std::string> resume_candidates(MPI_Comm comm, int rank, const CheckpointConfig& c) {
  std::string list;
  on_every_rank(comm, [&] {
    if (rank != 0) return;
    if (c.resume != "auto") {
      list = resolve_checkpoint_dir(c.resume) + "\n";
      return;
    }
    std::error_code ec;
    const bool exists = fs::is_directory(c.dir, ec);
    if (ec && ec != std::errc::no_such_file_or_directory) throw CheckpointUnreadable(c.dir + ": cannot read: " + ec.message());
    const auto all = exists ? committed_checkpoints(c.dir) : decltype(committed_checkpoints(""))();
    std::string problem;
    const std::string latest = exists ? read_latest(c.dir, &problem) : "";
    if (!latest.empty()) list += c.dir + "/" + latest + "\n";
    else if (!all.empty())
      std::fprintf(stderr, "fp8moe: WARNING: %s; falling back to the newest valid checkpoint in %s\n", problem.c_str(),
                   c.dir.c_str());
    for (const auto& [step, name] : all)
      if (name != latest) list += c.dir + "/" + name + "\n";
  });
  broadcast_string(comm, list, 0);
  std::vector<std::string> candidates;
  std::istringstream in(list);
  for (std::string line; std::getline(in, line);) candidates.push_back(line);
  return candidates;
}

}  // namespace

std::string resolve_checkpoint_dir(const std::string& path) {
  std::error_code ec;
  if (fs::is_regular_file(path + "/" + kCheckpointFile, ec)) return path;
  if (ec && ec != std::errc::no_such_file_or_directory)
    throw CheckpointUnreadable(path + "/" + kCheckpointFile + ": cannot read: " + ec.message());
  if (!fs::is_directory(path, ec)) {
    if (ec && ec != std::errc::no_such_file_or_directory) throw CheckpointUnreadable(path + ": cannot read: " + ec.message());
    throw CheckpointError(path + ": no such checkpoint directory");
  }
  std::string problem;
  const std::string name = read_latest(path, &problem);
  if (name.empty())
    throw CheckpointError(path + ": neither a checkpoint (no " + kCheckpointFile + ") nor a checkpoint.dir: " + problem);
  return path + "/" + name;
}

std::string resume_from_checkpoint(MPI_Comm comm, const TrainerState& s) {
  const CheckpointConfig& c = s.cfg->checkpoint;
  if (c.resume == "none") return "";
  const WatchScope watch("checkpoint load");  // as in save_checkpoint
  int rank = 0;
  MPI_CHECK(MPI_Comm_rank(comm, &rank));
  const std::vector<std::string> candidates = resume_candidates(comm, rank, c);
  if (candidates.empty()) return "";
  std::string failures;
  for (size_t i = 0; i < candidates.size(); ++i) {
    Staged st;
    st.opt = s.opt;
    st.model = s.model;
    st.write_rows = s.write_rows;
    st.moment_rows = s.moment_write_rows;
    try {
      load_into(candidates[i], comm, s.cfg, &st);
    } catch (const CheckpointMismatch&) {
      throw;
    } catch (const CheckpointUnreadable&) {
      throw;  // not damage: an older checkpoint would only hide it
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
  load_into(resolve_checkpoint_dir(dir), MPI_COMM_NULL, nullptr, &st);
  *params = std::move(st.params);
  return st.stored;
}

}  // namespace fp8moe
