// Checkpoint save/load under MPI (np 1, 2, 3): a state with predictable, distinct values in every
// tensor is saved by all ranks (each writing its rows), then loaded by one rank alone and by all
// ranks, and must come back bit for bit; a save by one rank alone gives the same file contents
// and checksums as the save by all ranks (the checksum does not depend on the layout). With a
// staging buffer of a few hundred bytes (checkpoint.staging_bytes), every dataset goes through
// it in several chunks, ranks write unequal numbers of rows, and the backend's host allocations
// stay within the bound.
#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <mutex>
#include <regex>
#include <set>
#include <string>
#include <unordered_map>

#include "io/checkpoint.h"
#include "io/config.h"
#include "io/hdf5_file.h"
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
  std::vector<RowRange> write_rows, moment_write_rows;  // TrainerState's (empty: the defaults)
  explicit Trainer(const Config& c, std::vector<RowRange> owned = {}, DeviceKind kind = DeviceKind::cpu)
      : Trainer(c, std::move(owned), backend_of(kind)) {}
  Trainer(const Config& c, std::vector<RowRange> owned, Backend& be)
      : cfg(c), model(be, c), opt(be, model.table(), c.train, std::move(owned)), scaler(c.train) {}
  TrainerState state() { return {&cfg, &model, &opt, &scaler, &progress, "test layout", write_rows, moment_write_rows}; }
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

// The config with a staging buffer of `bytes` (checkpoint.staging_bytes; 0: the default).
Config with_staging(Config c, int64_t bytes) {
  if (bytes > 0) c.checkpoint.staging_bytes = bytes;
  return c;
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

class CheckpointSharded : public testing::TestWithParam<int64_t> {};  // the staging bound (0: the default)

TEST_P(CheckpointSharded, ShardedMomentsLoadWholeAndShardedAgain) {
  // ZeRO-1: each rank holds the moments of its rows only; the file holds the global tensors.
  const std::string dir = shared_dir("zero");
  const Config cfg = with_staging(small_config(dir, false, Fp8Recipe::off), GetParam());
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
  Trainer again(cfg, owned, DeviceKind::emulated);
  resume_from_checkpoint(MPI_COMM_WORLD, again.state());
  sharded.expect_same(again);
  remove_shared(dir);
}

INSTANTIATE_TEST_SUITE_P(Staging, CheckpointSharded, testing::Values(int64_t(0), int64_t(256)));

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

TEST(Checkpoint, GqaCheckpointRefusedByAnMlaConfigNamesKeysAndTensors) {
  const std::string dir = shared_dir("mla");
  Trainer t(small_config(dir, false, Fp8Recipe::off));
  t.fill(0);
  save_checkpoint(MPI_COMM_WORLD, t.state());
  Config other = t.cfg;
  other.model.attention = AttentionKind::mla;
  other.model.q_lora_rank = 16;
  other.model.mtp_depth = 1;
  Trainer o(other);
  try {
    resume_from_checkpoint(MPI_COMM_WORLD, o.state());
    ADD_FAILURE() << "loaded a GQA checkpoint into an MLA model";
  } catch (const CheckpointMismatch& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("model.attention: checkpoint gqa, config mla"), std::string::npos) << m;
    EXPECT_NE(m.find("model.mtp_depth: checkpoint 0, config 1"), std::string::npos) << m;
    // Every block's GQA projections, and the MLA ones the config wants, counted per pattern.
    const int64_t L = t.cfg.model.n_layers;
    for (const char* w : {"wk", "wv"})
      EXPECT_NE(m.find("only in the checkpoint: layers.*.attn." + std::string(w) + " (" + std::to_string(L) + " tensors)"),
                std::string::npos) << m;
    EXPECT_NE(m.find("only in the config's model: layers.*.attn.wq_a (" + std::to_string(L) + " tensors)"),
              std::string::npos) << m;
    EXPECT_NE(m.find("only in the config's model: mtp.*.eh_proj (1 tensor)"), std::string::npos) << m;
    EXPECT_EQ(m.find("layers.*.attn.wo"), std::string::npos) << m;  // both have it
  }
  remove_shared(dir);
}

