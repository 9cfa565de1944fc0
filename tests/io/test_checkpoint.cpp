// Checkpoint save/load under MPI (np 1, 2, 3): a state with predictable, distinct values in every
// tensor is saved by all ranks (each writing its rows), then loaded by one rank alone and by all
// ranks, and must come back bit for bit; a save by one rank alone gives the same file contents
// and checksums as the save by all ranks (the checksum does not depend on the layout).
#include <gtest/gtest.h>
#include <mpi.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <string>

#include "io/checkpoint.h"
#include "io/config.h"
#include "kernels/backend.h"
#include "parallel/mpi_session.h"

namespace fp8moe {
namespace {

namespace fs = std::filesystem;

Config small_config(const std::string& dir, bool bf16, Fp8Recipe recipe) {
  Config c;
  c.model.vocab_size = 256;
  c.model.d_model = 32;
  c.model.n_layers = 2;
  c.model.n_heads = 2;
  c.model.n_kv_heads = 1;
  c.model.head_dim = 16;
  c.model.d_ff_dense = 48;
  c.model.moe.n_experts = 3;
  c.model.moe.d_expert = 16;
  c.train.steps = 10;
  c.train.warmup_steps = 1;
  c.train.moments_dtype = bf16 ? MomentsDtype::bf16 : MomentsDtype::fp32;
  c.train.loss_scale.mode = LossScaleMode::dynamic;
  c.fp8.recipe = recipe;
  c.fp8.amax_history_len = 5;
  c.checkpoint.dir = dir;
  c.checkpoint.keep_last = 2;
  return c;
}

// Every value distinct and a function of (tensor, index, salt): a misplaced row cannot go unseen.
float value(size_t tensor, size_t i, int salt) {
  return float(std::sin(double(tensor) * 1.37 + double(i) * 0.011 + salt)) * float(1 + salt);
}

// The model and optimizer on a backend: cpu, or the emulated device (whose memory the host cannot
// read: the checkpoint code must stage it through the backend).
Backend& backend_of(DeviceKind kind) {
  static const std::unique_ptr<Backend> cpu = make_backend(DeviceKind::cpu), emulated = make_backend(DeviceKind::emulated);
  return kind == DeviceKind::cpu ? *cpu : *emulated;
}

struct Trainer {
  Config cfg;
  Transformer model;
  AdamW opt;
  LossScaler scaler;
  TrainProgress progress;
  explicit Trainer(const Config& c, std::vector<RowRange> owned = {}, DeviceKind kind = DeviceKind::cpu)
      : cfg(c), model(backend_of(kind), c), opt(backend_of(kind), model.table(), c.train, std::move(owned)),
        scaler(c.train) {}
  TrainerState state() { return {&cfg, &model, &opt, &scaler, &progress, "test layout", {}, {}}; }
  Backend& be() { return model.backend(); }

  void fill(int salt) {
    for (size_t t = 0; t < model.table().params.size(); ++t) {
      std::vector<float> p(size_t(model.shard(t).numel()));
      for (size_t i = 0; i < p.size(); ++i) p[i] = value(t, i, salt);
      model.set_param(t, p);
      const size_t first = size_t(opt.owned(t).begin * model.table().params[t].cols);  // global index of element 0
      for (int w = 0; w < 2; ++w) {
        Tensor& m = opt.moment(w, t);
        if (opt.bf16_moments()) {
          std::vector<uint16_t> h(size_t(m.numel()));
          for (size_t i = 0; i < h.size(); ++i) h[i] = bf16_encode(std::fabs(value(t, first + i, salt + 1 + w)));
          to_device(be(), h, m.data<uint16_t>());
        } else {
          std::vector<float> h(size_t(m.numel()));
          for (size_t i = 0; i < h.size(); ++i) h[i] = std::fabs(value(t, first + i, salt + 1 + w));
          to_device(be(), h, m.f32());
        }
      }
    }
    opt.restore_counts(7 + salt, 2);
    scaler.restore(1024.0f * float(salt + 1), 3 + salt);
    if (cfg.fp8.recipe == Fp8Recipe::delayed) {
      std::map<std::string, HostLinearScaling> scaling;
      const char* names[] = {"layers.0.attn.wq", "layers.1.moe.experts.2.w2"};
      for (int n = 0; n < 2; ++n) {
        HostLinearScaling& s = scaling[names[n]];
        for (DelayedScaling* d : {&s.x, &s.w, &s.dy}) {
          *d = make_delayed_scaling(cfg.fp8.amax_history_len);
          for (size_t i = 0; i < d->history.size(); ++i) d->history[i] = value(size_t(n), i, salt + 5);
          d->steps = 11 + salt, d->scale = 0.5f + float(n), d->last_used = 0.25f + float(salt);
        }
      }
      model.set_fp8_scaling(scaling);
    }
    progress = {12 + salt, 96 + salt, 3072 + salt, 1.5 + salt};
  }

