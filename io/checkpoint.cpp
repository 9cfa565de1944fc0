// Save, load and resume of the sharded checkpoints (io/checkpoint.h). The HDF5 layer is
// io/hdf5_file.h, the commit protocol (fsync, rename, `latest`, pruning, fault points)
// io/checkpoint_commit.h; inspect_checkpoint is in io/checkpoint_inspect.cpp.
#include "io/checkpoint.h"

#include <hdf5.h>

#include <algorithm>
#include <cctype>
#include <iterator>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <map>
#include <set>
#include <sstream>
#include <utility>

#include "io/checkpoint_commit.h"
#include "io/config.h"
#include "io/hdf5_file.h"
#include "kernels/check.h"
#include "kernels/fp8.h"
#include "parallel/mpi_session.h"
#include "parallel/watchdog.h"

namespace fp8moe {
namespace fs = std::filesystem;
using namespace ckpt;
namespace {

// ---------------------------------------------------------------- agreement between ranks

// Runs one step of a save or a load on this rank, then agrees with the other ranks of `comm`
// (MPI_COMM_NULL: this process alone): when any rank threw a CheckpointError, every rank throws
// the lowest failing rank's, of the same type (CheckpointMismatch and CheckpointUnreadable stay so). Every step that a
// collective call follows goes through here, so that no rank goes on into it alone.
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
Rows rows_of(RowRange r) { return {r.begin, r.end - r.begin}; }
Rows my_rows(int64_t rows, int rank, int size) {
  return rows_of(replica_rows(rows, rank, size));  // the same split as ZeRO-1's (model/placement.h)
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
// matters at initialisation and model.mtp_loss_weight is a schedule (DeepSeek-V3: 0.3, then 0.1):
// they may differ.
std::vector<std::string> model_differences(const Config& stored, const Config& current) {
  const auto a = flat_yaml(config_to_yaml(stored)), b = flat_yaml(config_to_yaml(current));
  std::vector<std::string> diff;
  for (const auto& [k, v] : a)
    if (k.rfind("model.", 0) == 0 && k != "model.init_std" && k != "model.mtp_loss_weight" && b.count(k) &&
        b.at(k) != v)
      diff.push_back(k + ": checkpoint " + v + ", config " + b.at(k));
  return diff;
}

// The parameter names of one model but not the other, with layer and expert numbers as `*` and
// a count ("\n  only in the checkpoint: layers.*.attn.wk (4 tensors)"); "" when both have the same.
std::string tensor_differences(const ModelConfig& stored, const ModelConfig& current) {
  auto pattern = [](const std::string& name) {
    std::string out;
    for (size_t i = 0; i < name.size();) {
      const bool number = std::isdigit(static_cast<unsigned char>(name[i])) && (i == 0 || name[i - 1] == '.');
      if (!number) {
        out += name[i++];
        continue;
      }
      while (i < name.size() && std::isdigit(static_cast<unsigned char>(name[i]))) ++i;
      out += '*';
    }
    return out;
  };
  auto names = [](const ModelConfig& m) {
    std::set<std::string> out;
    for (const ParamSpec& p : build_param_table(m).params) out.insert(p.name);
    return out;
  };
  const std::set<std::string> a = names(stored), b = names(current);
  auto only = [&](const std::set<std::string>& x, const std::set<std::string>& y, const char* where) {
    std::map<std::string, int64_t> groups;
    for (const std::string& n : x)
      if (!y.count(n)) ++groups[pattern(n)];
    std::string out;
    for (const auto& [g, count] : groups)
      out += "\n  only in the " + std::string(where) + ": " + g + " (" + std::to_string(count) +
             (count == 1 ? " tensor)" : " tensors)");
    return out;
  };
  return only(a, b, "checkpoint") + only(b, a, "config's model");
}

// ---------------------------------------------------------------- delayed-scaling state

const char* const kScalingFields[3] = {"x", "w", "dy"};

DelayedScaling& scaling_field(HostLinearScaling& s, int f) { return f == 0 ? s.x : f == 1 ? s.w : s.dy; }
const DelayedScaling& scaling_field(const HostLinearScaling& s, int f) { return f == 0 ? s.x : f == 1 ? s.w : s.dy; }

struct ScalingArrays {
  std::vector<std::string> names;  // "<weight>.<x|w|dy>"
  int64_t len = 0;
  std::vector<float> history, scale;  // (n, len), (n, 2)
  std::vector<int64_t> steps;         // (n, 1)
};

// Every rank's delayed-scaling entries of the weights it holds, merged (replicas hold identical
// copies: their amax values are reduced): each rank serialises its own, one allgather. Collective.
std::map<std::string, HostLinearScaling> gather_scaling(MPI_Comm comm, Transformer& model) {
  std::string mine;
  auto put = [&](const void* p, size_t n) { mine.append(static_cast<const char*>(p), n); };
  for (auto& [weight, s] : model.fp8_scaling_to_host()) {
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
  std::map<std::string, HostLinearScaling> merged;
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

ScalingArrays pack_scaling(const std::map<std::string, HostLinearScaling>& state) {
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

// ---------------------------------------------------------------- staging

// The bound on the host buffer a save or a load stages tensors through (io/checkpoint.h).
int64_t staging_bytes() {
  const char* e = std::getenv("FP8MOE_CKPT_STAGING_BYTES");
  if (!e || !*e) return kCheckpointStagingBytes;
  char* end = nullptr;
  const long long v = std::strtoll(e, &end, 10);
  if (*end != '\0' || v <= 0) return kCheckpointStagingBytes;
  return std::max<int64_t>(v, 8);  // one element of every type
}

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
  Rows rows;              // global rows
  int64_t col = 0, w = 0; // columns [col, col + w) of the block
  bool empty() const { return rows.n <= 0 || w <= 0; }
};

Chunks chunks_of(Rows rows, int64_t width, size_t elem, int64_t buffer) {
  Chunks c{rows, width};
  if (rows.n <= 0 || width <= 0) return c;
  const int64_t cap = std::max<int64_t>(1, buffer / int64_t(elem));  // elements per chunk
  if (width <= cap) {
    c.rows_per = cap / width, c.piece = width;
    c.count = (rows.n + c.rows_per - 1) / c.rows_per;
  } else {
    c.pieces = (width + cap - 1) / cap, c.piece = cap;
    c.count = rows.n * c.pieces;
  }
  return c;
}

// Chunk k; k >= c.count (a rank with fewer chunks than the others): an empty one.
Chunk chunk_at(const Chunks& c, int64_t k) {
  if (k >= c.count) return {};
  if (c.pieces == 1) {
    const int64_t r = c.rows.r0 + k * c.rows_per;
    return {{r, std::min(c.rows_per, c.rows.r0 + c.rows.n - r)}, 0, c.width};
  }
  const int64_t col = (k % c.pieces) * c.piece;
  return {{c.rows.r0 + k / c.pieces, 1}, col, std::min(c.piece, c.width - col)};
}

// The bytes of the largest chunk (the first).
int64_t largest_chunk(const Chunks& c, size_t elem) {
  const Chunk ch = chunk_at(c, 0);
  return ch.empty() ? 0 : ch.rows.n * ch.w * int64_t(elem);
}

// The checksum terms of the rows of chunk `ch` (held in buf, (ch.rows.n, ch.w) row-major) that lie
// in `mine`; c0: the block's first global column, cols the tensor's.
uint64_t checksum_chunk(const void* buf, Dt t, const Chunk& ch, Rows mine, int64_t c0, int64_t cols) {
  const int64_t lo = std::max(ch.rows.r0, mine.r0), hi = std::min(ch.rows.r0 + ch.rows.n, mine.r0 + mine.n);
  if (ch.empty() || mine.n <= 0 || lo >= hi) return 0;
  return checksum_block(static_cast<const unsigned char*>(buf) + size_t((lo - ch.rows.r0) * ch.w) * dt_size(t), t, lo,
                        hi - lo, c0 + ch.col, ch.w, cols);
}

// Moments stored in the other dtype than train.moments_dtype, converted in place in the staging
// buffer (n elements; it holds n FP32 values): FP32 -> BF16 round-to-nearest-even front to back
// (each BF16 lands at or before its FP32), BF16 -> FP32 exactly back to front.
void convert_in_place(unsigned char* buf, Dt from, Dt to, int64_t n) {
  if (from == to) return;
  FP8MOE_ASSERT((from == Dt::f32 && to == Dt::bf16) || (from == Dt::bf16 && to == Dt::f32), "checkpoint: no conversion from ",
                dt_name(from), " to ", dt_name(to));
  if (from == Dt::f32) {
    for (int64_t j = 0; j < n; ++j) {
      float f;
      std::memcpy(&f, buf + 4 * j, 4);
      const uint16_t b = bf16_encode(f);
      std::memcpy(buf + 2 * j, &b, 2);
    }
  } else {
    for (int64_t j = n; j-- > 0;) {
      uint16_t b;
      std::memcpy(&b, buf + 2 * j, 2);
      const float f = bf16_decode(b);
      std::memcpy(buf + 4 * j, &f, 4);
    }
  }
}

// ---------------------------------------------------------------- the load

// What a load keeps besides the tensors, applied (apply) only when the whole load verified. The
// tensors go straight into their destinations, chunk by chunk through the staging buffer: the
// model's parameter shards and the optimizer's moments (no second copy of the model in host
// memory), or `params` (generation). So a load that fails (a checksum, a missing dataset) leaves
// the tensors a mix of the checkpoint and what they held: resume_from_checkpoint then loads an
// older checkpoint over every one of them, or throws and the job stops (app/train_loop.cpp) —
// training never starts from a mix.
struct Staged {
  Config stored;
  std::vector<std::vector<float>> params;              // without a model (generation): every parameter, whole
  AdamW* opt = nullptr;                                // nullptr: no optimizer state (generation)
  Transformer* model = nullptr;                        // the destination (nullptr: `params`)
  std::vector<RowRange> write_rows, moment_rows;       // as TrainerState's (empty: the defaults)
  std::map<std::string, HostLinearScaling> scaling;
  bool have_scaling = false;
  std::string note;  // said by rank 0 after the load
  size_t verified = 0;  // datasets whose checksum was compared
  TrainProgress progress;
  float loss_scale = 1;
  int64_t good_steps = 0, updates = 0, skipped = 0;
};

// One tensor dataset of a load and where it goes.
struct TensorLoad {
  std::string path;
  int64_t rows = 1, cols = 1;  // the global shape
  bool moment = false;         // stored as float32 or bfloat16; else float32
  Rows part;                   // the rows read: this rank's block (its optimizer's rows, for a moment)
  Rows mine;                   // the rows whose checksum terms this rank adds (inside part)
  int64_t c0 = 0, nc = 0;      // the block's columns
  Dt dest_dt = Dt::f32;
  void* dest = nullptr;        // (part.n, nc) row-major: backend memory, or host memory without a model
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
        m += tensor_differences(st->stored.model, current->model);
        throw CheckpointMismatch(m);
      }
    }
  });

