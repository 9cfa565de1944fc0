// Checkpoints through the real executable: bit-exact resume (2N steps straight vs N, exit,
// resume, N more: every printed loss compared by its exact bits), resume under another
// data-parallel size, and damaged checkpoints (flipped bytes, truncation, a missing or garbage
// `latest`), each detected with a message naming the file (and dataset), `auto` falling back.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <sstream>

#include "tests/test_util.h"

namespace fp8moe::test {
namespace {

namespace fs = std::filesystem;

// Losses by step, as printed ("[%a]": the double's exact bits).
std::map<int, std::string> losses(const std::string& out) {
  std::map<int, std::string> m;
  static const std::regex re(R"(^step +(\d+)/\d+ .*\[(\S+)\]$)");
  std::istringstream in(out);
  for (std::string line; std::getline(in, line);) {
    std::smatch s;
    if (std::regex_match(line, s, re)) m[std::stoi(s[1])] = s[2];
  }
  return m;
}

class Resume : public testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new TempDir;
    std::vector<std::string> prep = {exe(), "prepare-data", "--output", dir_->path + "/data/lic", "--val-fraction",
                                     "0.3", "--seed", "5", "--input"};
    for (const char* f : {"GPL-3", "GPL-2", "LGPL-3", "Apache-2.0", "MPL-2.0"})
      prep.push_back(std::string("/usr/share/common-licenses/") + f);
    const RunResult r = run(prep);
    ASSERT_EQ(r.status, 0) << r.all();
  }
  static void TearDownTestSuite() { delete dir_; }

  // A small model with every kind of state: delayed scaling histories, BF16 moments, a dynamic
  // loss scale that grows, router biases, validation.
  std::string config(const std::string& name) const {
    return dir_->write(name + ".yaml",
                       "model: {d_model: 64, n_layers: 2, n_heads: 4, n_kv_heads: 2, head_dim: 16, first_dense_layers: 1,\n"
                       "        d_ff_dense: 128, moe: {n_experts: 4, top_k: 2, n_shared_experts: 1, d_expert: 64}}\n"
                       "train: {steps: 12, warmup_steps: 2, global_batch: 8, seq_len: 32, lr: 3.0e-3, min_lr: 3.0e-4,\n"
                       "        moments_dtype: bf16, loss_scale: dynamic, loss_scale_initial: 256,\n"
                       "        loss_scale_growth_interval: 4}\n"
                       "parallel: {micro_batches: 2}\n"
                       "fp8: {recipe: delayed, amax_history_len: 8}\n"
                       "eval: {every: 4, batches: 1}\n"
                       "log: {every: 1}\n"
                       "data: {path: " + dir_->path + "/data/lic.train, valid_path: " + dir_->path + "/data/lic.val}\n"
                       "checkpoint: {dir: " + dir_->path + "/" + name + ", every: 4, keep_last: 3}\n");
  }
  RunResult train(int ranks, const std::string& cfg, std::vector<std::string> sets = {}) const {
    std::vector<std::string> argv = {mpiexec(), "-n", std::to_string(ranks), exe(), "train", cfg};
    for (auto& s : sets) argv.push_back("--set"), argv.push_back(s);
    return run(argv, 600);
  }
  std::string ckpt(const std::string& name) const { return dir_->path + "/" + name; }
  static TempDir* dir_;
};
TempDir* Resume::dir_ = nullptr;