  // Bitwise equality of everything a checkpoint holds.
  void expect_same(Trainer& o) {
    const auto params = model.params_to_host(), other = o.model.params_to_host();
    ASSERT_EQ(params.size(), other.size());
    for (size_t t = 0; t < params.size(); ++t) {
      const auto& a = params[t];
      const auto& b = other[t];
      ASSERT_EQ(a.size(), b.size());
      EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * 4)) << model.table().params[t].name;
      for (int w = 0; w < 2; ++w) {
        if (opt.bf16_moments()) EXPECT_EQ(to_host<uint16_t>(opt.moment(w, t)), to_host<uint16_t>(o.opt.moment(w, t))) << w << " " << t;
        else EXPECT_EQ(to_host<float>(opt.moment(w, t)), to_host<float>(o.opt.moment(w, t))) << w << " " << t;
      }
    }
    EXPECT_EQ(opt.updates(), o.opt.updates());
    EXPECT_EQ(opt.skipped(), o.opt.skipped());
    EXPECT_EQ(scaler.scale(), o.scaler.scale());
    EXPECT_EQ(scaler.good_steps(), o.scaler.good_steps());
    EXPECT_EQ(progress.step, o.progress.step);
    EXPECT_EQ(progress.samples, o.progress.samples);
    EXPECT_EQ(progress.tokens, o.progress.tokens);
    EXPECT_EQ(progress.last_val_loss, o.progress.last_val_loss);
    const auto scaling = model.fp8_scaling_to_host(), other_scaling = o.model.fp8_scaling_to_host();
    ASSERT_EQ(scaling.size(), other_scaling.size());
    for (auto& [name, s] : scaling) {
      const HostLinearScaling& t = other_scaling.at(name);
      EXPECT_TRUE(s.x == t.x && s.w == t.w && s.dy == t.dy) << name;
    }
  }
};

int world_rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

// A directory shared by the ranks (rank 0 names it).
std::string shared_dir(const std::string& tag) {
  std::string d;
  if (world_rank() == 0) {
    char tmpl[] = "/tmp/fp8moe-ckpt-XXXXXX";
    d = std::string(::mkdtemp(tmpl)) + "/" + tag;
  }
  broadcast_string(MPI_COMM_WORLD, d, 0);
  return d;
}

void remove_shared(const std::string& d) {
  MPI_Barrier(MPI_COMM_WORLD);
  if (world_rank() == 0) fs::remove_all(fs::path(d).parent_path());
}

// The saving and the all-ranks loading trainers on the device of the third parameter (the one-rank
// loads on cpu): a checkpoint of the emulated device's memory is the CPU's, bit for bit.
class CheckpointRoundTrip : public testing::TestWithParam<std::tuple<bool, Fp8Recipe, DeviceKind>> {};

TEST_P(CheckpointRoundTrip, AllRanksSaveAndAnyLayoutLoadsBitExact) {
  const auto [bf16, recipe, kind] = GetParam();
  const std::string dir = shared_dir("all");
  const bool root = world_rank() == 0;
  Trainer saved(small_config(dir, bf16, recipe), {}, kind);
  saved.fill(1);
  const std::string committed = save_checkpoint(MPI_COMM_WORLD, saved.state());
  EXPECT_EQ(committed, dir + "/step_00000013");

  // One rank alone loads what all ranks wrote.
  if (root) {
    Trainer one(saved.cfg);
    one.fill(4);  // different values everywhere: the load must replace all of them
    EXPECT_EQ(resume_from_checkpoint(MPI_COMM_SELF, one.state()), committed);
    saved.expect_same(one);
  }
  // All ranks load it.
  Trainer all(saved.cfg, {}, kind);
  all.fill(6);
  EXPECT_EQ(resume_from_checkpoint(MPI_COMM_WORLD, all.state()), committed);
  saved.expect_same(all);

  // Rank 0 alone saves the same state elsewhere: the same datasets, the same bytes, the same checksums.
  const std::string dir1 = dir + "-one";
  if (root) {
    Trainer one(small_config(dir1, bf16, recipe));
    one.fill(1);
    save_checkpoint(MPI_COMM_SELF, one.state());
    const CheckpointReport a = inspect_checkpoint(dir, true), b = inspect_checkpoint(dir1, true);
    EXPECT_TRUE(a.problems.empty()) << a.problems.front();
    EXPECT_TRUE(b.problems.empty()) << b.problems.front();
    ASSERT_EQ(a.datasets.size(), b.datasets.size());
    for (size_t i = 0; i < a.datasets.size(); ++i) {
      EXPECT_EQ(a.datasets[i].path, b.datasets[i].path);
      EXPECT_EQ(a.datasets[i].stored_checksum, b.datasets[i].stored_checksum) << a.datasets[i].path;
    }
    std::vector<std::vector<float>> pa, pb;
    load_checkpoint_weights(dir, &pa);
    load_checkpoint_weights(dir1, &pb);
    EXPECT_EQ(pa, pb);
  }
  remove_shared(dir);
}