  const Config& cfg = current ? *current : st->stored;
  const ParamTable table = build_param_table(cfg.model);
  const hid_t xfer = comm != MPI_COMM_NULL ? dxpl.get() : H5P_DEFAULT;
  std::vector<std::string> names;
  std::vector<uint64_t> stored, partial;
  // The even share of a tensor's rows whose checksum terms this rank adds (all of them alone).
  auto default_mine = [&](int64_t rows) { return comm != MPI_COMM_NULL ? my_rows(rows, rank, size) : Rows{0, rows}; };

  // The tensors: every parameter's block, then the optimizer's rows of both moments.
  std::vector<TensorLoad> loads;
  // This rank's block of each parameter (the whole tensor without a model: generation).
  auto shard = [&](size_t i) { return st->model ? st->model->shard(i) : Shard{0, table.params[i].rows, 0, table.params[i].cols}; };
  if (!st->model) st->params.resize(table.params.size());
  for (size_t i = 0; i < table.params.size(); ++i) {
    const ParamSpec& p = table.params[i];
    const Shard sh = shard(i);
    TensorLoad t;
    t.path = param_dataset(p.name), t.rows = p.rows, t.cols = p.cols;
    t.part = sh.held() ? Rows{sh.r0, sh.rows} : Rows{0, 0};
    t.mine = !sh.held() ? Rows{0, 0} : st->write_rows.empty() ? default_mine(p.rows) : rows_of(st->write_rows[i]);
    t.c0 = sh.c0, t.nc = sh.cols;
    if (st->model) {
      t.dest = st->model->store().param(i);
    } else {
      st->params[i].resize(size_t(sh.numel()));
      t.dest = st->params[i].data();
    }
    loads.push_back(std::move(t));
  }
  if (st->opt) {
    AdamW& opt = *st->opt;
    for (int which = 0; which < 2; ++which)
      for (size_t i = 0; i < table.params.size(); ++i) {
        const ParamSpec& p = table.params[i];
        if (!p.trainable) continue;
        // The rows of this rank's block its optimizer owns (all of them without ZeRO).
        const Shard sh = shard(i);
        const RowRange o = opt.owned(i);
        TensorLoad t;
        t.path = moment_dataset(which, p.name), t.rows = p.rows, t.cols = p.cols, t.moment = true;
        t.part = {sh.r0 + o.begin, o.end - o.begin};
        t.mine = !st->moment_rows.empty() ? rows_of(st->moment_rows[i]) : opt.sharded() ? t.part : default_mine(p.rows);
        t.c0 = sh.c0, t.nc = sh.cols;
        t.dest_dt = opt.bf16_moments() ? Dt::bf16 : Dt::f32;
        t.dest = opt.moment(which, i).raw();
        FP8MOE_ASSERT(opt.moment(which, i).numel() == t.part.n * t.nc, "moments of ", p.name, " not allocated");
        loads.push_back(std::move(t));
      }
  }
  // Into a model: through the staging buffer, in chunks of whole FP32 elements (a moment's chunk
  // holds either dtype), the same number of reads per dataset on every rank (one allreduce of the
  // counts); without one (serial), each block in one read into its host vector.
  const int64_t bound = staging_bytes();
  std::vector<Chunks> chunks(loads.size());
  std::vector<int64_t> counts(loads.size(), 1);
  int64_t stage_bytes = 0;
  if (st->model) {
    for (size_t j = 0; j < loads.size(); ++j) {
      chunks[j] = chunks_of(loads[j].part, loads[j].nc, 4, bound);
      counts[j] = chunks[j].count;
      stage_bytes = std::max(stage_bytes, largest_chunk(chunks[j], 4));
    }
    if (comm != MPI_COMM_NULL && !counts.empty())
      MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, counts.data(), int(counts.size()), MPI_INT64_T, MPI_MAX, comm));
  }
  Backend* be = st->model ? &st->model->backend() : nullptr;
  HostBuffer<unsigned char> stage = be ? HostBuffer<unsigned char>(*be, stage_bytes) : HostBuffer<unsigned char>();
  for (size_t j = 0; j < loads.size(); ++j) {
    const TensorLoad& t = loads[j];
    OpenDataset d;
    uint64_t sum = 0;
    const int64_t steps = std::max<int64_t>(1, counts[j]);  // every rank opens the dataset, even with no rows
    for (int64_t k = 0; k < steps; ++k)
      on_every_rank(comm, [&] {  // agreed after every chunk: no rank goes on into the next read alone
        if (k == 0)
          d = t.moment ? open_dataset(file.get(), t.path, t.rows, t.cols, {Dt::f32, Dt::bf16}, path)
                       : open_dataset(file.get(), t.path, t.rows, t.cols, {Dt::f32}, path);
        if (be) {
          const Chunk ch = chunk_at(chunks[j], k);
          read_block(d, xfer, ch.rows, t.c0 + ch.col, ch.w, stage.data());
          if (!ch.empty()) {
            sum += checksum_chunk(stage.data(), d.dt, ch, t.mine, t.c0, t.cols);
            const int64_t n = ch.rows.n * ch.w;
            convert_in_place(stage.data(), d.dt, t.dest_dt, n);
            const size_t es = dt_size(t.dest_dt);
            be->upload(static_cast<unsigned char*>(t.dest) + size_t((ch.rows.r0 - t.part.r0) * t.nc + ch.col) * es,
                       stage.data(), size_t(n) * es);
            be->sync();  // the upload has read the buffer before the next chunk overwrites it
          }
        } else {
          FP8MOE_ASSERT(d.dt == t.dest_dt, t.path, ": a host destination of another dtype");
          read_block(d, xfer, t.part, t.c0, t.nc, t.dest);
          sum += checksum_chunk(t.dest, d.dt, {t.part, 0, t.nc}, t.mine, t.c0, t.cols);
        }
        if (k + 1 == steps) {
          names.push_back(t.path);
          stored.push_back(d.stored_checksum);
          partial.push_back(sum);
        }
      });
  }
  stage.reset();

  // Delayed scaling: used when this run uses delayed scaling with the same history length. Small
  // host state: read whole.
  auto read = [&](const std::string& dpath, int64_t rows, int64_t cols, std::initializer_list<Dt> allowed) {
    const Rows mine = default_mine(rows);
    DatasetRead r;
    on_every_rank(comm, [&] {
      r = read_dataset(file.get(), xfer, dpath, rows, cols, {0, rows}, allowed, path);
      names.push_back(dpath);
      stored.push_back(r.stored_checksum);
      partial.push_back(mine.n == 0 ? 0
                                    : checksum_block(static_cast<const unsigned char*>(r.data()) +
                                                         size_t(mine.r0 * cols) * dt_size(r.dt),
                                                     r.dt, mine.r0, mine.n, 0, cols, cols));
    });
    return r;
  };
  if (st->opt) {
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
          const auto known = std::find(std::begin(kScalingFields), std::end(kScalingFields), field);
          const int f = known == std::end(kScalingFields) ? -1 : int(known - std::begin(kScalingFields));
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
    if (partial[i] != stored[i])
      throw CheckpointError(path + ": dataset " + names[i] + checksum_mismatch(stored[i], partial[i]));
    ++st->verified;
  }
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