// Also with train.activations bf16 on expert parallelism (the delayed recipe's experts take BF16
// rows) and on a pipeline (BF16 messages).
TEST_F(Resume, BitExactAfterExitAndRestart) {
  struct Case {
    int ranks;
    std::vector<std::string> sets;
  };
  int n = 0;
  for (const Case& k : {Case{1, {}}, Case{2, {}}, Case{2, {"parallel.expert=2", "train.activations=bf16"}},
                        Case{2, {"parallel.pipeline=2", "train.activations=bf16"}}}) {
    const int ranks = k.ranks;
    const std::string tag = "bitexact" + std::to_string(++n);
    const RunResult straight = train(ranks, config(tag + "a"), k.sets);
    ASSERT_EQ(straight.status, 0) << straight.all();
    std::vector<std::string> exit_sets = k.sets;
    exit_sets.push_back("train.exit_interval=6");
    const RunResult first = train(ranks, config(tag + "b"), exit_sets);
    ASSERT_EQ(first.status, 0) << first.all();
    EXPECT_NE(first.out.find("exit: step 6 is a multiple of train.exit_interval"), std::string::npos) << first.out;
    const RunResult second = train(ranks, config(tag + "b"), k.sets);
    ASSERT_EQ(second.status, 0) << second.all();
    EXPECT_NE(second.out.find("resumed from " + ckpt(tag + "b") + "/step_00000006: step 6"), std::string::npos)
        << second.out;
    const auto a = losses(straight.out), b1 = losses(first.out), b2 = losses(second.out);
    ASSERT_EQ(a.size(), 12u) << straight.out;
    ASSERT_EQ(b1.size(), 6u) << first.out;
    ASSERT_EQ(b2.size(), 6u) << second.out;
    for (int s = 1; s <= 12; ++s) EXPECT_EQ(a.at(s), s <= 6 ? b1.at(s) : b2.at(s)) << "case " << n << ", ranks " << ranks << " step " << s;
    // The final checkpoints are the same bytes: every checksum equal.
    const RunResult ia = run({exe(), "ckpt", "inspect", ckpt(tag + "a")}), ib = run({exe(), "ckpt", "inspect", ckpt(tag + "b")});
    ASSERT_EQ(ia.status, 0) << ia.all();
    ASSERT_EQ(ib.status, 0) << ib.all();
    const std::regex rows(R"((/\S+) .* ([0-9a-f]{16}) ok)");
    std::string ca, cb;
    for (std::sregex_iterator it(ia.out.begin(), ia.out.end(), rows), end; it != end; ++it) ca += (*it)[1].str() + (*it)[2].str() + "\n";
    for (std::sregex_iterator it(ib.out.begin(), ib.out.end(), rows), end; it != end; ++it) cb += (*it)[1].str() + (*it)[2].str() + "\n";
    EXPECT_GT(ca.size(), 1000u) << ia.out;
    EXPECT_EQ(ca, cb);
  }
}

// The emulated device keeps the model in memory the host cannot read: its checkpoints are staged
// through the backend, and a resume there, or from one device to the other, continues bit for bit
// (the cuda backend saves and loads through the same staging).
TEST_F(Resume, BitExactOnTheEmulatedDeviceAndAcrossDevices) {
  for (int ranks : {1, 2}) {
    const std::string tag = "devices" + std::to_string(ranks);
    const RunResult straight = train(ranks, config(tag + "a"), {"runtime.device=cpu"});
    ASSERT_EQ(straight.status, 0) << straight.all();
    const auto a = losses(straight.out);
    ASSERT_EQ(a.size(), 12u) << straight.out;
    // Emulated throughout, and emulated then cpu.
    for (const char* then : {"emulated", "cpu"}) {
      const std::string name = tag + "-" + then;
      const RunResult first = train(ranks, config(name), {"runtime.device=emulated", "train.exit_interval=6"});
      ASSERT_EQ(first.status, 0) << first.all();
      const RunResult second = train(ranks, config(name), {std::string("runtime.device=") + then});
      ASSERT_EQ(second.status, 0) << second.all();
      EXPECT_NE(second.out.find("resumed from " + ckpt(name) + "/step_00000006: step 6"), std::string::npos) << second.out;
      const auto b1 = losses(first.out), b2 = losses(second.out);
      ASSERT_EQ(b1.size(), 6u) << first.out;
      ASSERT_EQ(b2.size(), 6u) << second.out;
      for (int s = 1; s <= 12; ++s)
        EXPECT_EQ(a.at(s), s <= 6 ? b1.at(s) : b2.at(s)) << "ranks " << ranks << " then " << then << " step " << s;
    }
  }
}