INSTANTIATE_TEST_SUITE_P(Moments, CheckpointRoundTrip,
                         testing::Values(std::make_tuple(false, Fp8Recipe::blockwise, DeviceKind::cpu),
                                         std::make_tuple(true, Fp8Recipe::delayed, DeviceKind::cpu),
                                         std::make_tuple(false, Fp8Recipe::delayed, DeviceKind::cpu),
                                         std::make_tuple(true, Fp8Recipe::delayed, DeviceKind::emulated),
                                         std::make_tuple(false, Fp8Recipe::blockwise, DeviceKind::emulated)));

TEST(Checkpoint, ShardedMomentsLoadWholeAndShardedAgain) {
  // ZeRO-1: each rank holds the moments of its rows only; the file holds the global tensors.
  const std::string dir = shared_dir("zero");
  const Config cfg = small_config(dir, false, Fp8Recipe::off);
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  std::vector<RowRange> owned;
  for (const ParamSpec& p : build_param_table(cfg.model).params) owned.push_back(replica_rows(p.rows, rank, size));
  Trainer sharded(cfg, owned);
  sharded.fill(2);
  save_checkpoint(MPI_COMM_WORLD, sharded.state());
  if (rank == 0) {
    Trainer whole(cfg);
    resume_from_checkpoint(MPI_COMM_SELF, whole.state());
    Trainer want(cfg);  // the same fill with full moments: the values are functions of global indices
    want.fill(2);
    want.expect_same(whole);
  }
  Trainer again(cfg, owned);
  resume_from_checkpoint(MPI_COMM_WORLD, again.state());
  sharded.expect_same(again);
  remove_shared(dir);
}

TEST(Checkpoint, ProtocolKeepsTheNewestAndNamesLatest) {
  const std::string dir = shared_dir("ring");
  Trainer t(small_config(dir, false, Fp8Recipe::off));
  for (int64_t step : {2, 4, 6, 8}) {
    t.fill(int(step));
    t.progress.step = step;
    save_checkpoint(MPI_COMM_WORLD, t.state());
  }
  if (world_rank() == 0) {
    std::vector<std::string> names;
    for (const auto& e : fs::directory_iterator(dir)) names.push_back(e.path().filename().string());
    std::sort(names.begin(), names.end());
    EXPECT_EQ(names, (std::vector<std::string>{"latest", "step_00000006", "step_00000008"}));  // keep_last 2
    EXPECT_EQ(resolve_checkpoint_dir(dir), dir + "/step_00000008");
  }
  // Re-saving an existing step replaces it (atomically) with the new contents.
  t.fill(20);
  t.progress.step = 6;
  save_checkpoint(MPI_COMM_WORLD, t.state());
  Trainer back(t.cfg);
  EXPECT_EQ(resume_from_checkpoint(MPI_COMM_WORLD, back.state()), dir + "/step_00000006");
  t.expect_same(back);
  remove_shared(dir);
}

TEST(Checkpoint, ModelShapeChangeIsRefusedNamingTheKeys) {
  const std::string dir = shared_dir("shape");
  Trainer t(small_config(dir, false, Fp8Recipe::off));
  t.fill(0);
  save_checkpoint(MPI_COMM_WORLD, t.state());
  Config other = t.cfg;
  other.model.d_model = 64;
  other.model.moe.n_experts = 4;
  other.train.lr = 1e-5;  // optimizer settings may change
  Trainer o(other);
  try {
    resume_from_checkpoint(MPI_COMM_WORLD, o.state());
    ADD_FAILURE() << "loaded a checkpoint of another model";
  } catch (const CheckpointMismatch& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("model.d_model: checkpoint 32, config 64"), std::string::npos) << m;
    EXPECT_NE(m.find("model.moe.n_experts: checkpoint 3, config 4"), std::string::npos) << m;
    EXPECT_EQ(m.find("train.lr"), std::string::npos) << m;
  }
  remove_shared(dir);
}

TEST(Checkpoint, ChecksumTermIsTheDocumentedFormula) {
  // splitmix64 (Steele, Lea, Flood 2014) of 0 is 0xe220a8397b1dcdaf: the first output of the
  // reference generator seeded with 0.
  auto splitmix = [](uint64_t x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
  };
  EXPECT_EQ(splitmix(0), 0xe220a8397b1dcdafull);
  EXPECT_EQ(checksum_term(0, 0), splitmix(splitmix(0)));
  EXPECT_EQ(checksum_term(5, 0x3f800000u), splitmix(splitmix(5) ^ 0x3f800000u));
}

}  // namespace
}  // namespace fp8moe