// ---------------------------------------------------------------- the save

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

}  // namespace

std::string save_checkpoint(MPI_Comm comm, const TrainerState& s) {
  // The watchdog's mark for the whole save: its limit applies between the watched calls inside too
  // (the checksum reductions, HDF5's own collectives).
  const WatchScope watch("checkpoint save");
  quiet_hdf5();
  int rank = 0, size = 1;
  MPI_CHECK(MPI_Comm_rank(comm, &rank));
  MPI_CHECK(MPI_Comm_size(comm, &size));
  const Config& cfg = *s.cfg;
  const std::string dir = cfg.checkpoint.dir, name = checkpoint_name(s.progress->step);
  const std::string final_dir = dir + "/" + name, tmp_dir = final_dir + ".tmp";
  const std::string path = tmp_dir + "/" + kCheckpointFile;
  FaultPoint fault(rank, dir);
  // The watchdog's limit on a close that may never return (parallel/watchdog.h): after a failed
  // write, at most 5 s; for a close of a file written without error, runtime.timeout_s.
  const double limit = cfg.runtime.timeout_s > 0 ? cfg.runtime.timeout_s : 600.0;
  const double failed_limit = std::min(limit, 5.0);
  constexpr int kExitFailure = 1;  // app/exit_codes.h

  on_every_rank(comm, [&] {
    if (rank != 0) return;
    std::error_code ec;
    fs::create_directories(dir, ec);
    if (!ec) fs::remove_all(tmp_dir, ec);  // a crashed earlier save of this step
    if (!ec) fs::create_directory(tmp_dir, ec);
    if (ec) throw CheckpointError(tmp_dir + ": cannot create: " + ec.message());
  });

  // The datasets, in file order. The parameters and moments stay in the model's backend memory
  // and are staged through one host buffer of at most staging_bytes() (io/checkpoint.h), chunk by
  // chunk; the ranks agree on each dataset's number of chunks (the most any rank has: one
  // allreduce), since a collective write needs the same number of calls on every rank.
  const ParamTable& table = s.model->table();
  Backend& be = s.model->backend();
  std::vector<SavedDataset> tensors;
  auto whole = [&](std::string path, Dt dt, int64_t rows, int64_t cols, const void* data) {
    tensors.push_back({std::move(path), dt, rows, cols, data, false, 0, my_rows(rows, rank, size)});
  };
  for (size_t i = 0; i < table.params.size(); ++i) {
    const ParamSpec& p = table.params[i];
    const Shard& sh = s.model->shard(i);
    const Rows mine = !sh.held() ? Rows{0, 0}
                      : s.write_rows.empty() ? my_rows(p.rows, rank, size)
                                             : rows_of(s.write_rows[i]);
    tensors.push_back({param_dataset(p.name), Dt::f32, p.rows, p.cols, s.model->store().param(i), true, sh.r0, mine,
                       sh.c0, sh.cols});
  }
  for (int w = 0; w < 2; ++w)
    for (size_t i = 0; i < table.params.size(); ++i) {
      const ParamSpec& p = table.params[i];
      if (!p.trainable) continue;
      const std::string dpath = moment_dataset(w, p.name);
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
      tensors.push_back({dpath, dt, p.rows, p.cols, s.opt->moment(w, i).raw(), true, sh.r0 + o.begin, mine, sh.c0, sh.cols});
    }
  const ScalingArrays sc = pack_scaling(gather_scaling(comm, *s.model));
  const int64_t n_sc = int64_t(sc.names.size());
  if (n_sc > 0) {
    whole("/fp8/amax_history", Dt::f32, n_sc, sc.len, sc.history.data());
    whole("/fp8/scale", Dt::f32, n_sc, 2, sc.scale.data());
    whole("/fp8/steps", Dt::i64, n_sc, 1, sc.steps.data());
  }
  const int64_t bound = staging_bytes();
  std::vector<Chunks> chunks(tensors.size());
  std::vector<int64_t> counts(tensors.size());
  int64_t stage_bytes = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const SavedDataset& t = tensors[i];
    chunks[i] = chunks_of(t.mine, t.width(), dt_size(t.dt), bound);
    counts[i] = chunks[i].count;
    stage_bytes = std::max(stage_bytes, largest_chunk(chunks[i], dt_size(t.dt)));
  }
  MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, counts.data(), int(counts.size()), MPI_INT64_T, MPI_MAX, comm));
  // Each dataset's checksum, summed chunk by chunk over what was staged (the terms add up), then
  // over the ranks (one allreduce once every dataset is written).
  std::vector<uint64_t> sums(tensors.size(), 0);
  HostBuffer<unsigned char> stage(be, stage_bytes);  // pinned under CUDA; the write's and the read-back's

  // Room for the file, before any rank writes: the datasets' bytes, and for HDF5's metadata 2 KiB a
  // dataset (measured: about 520 bytes), the config text and 64 KiB.
  double need = 65536 + double(config_to_yaml(cfg).size() + 2048 * tensors.size());
  for (const SavedDataset& t : tensors) need += double(t.rows) * double(t.cols) * double(dt_size(t.dt));
  on_every_rank(comm, [&] {
    if (rank == 0) check_space(tmp_dir, int64_t(need));
  });

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
    // Closing a file: HDF5's close runs collectives (metadata flush, MPI-IO close), and a close that
    // fails on one rank, or a write that failed on some, can leave the ranks in different ones. So
    // every close is guarded. After a failed write, a close that does not finish ends the job with
    // the save's message (exit 1). After none, it is a file system that filled during the close
    // (exit 1, as for a failed write) or a rank that stopped (exit 4, requeue-able, as the
    // watchdog would), told apart by the space left when the guard fires. A close that fails leaves
    // HDF5 unable to shut down, so that ends the job too.
    auto close_file = [&](const std::string& failure, double guard_s) {
      const WatchScope guard("closing a checkpoint file", guard_s, [=]() -> WatchVerdict {
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
        abort_job("rank " + std::to_string(rank) + ": checkpoint save failed: " +
                      (failure.empty() ? "closing the file failed" : failure) +
                      " (the previous checkpoint is intact); HDF5 could not close " + path + " (" + h5_error_text() +
                      "): ending the job",
                  kExitFailure);
    };
    try {
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
        const SavedDataset& t = tensors[i];
        const size_t es = dt_size(t.dt);
        const std::string at = path + ": dataset " + t.path;
        H5Handle ds;
        const int64_t steps = std::max<int64_t>(1, counts[i]);  // every rank creates the dataset, even with no rows
        for (int64_t k = 0; k < steps; ++k)
          on_every_rank(comm, [&] {  // agreed after every chunk: no rank goes on into the next write alone
            if (k == 0) ds = create_dataset(file.get(), t.path, t.dt, t.rows, t.cols, path);
            const Chunk ch = chunk_at(chunks[i], k);
            const void* buf = nullptr;
            if (!ch.empty()) {
              const size_t bytes = size_t(ch.rows.n * ch.w) * es;
              if (t.device) {
                be.download(stage.data(), t.at(ch.rows.r0, ch.col), bytes);
                be.sync();
                buf = stage.data();
              } else {
                buf = t.at(ch.rows.r0, ch.col);
              }
              sums[i] += checksum_chunk(buf, t.dt, ch, t.mine, t.c0, t.cols);
            }
            write_block(ds.get(), dxpl.get(), t.dt, t.rows, t.cols, ch.rows, t.c0 + ch.col, ch.w, buf, at);
            if (k + 1 == steps) ds.reset();
            if (k + 1 == steps && i + 1 == tensors.size() && n_sc > 0) {
              H5Handle g(h5(H5Gopen2(file.get(), "/fp8", H5P_DEFAULT), path, "cannot open group /fp8"), H5Gclose);
              write_attr(g.get(), "tensors", join_lines(sc.names), path + ": /fp8");
              write_attr(g.get(), "history_len", sc.len, path + ": /fp8");
            }
          });
        fault.hit();
        if (i == 0) fault.fill_at("first-dataset");
        if (i == tensors.size() / 2) fault.fill_at("middle");
      }
      // The checksums, once the sums are global: every rank writes the same values.
      MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, sums.data(), int(sums.size()), MPI_UINT64_T, MPI_SUM, comm));
      on_every_rank(comm, [&] {
        for (size_t i = 0; i < tensors.size(); ++i) write_checksum(file.get(), tensors[i].path, sums[i], path);
      });
      fault.fill_at("before-close");
    } catch (const CheckpointError& e) {  // every rank is here: on_every_rank agreed
      close_file(e.what(), failed_limit);
      throw;
    }
    close_file("", limit);
    on_every_rank(comm, [&] { fault.hit(); });
  }

  // Read back before the commit, every rank its own rows: a write that did not reach the file
  // (MPI-IO can report a failed write that HDF5 does not pass on) never becomes a checkpoint.
  {
    H5Handle file, dxpl;
    std::vector<uint64_t> back(tensors.size(), 0), attr(tensors.size(), 0);
    auto reading_back = [&](auto&& step) {
      try {
        step();
      } catch (const CheckpointError& e) {
        throw CheckpointError(std::string("reading the written file back: ") + e.what() +
                              ": not every write reached the file system (is it full?)");
      }
    };
    on_every_rank(comm, [&] {
      reading_back([&] {
        file = open_file(path, comm);
        dxpl = collective_xfer(path);
      });
    });
    for (size_t i = 0; i < tensors.size(); ++i) {
      const SavedDataset& t = tensors[i];
      OpenDataset d;
      const int64_t steps = std::max<int64_t>(1, counts[i]);
      for (int64_t k = 0; k < steps; ++k)
        on_every_rank(comm, [&] {
          reading_back([&] {
            if (k == 0) d = open_dataset(file.get(), t.path, t.rows, t.cols, {t.dt}, path);
            const Chunk ch = chunk_at(chunks[i], k);
            read_block(d, dxpl.get(), ch.rows, t.c0 + ch.col, ch.w, stage.data());
            back[i] += checksum_chunk(stage.data(), t.dt, ch, t.mine, t.c0, t.cols);
            attr[i] = d.stored_checksum;
          });
        });
    }
    MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, back.data(), int(back.size()), MPI_UINT64_T, MPI_SUM, comm));
    for (size_t i = 0; i < tensors.size(); ++i)
      if (back[i] != sums[i] || attr[i] != sums[i])
        throw CheckpointError("reading the written file back: " + path + ": dataset " + tensors[i].path +
                              checksum_mismatch(sums[i], back[i] != sums[i] ? back[i] : attr[i]) +
                              ": not every write reached the file system (is it full?)");
  }

  // Commit (rank 0): fsync, rename, fsync the directory, replace `latest`, prune.
  on_every_rank(comm, [&] {
    if (rank == 0) commit_checkpoint(dir, name, cfg.checkpoint.keep_last, fault);
  });
  return final_dir;
}

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
  // Rank 0 lists the candidates, newest first; every rank tries them in that order.
  std::string list;
  on_every_rank(comm, [&] {
    if (rank != 0) return;
    if (c.resume != "auto") {
      list = resolve_checkpoint_dir(c.resume) + "\n";
    } else {
      std::error_code ec;
      const bool exists = fs::is_directory(c.dir, ec);
      if (ec && ec != std::errc::no_such_file_or_directory)
        throw CheckpointUnreadable(c.dir + ": cannot read: " + ec.message());
      const auto all = exists ? committed_checkpoints(c.dir) : decltype(committed_checkpoints(""))();
      std::string problem;
      const std::string latest = exists ? read_latest(c.dir, &problem) : "";
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