TEST_F(Resume, UnderAnotherDataParallelSize) {
  // Blockwise scaling quantizes per 1 x 32 row tile and per weight block, but an expert's 32 x 1
  // wgrad token tiles follow the replicas' token split, and an FP32 reduction-order difference can
  // move a value across an E4M3 rounding boundary (tests/app/test_layouts.cpp): the runs agree to
  // FP8 noise, not to FP32 rounding. Measured: 1.27e-5 saved on 2 and resumed on 1, 1.08e-8 the
  // other way (a 2-core AVX512-BF16 host, oneDNN's BF16 GEMM; 2026-11-30; the bound was 1e-5 and
  // failed there); asserted <= 5e-5, 4x the worst measured, in both directions: whether an FP8
  // rounding flip happens in a given direction is chance (another host's summation order), so the
  // 1 -> 2 run's 1.08e-8 (no flip) is not a bound either can rely on.
  const auto bound = [](const std::string& x, const std::string& y) {
    const double a = std::strtod(x.c_str(), nullptr), b = std::strtod(y.c_str(), nullptr);
    return std::fabs(a - b) / std::fabs(a);
  };
  const std::vector<std::string> blockwise = {"fp8.recipe=blockwise", "fp8.tile=32"};
  const RunResult ref = train(1, config("dpref"), blockwise);
  ASSERT_EQ(ref.status, 0) << ref.all();
  const auto want = losses(ref.out);
  ASSERT_EQ(want.size(), 12u);
  for (auto [save, load] : {std::pair{2, 1}, std::pair{1, 2}}) {
    const std::string tag = "dp" + std::to_string(save) + "to" + std::to_string(load);
    std::vector<std::string> sets = blockwise;
    sets.push_back("train.exit_interval=4");
    const RunResult a = train(save, config(tag), sets);
    ASSERT_EQ(a.status, 0) << a.all();
    EXPECT_NE(a.out.find("x data " + std::to_string(save)), std::string::npos);
    const RunResult b = train(load, config(tag), blockwise);
    ASSERT_EQ(b.status, 0) << b.all();
    EXPECT_NE(b.out.find("resumed from " + ckpt(tag) + "/step_00000004"), std::string::npos) << b.out;
    const auto got = losses(b.out);
    ASSERT_EQ(got.size(), 8u) << b.out;
    double worst = 0;
    for (int s = 5; s <= 12; ++s) worst = std::max(worst, bound(want.at(s), got.at(s)));
    std::printf("saved on %d rank(s), resumed on %d: max relative loss difference over steps 5-12 = %.2e\n", save,
                load, worst);
    EXPECT_LE(worst, 5e-5);
  }
}

// Byte offset of a (contiguous) dataset's data in its file: h5ls -va prints it as "Address".
long dataset_offset(const std::string& file, const std::string& dataset) {
  const RunResult r = run({"h5ls", "-va", file + "/" + dataset});
  std::smatch m;
  static const std::regex re(R"(Address:\s*(\d+))");
  if (!std::regex_search(r.out, m, re)) return -1;
  return std::stol(m[1]);
}