// Where DeepSeek-V3's tensors live in each format (configs/deepseek-v3-671b.yaml's blocks, experts,
// attention and MTP at tiny widths), against the layout README "Checkpoints" documents: the dataset
// counts that h5py counted in files of each format written with FP8 off (138,425, 3,020, 641), and
// one tensor of each kind placed by hand.
TEST(Checkpoint, DatasetLayoutOfDeepSeekV3InEveryFormat) {
  ModelConfig m;
  m.vocab_size = 256, m.d_model = 64, m.n_layers = 61, m.first_dense_layers = 3, m.n_heads = 2;
  m.attention = AttentionKind::mla;
  m.q_lora_rank = 32, m.kv_lora_rank = 16, m.qk_nope_head_dim = 16, m.qk_rope_head_dim = 8, m.v_head_dim = 16;
  m.d_ff_dense = 128, m.mtp_depth = 1;
  m.moe.n_experts = 256, m.moe.top_k = 8, m.moe.n_shared_experts = 1, m.moe.d_expert = 16;
  const ParamTable table = build_param_table(m);
  auto spec = [&](const std::string& name) { return table.at(name); };
  const std::map<int, size_t> datasets = {{1, 138425}, {2, 3020}, {3, 641}};
  for (const auto& [version, count] : datasets) {
    const ckpt::DatasetLayout layout(table, m.moe.n_experts, version);
    std::set<std::string> paths;
    for (const ParamSpec& p : table.params)
      for (int which = -1; which < (p.trainable ? 2 : 0); ++which) paths.insert(layout.place(p, which).path);
    EXPECT_EQ(paths.size(), count) << "format " << version;  // FP8 off: no /fp8 datasets
  }
  const ckpt::DatasetLayout v3(table, m.moe.n_experts, 3), v2(table, m.moe.n_experts, 2), v1(table, m.moe.n_experts, 1);
  ckpt::Place p = v3.place(spec("layers.10.moe.router"), -1);  // the MoE blocks, 3-60
  EXPECT_EQ(p.path, "/params/layers.moe.router");
  EXPECT_EQ(p.slot, 7);
  EXPECT_EQ(p.slots, 58);
  ASSERT_TRUE(p.layers);
  EXPECT_EQ(p.layers->front(), 3);
  EXPECT_EQ(p.layers->back(), 60);
  EXPECT_EQ(ckpt::tensor_text(p), "dataset /params/layers.moe.router, layer 10");
  EXPECT_EQ(ckpt::layers_text(*p.layers), "layers 3-60");
  p = v3.place(spec("layers.5.attn.wq_a"), 1);  // every block
  EXPECT_EQ(p.path, "/optim/v/layers.attn.wq_a");
  EXPECT_EQ(p.slot, 5);
  EXPECT_EQ(p.slots, 61);
  p = v3.place(spec("layers.2.mlp.w1"), 0);  // the dense blocks, 0-2
  EXPECT_EQ(p.path, "/optim/m/layers.mlp.w1");
  EXPECT_EQ(p.slot, 2);
  EXPECT_EQ(p.slots, 3);
  p = v3.place(spec("layers.4.moe.experts.17.w2"), -1);  // experts stay per block
  EXPECT_EQ(p.path, "/params/layers.4.moe.experts.w2");
  EXPECT_EQ(p.slot, 17);
  EXPECT_EQ(p.slots, 256);
  EXPECT_FALSE(p.layers);
  EXPECT_EQ(ckpt::tensor_text(p), "dataset /params/layers.4.moe.experts.w2, expert 17");
  for (const char* alone : {"mtp.0.attn.wq_a", "mtp.0.eh_proj", "embed.weight", "final_norm.weight", "head.weight"}) {
    p = v3.place(spec(alone), -1);
    EXPECT_EQ(p.path, std::string("/params/") + alone);
    EXPECT_EQ(p.slot, -1);
  }
  p = v3.place(spec("mtp.0.moe.experts.3.w1"), -1);
  EXPECT_EQ(p.path, "/params/mtp.0.moe.experts.w1");
  EXPECT_EQ(p.slot, 3);
  // Format 2: the blocks' other tensors alone; format 1: the experts too.
  EXPECT_EQ(v2.place(spec("layers.5.attn.wq_a"), -1).path, "/params/layers.5.attn.wq_a");
  EXPECT_EQ(v2.place(spec("layers.5.attn.wq_a"), -1).slot, -1);
  EXPECT_EQ(v2.place(spec("layers.4.moe.experts.17.w2"), -1).path, "/params/layers.4.moe.experts.w2");
  EXPECT_EQ(v1.place(spec("layers.4.moe.experts.17.w2"), -1).path, "/params/layers.4.moe.experts.17.w2");
  EXPECT_EQ(v1.place(spec("layers.4.moe.experts.17.w2"), -1).slot, -1);
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

// ---------------------------------------------------------------- the staging buffer

// The emulated device, watched: its host allocations (Backend::allocate_host, where the checkpoint
// code's staging buffer comes from) are recorded; everything else is forwarded. The transfers are
// counted by the emulated device itself (inner()), which also synchronises by itself on a
// download into memory that is not allocate_host's.
class WatchedDevice final : public Backend {
 public:
  struct HostStats {
    int64_t live = 0, peak = 0, largest = 0, allocations = 0;
  };
  WatchedDevice() : Backend(DeviceKind::emulated), d_(make_backend(DeviceKind::emulated)) {}
  Backend& inner() { return *d_; }
  HostStats host() const {
    std::lock_guard<std::mutex> lock(mu_);
    return host_;
  }
  void reset_host() {
    std::lock_guard<std::mutex> lock(mu_);
    host_.peak = host_.live, host_.largest = 0, host_.allocations = 0;
  }

  void* allocate_host(size_t bytes) override {
    void* p = d_->allocate_host(bytes);
    std::lock_guard<std::mutex> lock(mu_);
    if (p) sizes_[p] = bytes;
    host_.live += int64_t(bytes);
    host_.peak = std::max(host_.peak, host_.live);
    host_.largest = std::max(host_.largest, int64_t(bytes));
    ++host_.allocations;
    return p;
  }
  void release_host(void* p) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      const auto it = sizes_.find(p);
      if (it != sizes_.end()) host_.live -= int64_t(it->second), sizes_.erase(it);
    }
    d_->release_host(p);
  }

  std::string describe() const override { return "watched " + d_->describe(); }
  double dense_peak_flops(bool fp8) const override { return d_->dense_peak_flops(fp8); }
  void* allocate(size_t bytes) override { return d_->allocate(bytes); }
  void release(void* p) override { d_->release(p); }
  MemoryStats memory_stats() const override { return d_->memory_stats(); }
  void reset_peak() override { d_->reset_peak(); }
  void copy(void* dst, const void* src, size_t bytes) override { d_->copy(dst, src, bytes); }
  void copy_2d(float* dst, int64_t ld_dst, const float* src, int64_t ld_src, int64_t rows, int64_t cols) override {
    d_->copy_2d(dst, ld_dst, src, ld_src, rows, cols);
  }
  void zero(void* dst, size_t bytes) override { d_->zero(dst, bytes); }
  void* host_address(const void* p) const override { return d_->host_address(p); }
  void sgemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda, const float* B,
             int64_t ldb, float beta, float* C, int64_t ldc) override {
    d_->sgemm(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
  }
  void gemm_bf16(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const uint16_t* A, int64_t lda,
                 const uint16_t* B, int64_t ldb, float beta, float* C, int64_t ldc) override {
    d_->gemm_bf16(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
  }
  void gemm_fp8(GemmRole role, const QuantView& A, bool ta, const QuantView& B, bool tb, float alpha, float beta,
                float* C, int64_t ldc) override {
    d_->gemm_fp8(role, A, ta, B, tb, alpha, beta, C, ldc);
  }
  void amax(const float* x, int64_t n, float* out) override { d_->amax(x, n, out); }
  void scale_from_amax(const float* amax, Fp8Dtype dtype, const ScaleOptions& opt, float* scale) override {
    d_->scale_from_amax(amax, dtype, opt, scale);
  }
  void quantize_scaled(const float* x, const float* scale, const QuantView& out, uint64_t* counts,
                       float* amax = nullptr) override {
    d_->quantize_scaled(x, scale, out, counts, amax);
  }
  void quantize_tiled(const float* x, const ScaleOptions& opt, const QuantView& out, uint64_t* counts) override {
    d_->quantize_tiled(x, opt, out, counts);
  }
  void delayed_update(float* history, int64_t len, int64_t steps, const float* amax, DelayedScalingCompute compute,
                      Fp8Dtype dtype, const ScaleOptions& opt, float* scale) override {
    d_->delayed_update(history, len, steps, amax, compute, dtype, opt, scale);
  }
  void dequantize(const QuantView& q, float* out) override { d_->dequantize(q, out); }
  void rmsnorm_forward(const float* x, const float* w, int64_t N, int64_t D, float eps, float* y, float* rstd) override {
    d_->rmsnorm_forward(x, w, N, D, eps, y, rstd);
  }
  void rmsnorm_backward(const float* x, const float* w, const float* rstd, const float* dy, int64_t N, int64_t D,
                        float* dx, float* dw) override {
    d_->rmsnorm_backward(x, w, rstd, dy, N, D, dx, dw);
  }
  void rmsnorm_forward_bf16(const uint16_t* x, const float* w, int64_t N, int64_t D, float eps, float* y,
                            float* rstd) override {
    d_->rmsnorm_forward_bf16(x, w, N, D, eps, y, rstd);
  }
  void rmsnorm_backward_bf16(const uint16_t* x, const float* w, const float* rstd, const float* dy, int64_t N,
                             int64_t D, float* dx, float* dw) override {
    d_->rmsnorm_backward_bf16(x, w, rstd, dy, N, D, dx, dw);
  }
  void rope(float* x, int64_t B, int64_t T, int64_t heads, int64_t hd, const float* cs, const float* sn,
            int64_t head_stride) override {
    d_->rope(x, B, T, heads, hd, cs, sn, head_stride);
  }
  void attention_forward(const float* q, const float* k, const float* v, int64_t B, int64_t T, int64_t H, int64_t KVH,
                         int64_t hd, int64_t hdv, float* out, float* lse) override {
    d_->attention_forward(q, k, v, B, T, H, KVH, hd, hdv, out, lse);
  }
  void attention_backward(const float* q, const float* k, const float* v, const float* out, const float* lse,
                          const float* dout, int64_t B, int64_t T, int64_t H, int64_t KVH, int64_t hd, int64_t hdv,
                          float* dq, float* dk, float* dv) override {
    d_->attention_backward(q, k, v, out, lse, dout, B, T, H, KVH, hd, hdv, dq, dk, dv);
  }
  void attention_forward_bf16(const uint16_t* q, const uint16_t* k, const uint16_t* v, int64_t B, int64_t T, int64_t H,
                              int64_t KVH, int64_t hd, int64_t hdv, float* out, float* lse) override {
    d_->attention_forward_bf16(q, k, v, B, T, H, KVH, hd, hdv, out, lse);
  }
  void attention_backward_bf16(const uint16_t* q, const uint16_t* k, const uint16_t* v, const float* out,
                               const float* lse, const float* dout, int64_t B, int64_t T, int64_t H, int64_t KVH,
                               int64_t hd, int64_t hdv, float* dq, float* dk, float* dv) override {
    d_->attention_backward_bf16(q, k, v, out, lse, dout, B, T, H, KVH, hd, hdv, dq, dk, dv);
  }
  void mla_expand_kv(const float* kv, const float* kpe, int64_t N, int64_t H, int64_t nope, int64_t rope, int64_t vd,
                     float* k, float* v) override {
    d_->mla_expand_kv(kv, kpe, N, H, nope, rope, vd, k, v);
  }
  void mla_expand_kv_backward(const float* dk, const float* dv, int64_t N, int64_t H, int64_t nope, int64_t rope,
                              int64_t vd, float* dkv, float* dkpe) override {
    d_->mla_expand_kv_backward(dk, dv, N, H, nope, rope, vd, dkv, dkpe);
  }
  void cross_entropy(const float* logits, const int32_t* targets, int64_t N, int64_t V, int32_t ignore,
                     float grad_scale, float* dlogits, double* loss_sum) override {
    d_->cross_entropy(logits, targets, N, V, ignore, grad_scale, dlogits, loss_sum);
  }
  void ce_row_max(const float* logits, int64_t N, int64_t Vl, float* mx) override { d_->ce_row_max(logits, N, Vl, mx); }
  void ce_partials(const float* logits, const int32_t* targets, int64_t N, int64_t Vl, int64_t v0, int32_t ignore,
                   const float* mx, double* se, double* tl) override {
    d_->ce_partials(logits, targets, N, Vl, v0, ignore, mx, se, tl);
  }
  void ce_finish(const float* logits, const int32_t* targets, int64_t N, int64_t Vl, int64_t v0, int32_t ignore,
                 const float* mx, const double* se, const double* tl, float grad_scale, float* dlogits,
                 double* loss_sum) override {
    d_->ce_finish(logits, targets, N, Vl, v0, ignore, mx, se, tl, grad_scale, dlogits, loss_sum);
  }
  void embedding_forward(const float* table, const int32_t* ids, int64_t N, int64_t D, int64_t v0, int64_t Vl,
                         float* out) override {
    d_->embedding_forward(table, ids, N, D, v0, Vl, out);
  }
  void embedding_backward(const float* dout, const int32_t* ids, int64_t N, int64_t D, int64_t v0, int64_t Vl,
                          float* dtable) override {
    d_->embedding_backward(dout, ids, N, D, v0, Vl, dtable);
  }
  void swiglu_forward(const float* a, const float* b, int64_t ld, float* y, int64_t rows, int64_t cols) override {
    d_->swiglu_forward(a, b, ld, y, rows, cols);
  }
  void swiglu_backward(const float* a, const float* b, int64_t ld, const float* dy, float* da, float* db, int64_t rows,
                       int64_t cols) override {
    d_->swiglu_backward(a, b, ld, dy, da, db, rows, cols);
  }
  void swiglu_gated_forward(const float* a, const float* b, int64_t ld, const float* gate, float* y, int64_t rows,
                            int64_t cols) override {
    d_->swiglu_gated_forward(a, b, ld, gate, y, rows, cols);
  }
  void swiglu_gated_backward(const float* a, const float* b, int64_t ld, const float* gate, const float* dy, float* da,
                             float* db, double* dgate, int64_t rows, int64_t cols) override {
    d_->swiglu_gated_backward(a, b, ld, gate, dy, da, db, dgate, rows, cols);
  }
  void swiglu_forward_bf16(const uint16_t* a, const uint16_t* b, int64_t ld, const float* gate, float* y, int64_t rows,
                           int64_t cols) override {
    d_->swiglu_forward_bf16(a, b, ld, gate, y, rows, cols);
  }
  void swiglu_backward_bf16(const uint16_t* a, const uint16_t* b, int64_t ld, const float* gate, const float* dy,
                            float* da, float* db, double* dgate, int64_t rows, int64_t cols) override {
    d_->swiglu_backward_bf16(a, b, ld, gate, dy, da, db, dgate, rows, cols);
  }
  void add(const float* a, const float* b, float* out, int64_t n) override { d_->add(a, b, out, n); }
  void to_bf16(const float* x, uint16_t* y, int64_t n) override { d_->to_bf16(x, y, n); }
  void from_bf16(const uint16_t* x, float* y, int64_t n) override { d_->from_bf16(x, y, n); }
  void round_bf16(const float* x, float* y, int64_t n) override { d_->round_bf16(x, y, n); }
  void route(const float* z, const float* bias, const RouterRule& rule, const RoutingBuffers& out) override {
    d_->route(z, bias, rule, out);
  }
  void permute(const float* x, const int64_t* row_token, int64_t R, int64_t D, float* rows) override {
    d_->permute(x, row_token, R, D, rows);
  }
  void unpermute_add(const RoutingBuffers& r, int64_t R, const float* rows, int64_t D, bool gated, float* out) override {
    d_->unpermute_add(r, R, rows, D, gated, out);
  }
  void gate_grad(const RoutingBuffers& r, int64_t R, const float* dout, const float* expert_out, int64_t D, float* dye,
                 double* dgate) override {
    d_->gate_grad(r, R, dout, expert_out, D, dye, dgate);
  }
  void permute_bf16(const float* x, const int64_t* row_token, int64_t R, int64_t D, uint16_t* rows) override {
    d_->permute_bf16(x, row_token, R, D, rows);
  }
  void unpermute_add_bf16(const RoutingBuffers& r, int64_t R, const uint16_t* rows, int64_t D, bool gated,
                          float* out) override {
    d_->unpermute_add_bf16(r, R, rows, D, gated, out);
  }
  void gate_grad_bf16(const RoutingBuffers& r, int64_t R, const float* dout, const uint16_t* expert_out, int64_t D,
                      float* dye, double* dgate) override {
    d_->gate_grad_bf16(r, R, dout, expert_out, D, dye, dgate);
  }
  void row_gates(const RoutingBuffers& r, int64_t R, float* gate_rows) override { d_->row_gates(r, R, gate_rows); }
  void sum_rows(const float* rows, const int64_t* offsets, const int64_t* index, int64_t n, int64_t D,
                float* out) override {
    d_->sum_rows(rows, offsets, index, n, D, out);
  }
  void sum_rows_bf16(const uint16_t* rows, const int64_t* offsets, const int64_t* index, int64_t n, int64_t D,
                     uint16_t* out) override {
    d_->sum_rows_bf16(rows, offsets, index, n, D, out);
  }
  void slot_grads(const RoutingBuffers& r, int64_t R, const double* row_grads, double* dgate) override {
    d_->slot_grads(r, R, row_grads, dgate);
  }
  void router_grad(const RoutingBuffers& r, const double* dgate, const RouterGradRule& rule, float* dz) override {
    d_->router_grad(r, dgate, rule, dz);
  }
  void aux_loss(const RoutingBuffers& r, double coef, bool sigmoid, double* out) override {
    d_->aux_loss(r, coef, sigmoid, out);
  }
  void bias_update(float* bias, const int64_t* load, int64_t E, double rate) override { d_->bias_update(bias, load, E, rate); }
  void adamw(const AdamWStep& h, float* w, const float* g, float* m, float* v, uint16_t* m16, uint16_t* v16,
             int64_t n) override {
    d_->adamw(h, w, g, m, v, m16, v16, n);
  }
  void sum_squares(const float* g, int64_t n, float unscale, double* out) override { d_->sum_squares(g, n, unscale, out); }
  void sum(const double* x, int64_t n, double* out) override { d_->sum(x, n, out); }

 protected:
  void upload_impl(void* dst, const void* host, size_t bytes) override { d_->upload(dst, host, bytes); }
  void download_impl(void* host, const void* src, size_t bytes) override { d_->download(host, src, bytes); }
  void sync_impl() override { d_->sync(); }

 private:
  std::unique_ptr<Backend> d_;
  mutable std::mutex mu_;
  HostStats host_;
  std::unordered_map<void*, size_t> sizes_;
};

// Unequal shares of a tensor's rows: parts of weights 1, 3, 6, ... over the ranks, rank r taking
// part (r + shift) % size; every row exactly once.
RowRange skewed_rows(int64_t rows, int rank, int size, size_t shift) {
  std::vector<int64_t> cum{0};
  for (int p = 0; p < size; ++p) cum.push_back(cum.back() + (p + 1) * (p + 2) / 2);
  const int p = int((size_t(rank) + shift) % size_t(size));
  return {rows * cum[size_t(p)] / cum.back(), rows * cum[size_t(p) + 1] / cum.back()};
}

// The chunks of n rows of `width` elements of `elem` bytes through a buffer of `bound` bytes
// (io/checkpoint.h): as many whole rows as fit, or each row in pieces.
int64_t chunk_count(int64_t n, int64_t width, int64_t elem, int64_t bound) {
  if (n <= 0 || width <= 0) return 0;
  const int64_t cap = std::max<int64_t>(1, bound / elem);
  return width <= cap ? (n + cap / width - 1) / (cap / width) : n * ((width + cap - 1) / cap);
}

// The calls (one host synchronisation each) that a save or load makes through a buffer of `bound`
// bytes, by the rule io/checkpoint_common.h documents: per dataset, in slot order, a tensor's block
// that fits the buffer whole shares the dataset's previous call when that call holds whole blocks
// and both fit together, else starts a call; a block that does not fit takes chunk_count calls.
// A dataset is named by its tensors' name with the expert's number taken out, or else the block's
// (format 3 stacks the routed experts per block, every other tensor of the blocks over the blocks).
class CallCounter {
 public:
  explicit CallCounter(int64_t bound) : bound_(bound) {}
  void add(const std::string& kind, const std::string& name, int64_t n, int64_t width, int64_t elem) {
    if (n <= 0 || width <= 0) return;
    static const std::regex expert(R"(\.experts\.[0-9]+\.)"), block(R"(^layers\.[0-9]+\.)");
    const std::string dataset = std::regex_search(name, expert) ? std::regex_replace(name, expert, ".experts.")
                                                                : std::regex_replace(name, block, "layers.");
    auto& [packable, bytes] = open_[kind + dataset];
    const int64_t b = n * width * elem;
    if (b <= bound_ && packable && bytes + b <= bound_) {
      bytes += b;
      return;
    }
    packable = b <= bound_;
    bytes = packable ? b : 0;
    calls_ += packable ? 1 : chunk_count(n, width, elem, bound_);
  }
  int64_t calls() const { return calls_; }

 private:
  int64_t bound_, calls_ = 0;
  std::map<std::string, std::pair<bool, int64_t>> open_;
};

// (bound in bytes, BF16 moments, recipe). Rows are 32 FP32 values (128 bytes): 256 stages 2 whole
// rows a chunk, 96 cuts each FP32 row into pieces of 24 elements (and takes 1 BF16 row a chunk),
// 4096 puts several experts' whole blocks in one call.
class CheckpointStaging : public testing::TestWithParam<std::tuple<int64_t, bool, Fp8Recipe>> {};

TEST_P(CheckpointStaging, EveryDatasetInChunksThroughABoundedBufferAndBackBitExact) {
  const auto [bound, bf16, recipe] = GetParam();
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  const std::string dir = shared_dir("staging");
  const Config cfg = with_staging(small_config(dir, bf16, recipe), bound);
  const ParamTable table = build_param_table(cfg.model);
  const int64_t elem_m = bf16 ? 2 : 4;
  std::string committed;
  {
    WatchedDevice dev;
    Trainer saved(cfg, {}, dev);
    saved.fill(1);
    // Rows written: unequal shares, the moments' another than the parameters'.
    for (size_t i = 0; i < table.params.size(); ++i) {
      saved.write_rows.push_back(skewed_rows(table.params[i].rows, rank, size, i));
      saved.moment_write_rows.push_back(skewed_rows(table.params[i].rows, rank, size, i + 1));
    }
    // What the save must download: this rank's rows, every dataset in chunks, whole blocks of a
    // stacked dataset together (one synchronisation a call), besides the delayed-scaling state
    // (fp8_scaling_to_host, measured alone).
    int64_t down = 0, chunks = 0, datasets = 0;
    CallCounter calls(bound);
    for (size_t i = 0; i < table.params.size(); ++i) {
      const ParamSpec& p = table.params[i];
      const int64_t n = saved.write_rows[i].end - saved.write_rows[i].begin;
      down += n * p.cols * 4, chunks += chunk_count(n, p.cols, 4, bound), datasets += n > 0;
      calls.add("p", p.name, n, p.cols, 4);
    }
    for (const char* m : {"m", "v"})
      for (size_t i = 0; i < table.params.size(); ++i) {
        const ParamSpec& p = table.params[i];
        if (!p.trainable) continue;
        const int64_t nm = saved.moment_write_rows[i].end - saved.moment_write_rows[i].begin;
        down += nm * p.cols * elem_m, chunks += chunk_count(nm, p.cols, elem_m, bound), datasets += nm > 0;
        calls.add(m, p.name, nm, p.cols, elem_m);
      }
    Backend& emu = dev.inner();
    TransferCounts t0 = emu.transfers();
    (void)saved.model.fp8_scaling_to_host();
    const TransferCounts scaling = emu.transfers() - t0;
    dev.reset_host();
    const int64_t live = dev.host().live;
    t0 = emu.transfers();
    committed = save_checkpoint(MPI_COMM_WORLD, saved.state());
    const TransferCounts moved = emu.transfers() - t0;
    EXPECT_EQ(moved.d2h_bytes, down + scaling.d2h_bytes);
    EXPECT_EQ(moved.host_syncs, calls.calls() + scaling.host_syncs);  // a download not into the staging buffer would add one
    EXPECT_EQ(moved.h2d_bytes, 0);
    if (bound <= 256) {
      EXPECT_GT(chunks, 3 * datasets) << "the bound does not make several chunks a dataset";
    }
    EXPECT_LE(dev.host().largest, bound);
    EXPECT_LE(dev.host().peak - live, bound);
    EXPECT_EQ(dev.host().live, live);

    // One rank alone on cpu, with the default rows.
    if (rank == 0) {
      Trainer one(cfg);
      one.fill(4);
      EXPECT_EQ(resume_from_checkpoint(MPI_COMM_SELF, one.state()), committed);
      saved.expect_same(one);
      std::vector<std::vector<float>> weights;
      load_checkpoint_weights(committed, &weights);
      EXPECT_EQ(weights, saved.model.params_to_host());
    }
    // All ranks on the watched device, with the rows the save used: every block uploaded once,
    // one chunk (and synchronisation) at a time, within the bound.
    {
      WatchedDevice dev2;
      Trainer all(cfg, {}, dev2);
      all.write_rows = saved.write_rows, all.moment_write_rows = saved.moment_write_rows;
      all.fill(6);
      Backend& emu2 = dev2.inner();
      const auto state = saved.model.fp8_scaling_to_host();
      t0 = emu2.transfers();
      all.model.set_fp8_scaling(state);  // what the load does last, measured alone
      const TransferCounts set_scaling = emu2.transfers() - t0;
      int64_t up = 0;
      CallCounter load_calls(bound);
      for (size_t i = 0; i < table.params.size(); ++i) {
        const ParamSpec& p = table.params[i];
        up += p.numel() * 4, load_calls.add("p", p.name, p.rows, p.cols, 4);
        if (p.trainable) up += 2 * p.numel() * elem_m;
      }
      for (const char* m : {"m", "v"})
        for (const ParamSpec& p : table.params)
          if (p.trainable) load_calls.add(m, p.name, p.rows, p.cols, 4);  // a load's calls count FP32 elements
      dev2.reset_host();
      const int64_t live2 = dev2.host().live;
      t0 = emu2.transfers();
      EXPECT_EQ(resume_from_checkpoint(MPI_COMM_WORLD, all.state()), committed);
      const TransferCounts loaded = emu2.transfers() - t0;
      EXPECT_EQ(loaded.h2d_bytes, up + set_scaling.h2d_bytes);
      EXPECT_EQ(loaded.host_syncs, load_calls.calls() + set_scaling.host_syncs);
      EXPECT_LE(dev2.host().largest, bound);
      EXPECT_LE(dev2.host().peak - live2, bound);
      saved.expect_same(all);
    }
    // The rows in pieces (bound 96): the save and the two loads above suffice.
    if (bound >= 128) {
      // All ranks on cpu, with the default rows (other checksum parts).
      Trainer cpu(cfg);
      EXPECT_EQ(resume_from_checkpoint(MPI_COMM_WORLD, cpu.state()), committed);
      saved.expect_same(cpu);
      // The other moments dtype, converted chunk by chunk on the emulated device: BF16 decoded
      // exactly, FP32 encoded round-to-nearest-even.
      Config other = cfg;
      other.train.moments_dtype = bf16 ? MomentsDtype::fp32 : MomentsDtype::bf16;
      Trainer conv(other, {}, DeviceKind::emulated);
      EXPECT_EQ(resume_from_checkpoint(MPI_COMM_WORLD, conv.state()), committed);
      EXPECT_EQ(conv.model.params_to_host(), saved.model.params_to_host());
      for (size_t i = 0; i < table.params.size(); ++i)
        for (int w = 0; w < 2; ++w) {
          if (bf16) {
            EXPECT_EQ(to_host<float>(conv.opt.moment(w, i)), w == 0 ? saved.opt.first_moment(i) : saved.opt.second_moment(i));
          } else {
            std::vector<uint16_t> want;
            for (float x : to_host<float>(saved.opt.moment(w, i))) want.push_back(bf16_encode(x));
            EXPECT_EQ(to_host<uint16_t>(conv.opt.moment(w, i)), want) << table.params[i].name;
          }
        }
    }
  }
  // The file does not depend on the chunks: rank 0 alone saves the same state with the default
  // buffer (each dataset in one piece); every dataset has the same checksum, and is verified.
  if (rank == 0) {
    const std::string dir1 = dir + "-whole";
    Trainer one(small_config(dir1, bf16, recipe));
    one.fill(1);
    save_checkpoint(MPI_COMM_SELF, one.state());
    const CheckpointReport a = inspect_checkpoint(committed, true), b = inspect_checkpoint(dir1, true);
    EXPECT_TRUE(a.problems.empty()) << a.problems.front();
    EXPECT_TRUE(b.problems.empty()) << b.problems.front();
    ASSERT_EQ(a.datasets.size(), b.datasets.size());
    for (size_t i = 0; i < a.datasets.size(); ++i) {
      EXPECT_EQ(a.datasets[i].path, b.datasets[i].path);
      EXPECT_EQ(a.datasets[i].stored_checksum, b.datasets[i].stored_checksum) << a.datasets[i].path;
    }
  }
  remove_shared(dir);
}

// An asynchronous save (AsyncCheckpointer): the state at start() is what lands in the file, bit for
// bit, although the model, moments, counters and scaling change while the writer runs (they are
// refilled at once); start() downloads exactly this rank's share (checkpoint_copy_bytes, the
// rows it writes; unequal shares here) with one host synchronisation, on the emulated device, and
// the writer touches the backend no more (no transfer, no host allocation after start()). Two
// saves in a row reuse the host copy. With a 256-byte staging buffer, so that the writer stages in
// many calls.
TEST(CheckpointAsync, TheStateAtStartIsWrittenWhileTrainingChangesIt) {
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  const std::string dir = shared_dir("async");
  const Config cfg = with_staging(small_config(dir, true, Fp8Recipe::delayed), 256);
  const ParamTable table = build_param_table(cfg.model);
  WatchedDevice dev;
  Trainer saved(cfg, {}, dev), expected(cfg);
  for (size_t i = 0; i < table.params.size(); ++i) {
    saved.write_rows.push_back(skewed_rows(table.params[i].rows, rank, size, i));
    saved.moment_write_rows.push_back(skewed_rows(table.params[i].rows, rank, size, i + 3));
  }
  AsyncCheckpointer writer(MPI_COMM_WORLD, dev);
  EXPECT_FALSE(writer.in_flight());
  EXPECT_EQ(writer.wait(), "");
  Backend& emu = dev.inner();
  for (int salt : {1, 3}) {
    saved.fill(salt);
    expected.fill(salt);
    const int64_t share = checkpoint_copy_bytes(MPI_COMM_WORLD, saved.state());
    dev.reset_host();
    TransferCounts t0 = emu.transfers();
    (void)saved.model.fp8_scaling_to_host();
    const TransferCounts scaling_moves = emu.transfers() - t0;
    const int64_t scaling_allocations = dev.host().allocations;
    dev.reset_host();
    t0 = emu.transfers();
    EXPECT_EQ(writer.start(MPI_COMM_WORLD, saved.state()), share);
    const TransferCounts copy = emu.transfers() - t0;
    EXPECT_EQ(copy.d2h_bytes, share + scaling_moves.d2h_bytes);
    EXPECT_EQ(copy.host_syncs, 1 + scaling_moves.host_syncs);
    EXPECT_EQ(copy.h2d_bytes, 0);
    EXPECT_EQ(writer.host_bytes(), share);
    EXPECT_EQ(dev.host().allocations, scaling_allocations + (salt == 1 ? 1 : 0)) << "the host copy is allocated once";
    EXPECT_TRUE(writer.in_flight());
    saved.fill(salt + 10);  // training goes on: every tensor and counter changes under the writer
    const TransferCounts t1 = emu.transfers();
    const int64_t allocations = dev.host().allocations;
    const std::string committed = writer.wait();
    EXPECT_EQ(committed, dir + "/step_000000" + std::to_string(12 + salt));
    EXPECT_EQ((emu.transfers() - t1).d2h_bytes, 0) << "the writer read backend memory";
    EXPECT_EQ(dev.host().allocations, allocations) << "the writer allocated through the backend";
    EXPECT_FALSE(writer.in_flight());
    Trainer back(cfg);
    back.fill(7);
    EXPECT_EQ(resume_from_checkpoint(MPI_COMM_WORLD, back.state()), committed);
    expected.expect_same(back);
  }
  remove_shared(dir);
}

// 4096 bytes: two experts' whole blocks (16 rows of 128 bytes, or 32 of 64) fit one call, so a
// rank's experts of a stacked dataset share calls (and, loading the other moments dtype, are
// converted together).
INSTANTIATE_TEST_SUITE_P(Bounds, CheckpointStaging,
                         testing::Values(std::make_tuple(int64_t(256), false, Fp8Recipe::delayed),
                                         std::make_tuple(int64_t(256), true, Fp8Recipe::blockwise),
                                         std::make_tuple(int64_t(96), true, Fp8Recipe::delayed),
                                         std::make_tuple(int64_t(4096), true, Fp8Recipe::delayed)));

}  // namespace
}  // namespace fp8moe