TEST_F(Resume, DamagedCheckpointsAreDetectedAndAutoFallsBack) {
  const std::string cfg = config("damage");
  RunResult r = train(1, cfg, {"train.steps=8", "train.warmup_steps=1", "eval.every=0"});
  ASSERT_EQ(r.status, 0) << r.all();
  const std::string dir = ckpt("damage"), s4 = dir + "/step_00000004", s8 = dir + "/step_00000008";
  const std::string f8 = s8 + "/checkpoint.h5";
  ASSERT_TRUE(fs::exists(f8));
  fs::copy_file(f8, dir_->path + "/pristine.h5");
  const std::vector<std::string> more = {"train.steps=9", "train.warmup_steps=1", "eval.every=0"};
  auto restore = [&] {
    fs::copy_file(dir_->path + "/pristine.h5", f8, fs::copy_options::overwrite_existing);
    std::ofstream(dir + "/latest") << "step_00000008\n";
    fs::remove_all(dir + "/step_00000009");
  };

  // 1. A flipped byte in a dataset's data: in expert 2's slot of layer 1's stacked w1 (4 experts of
  // (64, 64) FP32 values), named down to the expert.
  const long at = dataset_offset(f8, "params/layers.1.moe.experts.w1");
  ASSERT_GT(at, 0);
  const long off = at + 2 * 64 * 64 * 4;
  const std::string named = f8 + ": dataset /params/layers.1.moe.experts.w1, expert 2: checksum mismatch";
  {
    std::fstream f(f8, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(off + 100);
    char c = 0;
    f.read(&c, 1);
    c ^= 0x10;
    f.seekp(off + 100);
    f.write(&c, 1);
  }
  r = run({exe(), "ckpt", "verify", dir});
  EXPECT_EQ(r.status, 1) << r.all();
  EXPECT_NE(r.err.find(named), std::string::npos) << r.err;
  EXPECT_NE(r.out.find("INVALID (1 problem)"), std::string::npos) << "only expert 2 is damaged\n" << r.all();
  r = train(1, cfg, more);
  ASSERT_EQ(r.status, 0) << r.all();
  EXPECT_NE(r.err.find("WARNING: checkpoint " + s8 + " is unusable: " + named), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("falling back to " + s4), std::string::npos) << r.err;
  EXPECT_NE(r.out.find("resumed from " + s4 + ": step 4"), std::string::npos) << r.out;
  // The same damage named explicitly: an error, no fallback.
  restore();
  {
    std::fstream f(f8, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(off + 7);
    f.put('\x7f');
  }
  r = train(1, cfg, {"checkpoint.resume=" + s8, "train.steps=9", "train.warmup_steps=1"});
  EXPECT_EQ(r.status, 2) << r.all();
  EXPECT_NE(r.err.find("fp8moe: error: checkpoint.resume: " + named), std::string::npos) << r.err;

  // 2. A truncated file.
  restore();
  fs::resize_file(f8, fs::file_size(f8) / 2);
  r = run({exe(), "ckpt", "verify", s8});
  EXPECT_EQ(r.status, 1) << r.all();
  EXPECT_NE(r.err.find(f8), std::string::npos) << r.err;
  r = train(1, cfg, more);
  ASSERT_EQ(r.status, 0) << r.all();
  EXPECT_NE(r.err.find("WARNING: checkpoint " + s8 + " is unusable: " + f8), std::string::npos) << r.err;
  EXPECT_NE(r.out.find("resumed from " + s4 + ": step 4"), std::string::npos) << r.out;

  // 3. `latest` deleted: the newest valid checkpoint, loudly.
  restore();
  fs::remove(dir + "/latest");
  r = train(1, cfg, more);
  ASSERT_EQ(r.status, 0) << r.all();
  EXPECT_NE(r.err.find("WARNING: " + dir + "/latest does not exist; falling back to the newest valid checkpoint"),
            std::string::npos) << r.err;
  EXPECT_NE(r.out.find("resumed from " + s8 + ": step 8"), std::string::npos) << r.out;

  // 4. `latest` holding garbage.
  restore();
  std::ofstream(dir + "/latest") << "\x01\x02garbage/../../etc\n";
  r = run({exe(), "ckpt", "verify", dir});
  EXPECT_EQ(r.status, 1) << r.all();
  EXPECT_NE(r.err.find(dir + "/latest does not name a checkpoint directory"), std::string::npos) << r.err;
  r = train(1, cfg, more);
  ASSERT_EQ(r.status, 0) << r.all();
  EXPECT_NE(r.err.find(dir + "/latest does not name a checkpoint directory"), std::string::npos) << r.err;
  EXPECT_NE(r.out.find("resumed from " + s8 + ": step 8"), std::string::npos) << r.out;

  // 5. Every checkpoint unusable: an error (nothing is deleted, nothing starts afresh silently).
  restore();
  fs::resize_file(f8, 100);
  fs::resize_file(s4 + "/checkpoint.h5", 100);
  r = train(1, cfg, more);
  EXPECT_EQ(r.status, 2) << r.all();
  EXPECT_NE(r.err.find("no usable checkpoint in " + dir), std::string::npos) << r.err;
  EXPECT_TRUE(fs::exists(s4) && fs::exists(s8));

  // 6. A checkpoint of another model: the differing keys, no fallback.
  restore();
  r = train(1, cfg, {"model.moe.d_expert=32", "model.moe.n_experts=8", "train.steps=9", "train.warmup_steps=1"});
  EXPECT_EQ(r.status, 2) << r.all();
  EXPECT_NE(r.err.find("model.moe.n_experts: checkpoint 4, config 8"), std::string::npos) << r.err;
}

// A load compares the checksum of every dataset of the file: their number, counted by h5ls (not
// by fp8moe), is the number the load reports verified; and a flipped byte in one dataset of each
// group — parameters, both Adam moments (BF16 here), the delayed-scaling state, the last dataset
// of the file, the last one a load reads (/fp8/steps), a stacked experts' dataset of each group,
// a per-block family's of two — is refused by name (a stacked one's first byte: expert 0's, block
// 0's) on an explicit resume and by `ckpt verify`.
TEST_F(Resume, EveryDatasetOfEveryGroupIsChecksummedOnLoad) {
  const std::string cfg = config("groups");
  RunResult r = train(2, cfg, {"train.steps=4", "train.warmup_steps=1", "eval.every=0"});
  ASSERT_EQ(r.status, 0) << r.all();
  const std::string s4 = ckpt("groups") + "/step_00000004", f4 = s4 + "/checkpoint.h5";
  const RunResult ls = run({"h5ls", "-r", f4});
  ASSERT_EQ(ls.status, 0) << ls.all();
  std::vector<std::string> datasets;
  std::istringstream in(ls.out);
  for (std::string line; std::getline(in, line);)
    if (line.find(" Dataset {") != std::string::npos) datasets.push_back(line.substr(0, line.find(' ')));
  ASSERT_GT(datasets.size(), 30u) << ls.out;
  const std::vector<std::string> more = {"checkpoint.resume=" + s4, "train.steps=5", "train.warmup_steps=1", "eval.every=0"};
  r = train(2, cfg, more);
  ASSERT_EQ(r.status, 0) << r.all();
  EXPECT_NE(r.out.find(s4 + ": " + std::to_string(datasets.size()) + " datasets, every checksum verified"),
            std::string::npos)
      << "h5ls lists " << datasets.size() << " datasets\n" << r.out;

  const std::string pristine = dir_->path + "/groups-pristine.h5";
  fs::copy_file(f4, pristine);
  auto pick = [&](const std::string& prefix) {
    for (const std::string& d : datasets)
      if (d.rfind(prefix, 0) == 0) return d;
    return std::string();
  };
  std::vector<std::string> victims = {pick("/params/"), pick("/optim/m/"), pick("/optim/v/"), pick("/fp8/"),
                                      datasets.back(), pick("/fp8/steps"), pick("/params/layers.1.moe.experts."),
                                      pick("/optim/m/layers.1.moe.experts."), pick("/optim/v/layers.1.moe.experts."),
                                      pick("/params/layers.attn."), pick("/optim/v/layers.attn_norm."),
                                      pick("/params/layers.moe.router")};
  for (const std::string& victim : victims) {
    SCOPED_TRACE(victim);
    ASSERT_FALSE(victim.empty()) << ls.out;
    fs::copy_file(pristine, f4, fs::copy_options::overwrite_existing);
    const long off = dataset_offset(f4, victim.substr(1));
    ASSERT_GT(off, 0);
    {
      std::fstream f(f4, std::ios::in | std::ios::out | std::ios::binary);
      f.seekg(off);
      char c = 0;
      f.read(&c, 1);
      f.seekp(off);
      f.put(char(c ^ 0x01));
    }
    // Slot 0 of a stacked dataset: expert 0, or the first block of its `layers` attribute (h5py's).
    std::string named = victim;
    if (victim.find(".moe.experts.") != std::string::npos) {
      named += ", expert 0";
    } else if (victim.find("/layers.") != std::string::npos) {
      const RunResult first = run({python(), "-c", "import h5py, sys; print(h5py.File(sys.argv[1], 'r')[sys.argv[2]].attrs['layers'][0])",
                                   pristine, victim});
      ASSERT_EQ(first.status, 0) << first.all();
      named += ", layer " + first.out.substr(0, first.out.find('\n'));
    }
    r = train(2, cfg, more);
    EXPECT_EQ(r.status, 2) << r.all();
    EXPECT_NE(r.err.find("fp8moe: error: checkpoint.resume: " + f4 + ": dataset " + named + ": checksum mismatch"),
              std::string::npos)
        << r.err;
    r = run({exe(), "ckpt", "verify", s4});  // the offline check names it too
    EXPECT_EQ(r.status, 1) << r.all();
    EXPECT_NE(r.err.find(named + ": checksum mismatch"), std::string::npos) << r.err;
  }
  // A per-block family whose `layers` attribute names other blocks than the model's (the data and
  // checksums intact, its two slots said to be blocks 1 and 0): refused by the load and by verify.
  fs::copy_file(pristine, f4, fs::copy_options::overwrite_existing);
  r = run({python(), "-c",
           "import h5py, numpy, sys\n"
           "d = h5py.File(sys.argv[1], 'r+')['params/layers.attn.wq']\n"
           "assert list(d.attrs['layers']) == [0, 1], list(d.attrs['layers'])\n"
           "d.attrs['layers'] = numpy.array([1, 0], dtype=numpy.int64)",
           f4});
  ASSERT_EQ(r.status, 0) << r.all();
  const std::string swapped = "dataset /params/layers.attn.wq: holds layers 1, 0, expected layers 0, 1";
  r = train(2, cfg, more);
  EXPECT_EQ(r.status, 2) << r.all();
  EXPECT_NE(r.err.find(f4 + ": " + swapped), std::string::npos) << r.err;
  r = run({exe(), "ckpt", "verify", s4});
  EXPECT_EQ(r.status, 1) << r.all();
  EXPECT_NE(r.err.find(swapped), std::string::npos) << r.err;
}

// A checkpoint resumed under another train.moments_dtype (BF16 -> FP32; FP32 -> BF16 together with
// another fp8.amax_history_len): the moments are converted (the next checkpoint stores them in the
// new dtype, h5ls says which), changed histories start afresh with a note, and training continues.
// With the histories kept, the first resumed step's loss is the uninterrupted run's bit for bit (the
// parameters are the same); later losses differ by the moments' precision and the fresh histories
// (measured over steps 6-8: 9.7e-6 for BF16 -> FP32, 4.8e-5 for FP32 -> BF16 with fresh histories;
// asserted 1e-4 and 5e-4, 10x each; the bound was 1e-3 for both).
TEST_F(Resume, AnotherMomentsDtypeOrHistoryLength) {
  auto dtype_of = [](const std::string& file, const std::string& dataset) {
    const RunResult r = run({"h5ls", "-v", file + "/" + dataset});
    return r.out.find("16-bit little-endian floating-point") != std::string::npos ? std::string("bf16")
           : r.out.find("native float") != std::string::npos                   ? std::string("fp32")
                                                                                  : "unknown: " + r.out;
  };
  for (const std::string from : {"bf16", "fp32"}) {
    const std::string to = from == "bf16" ? "fp32" : "bf16", name = "dtype-" + from, cfg = config(name);
    const std::vector<std::string> base = {"train.steps=8", "train.warmup_steps=1", "eval.every=0",
                                           "train.moments_dtype=" + from};
    std::vector<std::string> sets = base;
    sets.push_back("checkpoint.dir=" + ckpt(name) + "-ref");
    RunResult r = train(1, cfg, sets);  // uninterrupted
    ASSERT_EQ(r.status, 0) << r.all();
    const auto want = losses(r.out);
    sets = base;
    sets.push_back("train.exit_interval=4");
    r = train(1, cfg, sets);
    ASSERT_EQ(r.status, 0) << r.all();
    const std::string s4 = ckpt(name) + "/step_00000004/checkpoint.h5";
    EXPECT_EQ(dtype_of(s4, "optim/m/head.weight"), from);
    const bool new_history = from == "fp32";
    sets = {"train.steps=8", "train.warmup_steps=1", "eval.every=0", "train.moments_dtype=" + to,
            new_history ? "fp8.amax_history_len=16" : "fp8.amax_history_len=8", "train.exit_interval=5"};
    r = train(1, cfg, sets);
    ASSERT_EQ(r.status, 0) << r.all();
    EXPECT_EQ(r.out.find("amax histories have length 8, fp8.amax_history_len is 16: delayed scaling starts afresh") !=
                  std::string::npos,
              new_history)
        << r.out;
    const std::string s5 = ckpt(name) + "/step_00000005/checkpoint.h5";
    EXPECT_EQ(dtype_of(s5, "optim/m/head.weight"), to);
    EXPECT_EQ(dtype_of(s5, "optim/v/layers.1.moe.experts.w2"), to);
    EXPECT_EQ(run({exe(), "ckpt", "verify", ckpt(name) + "/step_00000005"}).status, 0);
    const auto got5 = losses(r.out);
    ASSERT_TRUE(got5.count(5)) << r.out;
    if (!new_history) {
      EXPECT_EQ(got5.at(5), want.at(5)) << "step 5 runs on the step-4 parameters";
    }
    sets.back() = "train.exit_interval=0";
    r = train(1, cfg, sets);  // on to step 8 from step 5
    ASSERT_EQ(r.status, 0) << r.all();
    const auto got = losses(r.out);
    double worst = 0;
    for (int step = 6; step <= 8; ++step) {
      ASSERT_TRUE(got.count(step)) << r.out;
      const double a = std::strtod(want.at(step).c_str(), nullptr), b = std::strtod(got.at(step).c_str(), nullptr);
      worst = std::max(worst, std::fabs(a - b) / std::fabs(a));
    }
    std::printf("moments %s -> %s, amax history 8 -> %d: steps 6-8 within %.2e of the uninterrupted run\n", from.c_str(),
                to.c_str(), new_history ? 16 : 8, worst);
    EXPECT_LE(worst, new_history ? 5e-4 : 1e-4);
  }
}

// Checkpoints of the older format versions, written by fp8moe before each change of layout and kept
// in tests/data with the losses of their uninterrupted run (the same run twice: 2 ranks, expert 2 x
// data 2, ZeRO-1; MLA, MTP, 4 routed experts, FP8 off): ckpt-v1 (format 1, one dataset per
// tensor) and ckpt-v2 (format 2, the routed experts stacked). `ckpt verify` and `export` read each,
// and each resumes at step 6 on 1 rank, on tensor 2 x expert 2 and on pipeline 2, continuing to
// step 12 within the layout tests' bound for FP8 off (5e-6 of the uninterrupted run; measured
// 9.4e-10). The next save is of the current format, which resumes in turn. A file of an unknown
// version is refused naming the version and the versions this build reads.
TEST_F(Resume, OldFormatResumesUnderAnotherLayout) {
  const std::string data = source_dir() + "/tests/data";
  std::vector<std::string> prep = {exe(), "prepare-data", "--output", dir_->path + "/data-v1/lic", "--val-fraction",
                                   "0.2", "--seed", "3", "--input"};
  for (const char* f : {"GPL-3", "GPL-2", "LGPL-3", "Apache-2.0"}) prep.push_back(std::string("/usr/share/common-licenses/") + f);
  ASSERT_EQ(run(prep).status, 0);
  const std::string config = data + "/ckpt-v1/config.yaml";  // the run of both
  const std::vector<std::string> data_sets = {"data.path=" + dir_->path + "/data-v1/lic.train",
                                              "data.valid_path=" + dir_->path + "/data-v1/lic.val"};
  std::map<int, double> want;
  {
    std::ifstream in(data + "/ckpt-v1/losses.txt");
    int step;
    std::string bits;
    while (in >> step >> bits) want[step] = std::strtod(bits.c_str(), nullptr);
  }
  ASSERT_EQ(want.size(), 12u);
  struct Fixture {
    int version;
    std::string step_dir;
    int datasets;
  };
  struct Case {
    int ranks;
    std::vector<std::string> sets;
  };
  const std::vector<Case> cases = {{1, {"parallel.expert=1"}},
                                   {4, {"parallel.tensor=2", "parallel.expert=2"}},
                                   {2, {"parallel.pipeline=2", "parallel.expert=1"}}};
  std::string last_save;
  for (const Fixture& fx : {Fixture{1, data + "/ckpt-v1/step_00000006", 285}, Fixture{2, data + "/ckpt-v2/step_00000006", 204}}) {
    const std::string v = std::to_string(fx.version), old = fx.step_dir;
    RunResult r = run({exe(), "ckpt", "verify", old});
    EXPECT_EQ(r.status, 0) << r.all();
    EXPECT_NE(r.out.find("valid: step 6, " + std::to_string(fx.datasets) + " datasets"), std::string::npos) << r.out;
    int n = 0;
    for (const Case& c : cases) {
      const std::string dir = ckpt("v" + v + "-" + std::to_string(++n));
      std::vector<std::string> sets = c.sets;
      sets.insert(sets.end(), data_sets.begin(), data_sets.end());
      sets.insert(sets.end(), {"checkpoint.dir=" + dir, "checkpoint.resume=" + old, "checkpoint.every=0"});
      r = train(c.ranks, config, sets);
      ASSERT_EQ(r.status, 0) << r.all();
      EXPECT_NE(r.out.find(old + ": " + std::to_string(fx.datasets) + " datasets, every checksum verified"), std::string::npos)
          << r.out;
      const auto got = losses(r.out);
      double worst = 0;
      for (int step = 7; step <= 12; ++step) {
        ASSERT_TRUE(got.count(step)) << r.out;
        worst = std::max(worst, std::fabs(std::strtod(got.at(step).c_str(), nullptr) - want.at(step)) / want.at(step));
      }
      EXPECT_EQ(got.begin()->first, 7) << r.out;
      std::printf("format %d checkpoint resumed on %d rank(s) (%s...): steps 7-12 within %.2e of the uninterrupted run\n",
                  fx.version, c.ranks, c.sets[0].c_str(), worst);
      EXPECT_LE(worst, 5e-6);
      last_save = dir + "/step_00000012";
    }
    // `fp8moe export` reads it too: every parameter, as FP32, is the file's (the file split into
    // tensors by tests/io/check_checkpoint.py, read with h5py and safetensors: no fp8moe code).
    const std::string hf = ckpt("v" + v + "-hf");
    r = run({exe(), "export", old, hf, "--dtype", "fp32"});
    ASSERT_EQ(r.status, 0) << r.all();
    r = run({python(), "-c",
             "import sys, glob, h5py, numpy as np\n"
             "sys.path.insert(0, sys.argv[3])\n"
             "from check_checkpoint import read_tensors\n"
             "from safetensors.numpy import load_file\n"
             "t = {}\n"
             "for f in glob.glob(sys.argv[2] + '/*.safetensors'): t.update(load_file(f))\n"
             "c = read_tensors(h5py.File(sys.argv[1], 'r')['params'])\n"
             "assert len(c) == 97, len(c)\n"
             "assert np.array_equal(t['model.layers.1.mlp.experts.2.up_proj.weight'], c['layers.1.moe.experts.2.w3'])\n"
             "assert np.array_equal(t['model.layers.2.self_attn.o_proj.weight'], c['layers.2.attn.wo'])\n"
             "assert np.array_equal(t['model.embed_tokens.weight'], c['embed.weight'])\n"
             "print('export of format " + v + ": equal')",
             old + "/checkpoint.h5", hf, source_dir() + "/tests/io"});
    EXPECT_EQ(r.status, 0) << r.all();
  }
  // The save at the end of the last run is of the current format, 3; it resumes (one more step).
  RunResult r = run({python(), source_dir() + "/tests/io/check_checkpoint.py", last_save + "/checkpoint.h5"}, 300);
  EXPECT_EQ(r.status, 0) << r.all();
  EXPECT_NE(r.out.find("h5py: format 3"), std::string::npos) << r.out;
  std::vector<std::string> sets = data_sets;
  sets.insert(sets.end(), {"checkpoint.dir=" + ckpt("v2-3"), "checkpoint.resume=" + last_save, "checkpoint.every=0",
                           "train.steps=13", "parallel.expert=1"});
  r = train(1, config, sets);
  EXPECT_EQ(r.status, 0) << r.all();
  EXPECT_TRUE(losses(r.out).count(13)) << r.out;
  // A version this build does not know: refused, naming it.
  const std::string v9 = ckpt("v9"), reads = "this build reads versions 1 to 3";
  fs::create_directories(v9);
  fs::copy_file(data + "/ckpt-v1/step_00000006/checkpoint.h5", v9 + "/checkpoint.h5");
  r = run({python(), "-c",
           "import h5py, numpy, sys; f = h5py.File(sys.argv[1], 'r+'); f.attrs['format_version'] = numpy.int64(9)",
           v9 + "/checkpoint.h5"});
  ASSERT_EQ(r.status, 0) << r.all();
  r = run({exe(), "ckpt", "verify", v9});
  EXPECT_EQ(r.status, 1) << r.all();
  EXPECT_NE(r.err.find("format version 9, " + reads), std::string::npos) << r.err;
  sets = data_sets;
  sets.insert(sets.end(), {"checkpoint.resume=" + v9, "checkpoint.dir=" + ckpt("v9-run"), "parallel.expert=1"});
  r = train(1, config, sets);
  EXPECT_EQ(r.status, 2) << r.all();
  EXPECT_NE(r.err.find(v9 + "/checkpoint.h5: format version 9, " + reads), std::string::npos) << r.err;
}

TEST_F(Resume, ReadableWithoutFp8moe) {
  // h5py reads every dataset (BF16 moments as floats) and an independent NumPy implementation
  // of the documented checksum matches every stored one.
  RunResult r = train(2, config("h5py"), {"train.steps=4", "train.warmup_steps=1"});
  ASSERT_EQ(r.status, 0) << r.all();
  r = run({python(), source_dir() + "/tests/io/check_checkpoint.py", ckpt("h5py") + "/step_00000004/checkpoint.h5"}, 300);
  EXPECT_EQ(r.status, 0) << r.all();
  std::printf("%s", r.out.c_str());
}

}  // namespace
}  // namespace fp8moe::test
