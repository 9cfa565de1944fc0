// The fp8moe executable as users meet it: --help, --version, `train --dry-run`, `defaults`, and
// more than fifty bad configs, each of which must give exit status 2 and exactly one message that
// names the key path (and, where the value came from the file, file:line:column).
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "tests/test_util.h"

namespace fp8moe::test {
namespace {

// ---- the command line ------------------------------------------------------------------------

TEST(Cli, HelpListsTheCommandsAndExitStatuses) {
  const RunResult r = run({exe(), "--help"});
  EXPECT_EQ(r.status, 0) << r.all();
  EXPECT_NE(r.out.find("train"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("defaults"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("Exit status"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("OMPI_ALLOW_RUN_AS_ROOT=1"), std::string::npos) << r.out;
}

TEST(Cli, TrainHelpShowsSetAndDryRun) {
  const RunResult r = run({exe(), "train", "--help"});
  EXPECT_EQ(r.status, 0) << r.all();
  EXPECT_NE(r.out.find("--set"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("--dry-run"), std::string::npos) << r.out;
}

TEST(Cli, VersionNamesTheLibraries) {
  const RunResult r = run({exe(), "--version"});
  EXPECT_EQ(r.status, 0) << r.all();
  for (const char* want : {"fp8moe 0.", "MPI:", "Open MPI", "HDF5:", "parallel", "yaml-cpp:", "oneDNN:", "NCCL:"})
    EXPECT_NE(r.out.find(want), std::string::npos) << want << "\n" << r.out;
  // oneDNN's line: its version as the library reports it (Debian 12: 2.6.x), OpenMP threading
  // (shared with the CPU ops' OpenMP teams) and the instruction set of its GEMMs.
  const size_t dnnl = r.out.find("oneDNN:");
  ASSERT_NE(dnnl, std::string::npos) << r.out;
  const std::string line = r.out.substr(dnnl, r.out.find('\n', dnnl) - dnnl);
  EXPECT_NE(line.find("oneDNN:     2."), std::string::npos) << line;
  EXPECT_NE(line.find("(OpenMP threading)"), std::string::npos) << line;
  EXPECT_NE(line.find("FP32 sgemm"), std::string::npos) << line;
  EXPECT_NE(line.find("; ISA "), std::string::npos) << line;
  EXPECT_EQ(r.out.find("OpenBLAS"), std::string::npos) << "no OpenBLAS is linked any more\n" << r.out;
}

TEST(Cli, UsageErrorsExitTwo) {
  for (const std::vector<std::string>& args : std::vector<std::vector<std::string>>{
           {exe()},                                   // no subcommand
           {exe(), "fly"},                            // unknown subcommand
           {exe(), "train"},                          // missing CONFIG
           {exe(), "train", "x.yaml", "--bogus"},     // unknown option
           {exe(), "train", "x.yaml", "--set"},       // --set without a value
       }) {
    const RunResult r = run(args);
    EXPECT_EQ(r.status, 2) << args.back() << "\n" << r.all();
    EXPECT_FALSE(r.err.empty()) << args.back();
  }
}

TEST(Cli, MissingAndUnreadableConfigFiles) {
  TempDir tmp;
  RunResult r = run({exe(), "train", tmp.path + "/nope.yaml", "--dry-run"});
  EXPECT_EQ(r.status, 2) << r.all();
  EXPECT_NE(r.err.find(tmp.path + "/nope.yaml: cannot read the config file: it does not exist"), std::string::npos) << r.err;
  r = run({exe(), "train", tmp.path, "--dry-run"});  // a directory
  EXPECT_EQ(r.status, 2) << r.all();
  EXPECT_NE(r.err.find("not a regular file (a directory)"), std::string::npos) << r.err;
  // A FIFO without a writer is refused at once (the open does not wait for one) and a device is
  // refused before a byte of it is read (/dev/zero has no end).
  const std::string fifo = tmp.path + "/fifo.yaml";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0) << std::strerror(errno);
  r = run({exe(), "train", fifo, "--dry-run"}, 20);
  ASSERT_FALSE(r.timed_out) << "the config reader blocked on a FIFO";
  EXPECT_EQ(r.status, 2) << r.all();
  EXPECT_NE(r.err.find(fifo + ": cannot read the config file: it is not a regular file (a FIFO)"), std::string::npos)
      << r.err;
  r = run({exe(), "train", "/dev/zero", "--dry-run"}, 20);
  ASSERT_FALSE(r.timed_out) << "the config reader read /dev/zero";
  EXPECT_EQ(r.status, 2) << r.all();
  EXPECT_NE(r.err.find("/dev/zero: cannot read the config file: it is not a regular file (a character device)"),
            std::string::npos)
      << r.err;
}

TEST(Cli, ALatestThatIsNotASmallFileIsRefusedAtOnce) {
  // A checkpoint.dir whose `latest` is a FIFO (once: a reader that waited forever), /dev/zero (once:
  // 60 s and 16.9 GB read) or a file of more than a line: refused before any read, naming the path.
  TempDir tmp;
  std::filesystem::create_directory(tmp.path + "/step_00000001");
  const std::string latest = tmp.path + "/latest";
  const auto inspect = [&] { return run({exe(), "ckpt", "inspect", tmp.path}, 20); };
  ASSERT_EQ(::mkfifo(latest.c_str(), 0600), 0) << std::strerror(errno);
  RunResult r = inspect();
  ASSERT_FALSE(r.timed_out) << "blocked on a FIFO";
  EXPECT_EQ(r.status, 1) << r.all();  // ckpt's status for a checkpoint it cannot use (README)
  EXPECT_NE(r.err.find(latest + ": cannot read the checkpoint pointer (latest): it is not a regular file (a FIFO)"),
            std::string::npos)
      << r.err;
  std::filesystem::remove(latest);
  std::filesystem::create_symlink("/dev/zero", latest);
  r = inspect();
  ASSERT_FALSE(r.timed_out) << "read /dev/zero";
  EXPECT_NE(r.err.find("it is not a regular file (a character device)"), std::string::npos) << r.err;
  std::filesystem::remove(latest);
  tmp.write("latest", std::string(5000, 'x'));
  r = inspect();
  EXPECT_NE(r.err.find("it is 5000 bytes, over the limit of 4096 bytes"), std::string::npos) << r.err;
}

TEST(Cli, DryRunPrintsEffectiveConfigAndGrid) {
  // tiny.yaml asks for 8 ranks; --set brings it to the single rank of this run.
  const RunResult r = run({exe(), "train", source_dir() + "/configs/tiny.yaml", "--dry-run", "--set",
                           "parallel.tensor=1", "--set", "parallel.pipeline=1", "--set", "parallel.expert=1",
                           "--set", "train.lr=5e-4", "--set", "fp8.layers=[experts]", "--set", "parallel.stage_layers=[4]",
                           "--set", "train.recompute_layers=[0,2]"});
  ASSERT_EQ(r.status, 0) << r.all();
  EXPECT_TRUE(r.err.empty()) << r.err;
  EXPECT_NE(r.out.find("effective config:"), std::string::npos);
  EXPECT_NE(r.out.find("  lr: 0.0005\n"), std::string::npos) << r.out;        // the override
  EXPECT_NE(r.out.find("  d_expert: 256\n"), std::string::npos) << r.out;     // from the file
  EXPECT_NE(r.out.find("  keep_last: 3\n"), std::string::npos) << r.out;      // a default
  EXPECT_NE(r.out.find("  layers: [experts]\n"), std::string::npos) << r.out; // a list override
  // Lists of numbers; the maps after them still in block style (a flow style set on a list once
  // turned every later map into flow style).
  EXPECT_NE(r.out.find("  stage_layers: [4]\n"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("  recompute_layers: [0, 2]\n"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("\ncheckpoint:\n"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("process grid: world 1 = tensor 1 x pipeline 1 x data 1"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("dry run: the config is valid"), std::string::npos) << r.out;
}

// The published DeepSeek configs' parameter counts, printed by --dry-run on one rank (their layouts
// need 2,048 and 8): DeepSeek-V3 671B total, 36.6B activated (the embedding not counted, the 0.9B
// head counted), its MTP module 11.6B of its own (DeepSeek publishes 11.5B; the exact sum of the
// module's tensors: eh_proj 0.10B, one MoE block 11.51B, two norms); DeepSeek-V2-Lite 15.7B / 2.4B.
TEST(Cli, DryRunCountsThePublishedDeepSeekModels) {
  struct Want {
    const char* config;
    std::vector<std::string> lines;
  };
  for (const Want& w : {Want{"deepseek-v3-671b.yaml",
                             {"  total                  671026419200    671.03B     36.63B\n",
                              "  head                      926679040    926.68M    926.68M\n",
                              "  MTP                     11610068224     11.61B    688.10M\n"}},
                        Want{"deepseek-v2-lite.yaml",
                             {"  total                   15706485888     15.71B      2.45B\n",
                              "  embedding                 209715200    209.72M          0\n"}}}) {
    const RunResult r = run({exe(), "train", source_dir() + "/configs/" + w.config, "--dry-run", "--set",
                             "parallel.pipeline=1", "--set", "parallel.stage_layers=even", "--set", "parallel.expert=1",
                             "--set", "runtime.device=cpu"});
    ASSERT_EQ(r.status, 0) << r.all();
    for (const std::string& line : w.lines) EXPECT_NE(r.out.find(line), std::string::npos) << w.config << ": " << line << r.out;
  }
  // The small configs of the same shapes validate on one rank too (their 8-rank layouts aside).
  for (const char* config : {"tiny-v3.yaml", "tiny-v2-lite.yaml"}) {
    const RunResult r = run({exe(), "train", source_dir() + "/configs/" + config, "--dry-run", "--set",
                             "parallel.tensor=1", "--set", "parallel.pipeline=1", "--set", "parallel.expert=1"});
    EXPECT_EQ(r.status, 0) << config << ":\n" << r.all();
    EXPECT_NE(r.out.find("  attention: mla\n"), std::string::npos) << config;
  }
}

TEST(Cli, TrainsEndToEndAndWritesTheMetrics) {
  // 30 steps of a small model on real text (Debian's license texts, always installed).
  TempDir tmp;
  std::vector<std::string> prep = {exe(), "prepare-data", "--output", tmp.path + "/data/lic", "--val-fraction", "0.3",
                                   "--seed", "5", "--input"};
  for (const char* f : {"GPL-3", "GPL-2", "LGPL-3", "LGPL-2.1", "Apache-2.0", "MPL-2.0", "Artistic", "BSD", "GFDL-1.3"})
    prep.push_back(std::string("/usr/share/common-licenses/") + f);
  RunResult r = run(prep);
  ASSERT_EQ(r.status, 0) << r.all();
  const std::string cfg = tmp.write("small.yaml",
                                    "model: {d_model: 64, n_layers: 2, n_heads: 4, n_kv_heads: 2, head_dim: 16,\n"
                                    "        first_dense_layers: 1, d_ff_dense: 128,\n"
                                    "        moe: {n_experts: 4, top_k: 2, n_shared_experts: 1, d_expert: 64}}\n"
                                    "train: {steps: 30, warmup_steps: 3, global_batch: 8, seq_len: 64, lr: 3.0e-3, min_lr: 3.0e-4}\n"
                                    "parallel: {micro_batches: 2}\n"
                                    "fp8: {recipe: blockwise, tile: 32}\n"
                                    "eval: {every: 10, batches: 2}\n"
                                    "log: {every: 1, jsonl: " + tmp.path + "/logs/m.jsonl}\n"
                                    "data: {path: " + tmp.path + "/data/lic.train, valid_path: " + tmp.path + "/data/lic.val}\n"
                                    "checkpoint: {dir: " + tmp.path + "/ckpt}\n");
  r = run({exe(), "train", cfg}, 600);
  ASSERT_EQ(r.status, 0) << r.all();
  EXPECT_NE(r.out.find("step    30/30"), std::string::npos) << r.out;
  // Every line of the JSONL parses and has every field; the loss falls by a clear margin.
  const std::string check = tmp.write("check.py",
      "import json, math, sys\n"
      "rows = [json.loads(l) for l in open(sys.argv[1])]\n"
      "need = ['step','loss','val_loss','lr','grad_norm','tokens_per_s','step_time_s','mfu','peak_mem_bytes',\n"
      "        'expert_load_imbalance','fp8_saturated','fp8_underflowed','skipped_steps','loss_scale',\n"
      "        'host_syncs','h2d_bytes','d2h_bytes','comm_exposed_s']\n"
      "assert len(rows) == 30, len(rows)\n"
      "for r in rows:\n"
      "    missing = [k for k in need if k not in r]\n"
      "    assert not missing, missing\n"
      "assert [r['step'] for r in rows] == list(range(1, 31))\n"
      "# Step 1: weights of std 0.02 give logits near 0, so the loss is near ln 256 = 5.545 (measured\n"
      "# 5.578: the small logits and the aux loss add 0.033); a loss summed over the 2 micro-batches\n"
      "# (11.2) or scaled wrongly is far outside 0.1.\n"
      "assert abs(rows[0]['loss'] - math.log(256)) < 0.1, rows[0]['loss']\n"
      "first = sum(r['loss'] for r in rows[:3]) / 3\n"
      "last = sum(r['loss'] for r in rows[-3:]) / 3\n"
      "# measured (2-core VM, 2026-12-01): 5.423 -> 3.155 (2.27 lower)\n"
      "assert last < first - 1.0, (first, last)\n"
      "assert rows[9]['val_loss'] is not None and rows[29]['val_loss'] < rows[9]['val_loss'], (rows[9], rows[29])\n"
      "print('loss %.3f -> %.3f, val %.3f -> %.3f' % (first, last, rows[9]['val_loss'], rows[29]['val_loss']))\n");
  r = run({python(), check, tmp.path + "/logs/m.jsonl"});
  EXPECT_EQ(r.status, 0) << r.all();
  std::printf("%s", r.out.c_str());
  // Dynamic loss scaling trains too, and reports its scale.
  r = run({exe(), "train", cfg, "--set", "train.steps=3", "--set", "train.warmup_steps=1", "--set", "train.loss_scale=dynamic",
           "--set", "log.jsonl=" + tmp.path + "/logs/dyn.jsonl", "--set", "eval.every=0",
           "--set", "checkpoint.dir=" + tmp.path + "/ckpt-dyn", "--set", "checkpoint.save=false"}, 300);
  ASSERT_EQ(r.status, 0) << r.all();
  // checkpoint.save false (this run): not even the final checkpoint is written.
  EXPECT_FALSE(std::filesystem::exists(tmp.path + "/ckpt-dyn")) << r.out;
  EXPECT_NE(r.out.find("no checkpoint (checkpoint.save false)"), std::string::npos) << r.out;
  {
    std::ifstream dyn(tmp.path + "/logs/dyn.jsonl");
    std::string line;
    std::getline(dyn, line);
    EXPECT_NE(line.find("\"loss_scale\":65536"), std::string::npos) << line;
  }
  // The loss curve of the run as a PNG.
  r = run({source_dir() + "/scripts/plot-metrics", tmp.path + "/logs/m.jsonl", tmp.path + "/loss.png"}, 120);
  EXPECT_EQ(r.status, 0) << r.all();
  std::ifstream png(tmp.path + "/loss.png", std::ios::binary);
  char magic[8] = {};
  png.read(magic, 8);
  EXPECT_EQ(std::string(magic, 8), std::string("\x89PNG\r\n\x1a\n", 8));
  // The checkpoint the run wrote at its end: generation is deterministic, continues the prompt, and
  // draws the tokens the independent reference (tests/reference/generate_ref.py: JAX in FP64 with
  // the same blockwise FP8 quantization, its own routing, the documented sampling rule with its own
  // Philox) draws from the same weights: greedy (this 30-step model continues with spaces only, so
  // greedy alone hardly tests the logits) and sampled among the top 4 at temperature 1.
  for (const char* temperature : {"0", "1"}) {
    const std::vector<std::string> gen = {exe(), "generate", "--checkpoint", tmp.path + "/ckpt", "--prompt", "The GNU",
                                          "--tokens", "24", "--temperature", temperature, "--top-k", "4", "--seed", "7"};
    r = run(gen, 300);
    ASSERT_EQ(r.status, 0) << r.all();
    EXPECT_EQ(r.out.rfind("The GNU", 0), 0u) << r.out;
    EXPECT_EQ(run(gen, 300).out, r.out) << "the same seed, the same text";
    const RunResult ref = run({python(), source_dir() + "/tests/reference/generate_ref.py",
                               tmp.path + "/ckpt/step_00000030/checkpoint.h5", "The GNU", "24", temperature, "4", "7",
                               tmp.write("generated.txt", r.out)}, 300);
    EXPECT_EQ(ref.status, 0) << ref.all();
    std::printf("%s", ref.out.c_str());
  }
  // A typo of a few zeros is refused, not run for days (output is streamed, so a long run shows).
  r = run({exe(), "generate", "--checkpoint", tmp.path + "/ckpt", "--prompt", "x", "--tokens", "2000000000"});
  EXPECT_EQ(r.status, 2) << r.all();
  EXPECT_NE(r.err.find("fp8moe: error: --tokens: expected a number in [0, 1000000], got 2000000000"), std::string::npos)
      << r.err;
  r = run({exe(), "generate", "--checkpoint", tmp.path + "/nothing", "--prompt", "x"});
  EXPECT_EQ(r.status, 2) << r.all();
  EXPECT_NE(r.err.find("fp8moe: error: --checkpoint: " + tmp.path + "/nothing: no such checkpoint directory"),
            std::string::npos) << r.err;
}

TEST(Cli, DefaultsOutputIsAValidConfigOfTheDefaults) {
  const RunResult d = run({exe(), "defaults"});
  ASSERT_EQ(d.status, 0) << d.all();
  TempDir tmp;
  const std::string path = tmp.write("defaults.yaml", d.out);
  const RunResult r = run({exe(), "train", path, "--dry-run"});
  EXPECT_EQ(r.status, 0) << r.all();
}

TEST(Cli, EightRankDryRunOfTinyPrintsTheGrid) {
  const RunResult r = run({mpiexec(), "-n", "8", "--oversubscribe", exe(), "train", source_dir() + "/configs/tiny.yaml",
                           "--dry-run"},
                          240);
  ASSERT_EQ(r.status, 0) << r.all();
  EXPECT_NE(r.out.find("process grid: world 8 = tensor 2 x pipeline 2 x data 2; data 2 = expert 2 x expert-data 1"),
            std::string::npos)
      << r.out;
  // Only rank 0 prints.
  EXPECT_EQ(count(r.out, "effective config:"), 1u) << r.out;
  // Each row ends with tp pp dp ep edp; in the tp-ep-edp-pp order rank r has tp = r % 2,
  // ep = dp = (r / 2) % 2, pp = r / 4, edp = 0.
  for (int rank = 0; rank < 8; ++rank) {
    const std::string head = "  " + std::string(4 - (rank >= 10), ' ') + std::to_string(rank) + "  ";
    const size_t at = r.out.find("\n" + head);
    ASSERT_NE(at, std::string::npos) << "no row for rank " << rank << "\n" << r.out;
    const std::string row = r.out.substr(at + 1, r.out.find('\n', at + 1) - at - 1);
    char tail[64];
    std::snprintf(tail, sizeof tail, " %4d %4d %4d %4d %4d", rank % 2, rank / 4, (rank / 2) % 2, (rank / 2) % 2, 0);
    EXPECT_TRUE(row.size() >= strlen(tail) && row.compare(row.size() - strlen(tail), std::string::npos, tail) == 0)
        << "rank " << rank << " row '" << row << "', expected it to end with '" << tail << "'";
  }
}

TEST(Cli, CommandLineErrorsPrintOnceUnderMpirun) {
  const RunResult r = run({mpiexec(), "-n", "3", "--oversubscribe", exe(), "train"}, 120);
  EXPECT_EQ(r.status, 2) << r.all();
  EXPECT_EQ(count(r.all(), "fp8moe: error: config is required (see fp8moe --help)"), 1u) << r.all();
}

TEST(Cli, PlanOptionsTakeFiniteNumbersInTheirRange) {
  // Each once exited 0, reading 0, NaN or infinity as "unset" or planning with it.
  const std::string cfg = source_dir() + "/configs/tiny.yaml";
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--world", "0"}, "--world: Value 0 not in range 1 to 16777216"},
      {{"--efficiency", "0"}, "--efficiency: expected a fraction of the peak, a finite number in (0, 1], got '0'"},
      {{"--efficiency", "nan"}, "got 'nan'"},
      {{"--efficiency", "1.5"}, "got '1.5'"},
      {{"--tokens", "0"}, "--tokens: expected a number of tokens, a finite number in (0, 1e+24], got '0'"},
      {{"--tokens", "nan"}, "got 'nan'"},
      {{"--tokens", "inf"}, "got 'inf'"},
      {{"--tokens", "1e12", "--target-gpu-hours", "0"}, "--target-gpu-hours: expected device-hours"},
      {{"--tokens", "1e12", "--target-gpu-hours", "nan"}, "got 'nan'"},
      {{"--baseline-bytes", "-1e9"}, "--baseline-bytes: expected bytes, a finite number in [0, 1e+15], got '-1e9'"},
      {{"--baseline-bytes", "nan"}, "got 'nan'"},
      {{"--device", ""}, "--device: expected a device: h100, h200, h800, b200 or cpu, got ''"},
      {{"--node-size", "0"}, "--node-size: Value 0 not in range"},
  };
  for (const auto& [args, message] : cases) {
    std::vector<std::string> argv = {exe(), "plan", cfg, "--no-probe"};
    argv.insert(argv.end(), args.begin(), args.end());
    const RunResult r = run(argv);
    EXPECT_EQ(r.status, 2) << args.front() << " " << args.back() << "\n" << r.all();
    EXPECT_EQ(r.err.rfind("fp8moe: error: ", 0), 0u) << r.err;
    EXPECT_NE(r.err.find(message), std::string::npos) << r.err;
    EXPECT_EQ(count(r.err, "\n"), 1u) << r.err;
  }
  // In range, the same options plan.
  const RunResult r = run({exe(), "plan", cfg, "--no-probe", "--world", "8", "--efficiency", "0.5", "--tokens", "1e9",
                           "--device", "h100"});
  EXPECT_EQ(r.status, 0) << r.all();
}

TEST(Cli, CommandLineErrorsAreFp8moesOneLine) {
  // CLI11's own errors (a value that does not convert, an unknown option) in fp8moe's form.
  RunResult r = run({exe(), "plan", source_dir() + "/configs/tiny.yaml", "--node-size", "abc"});
  EXPECT_EQ(r.status, 2) << r.all();
  EXPECT_EQ(r.err, "fp8moe: error: --node-size: Value abc not in range 1 to 65536 (see fp8moe --help)\n") << r.all();
  r = run({exe(), "train", "--no-such-option"});
  EXPECT_EQ(r.status, 2) << r.all();
  EXPECT_EQ(r.err.rfind("fp8moe: error: ", 0), 0u) << r.err;
  EXPECT_EQ(count(r.err, "\n"), 1u) << r.err;
}

TEST(Cli, PrepareData) {
  TempDir tmp;
  const std::string in = tmp.write("fortunes", "A fortune.\n%\nAnother one.\n%\n");
  RunResult r = run({exe(), "prepare-data", "--input", in, "--output", tmp.path + "/f", "--split-on", "%",
                     "--val-fraction", "0"});
  ASSERT_EQ(r.status, 0) << r.all();
  // "A fortune.\n" (11 bytes), "Another one.\n" (13), the empty tail, and 3 document ends
  EXPECT_NE(r.out.find("f.train: 3 documents, 27 tokens"), std::string::npos) << r.out;
  r = run({exe(), "prepare-data", "--input", tmp.path + "/missing", "--output", tmp.path + "/g"});
  EXPECT_EQ(r.status, 2) << r.all();
  EXPECT_NE(r.err.find("fp8moe: error: " + tmp.path + "/missing: cannot read the input"), std::string::npos) << r.err;
  r = run({exe(), "prepare-data", "--input", tmp.write("empty", ""), "--output", tmp.path + "/h"});
  EXPECT_EQ(r.status, 2) << r.all();
  EXPECT_NE(r.err.find("holds no text"), std::string::npos) << r.err;
  r = run({exe(), "prepare-data", "--input", in, "--output", tmp.path + "/i", "--val-fraction", "1.5"});
  EXPECT_EQ(r.status, 2) << r.all();
  EXPECT_NE(r.err.find("--val-fraction"), std::string::npos) << r.err;
}

// ---- bad configs -----------------------------------------------------------------------------

struct BadConfig {
  const char* name;
  const char* yaml;                // the whole config file (every other key has its default)
  const char* key;                 // the key path the message must name
  const char* where;               // "line:col" where the file gives it, "" when not applicable
  const char* also;                // another substring the message must contain ("" = none)
  std::vector<std::string> sets{};  // --set arguments
  int ranks = 1;                   // > 1: run under mpirun -n ranks
};

void PrintTo(const BadConfig& c, std::ostream* os) { *os << c.name; }

// A 100,000-byte value, and a config nested far deeper than any (the parser's recursion limit).
const std::string kLongValue = "model:\n  d_model: " + std::string(100000, 'x') + "\n";
const std::string kDeepNesting = "model: " + std::string(10000, '[') + std::string(10000, ']') + "\n";

const BadConfig kBadConfigs[] = {
    // a watchdog limit under its 250 ms look (once reported as "no progress for 0 s (longer than 0 s)")
    {"TimeoutUnderOneSecond", "runtime:\n  timeout_s: 1.0e-9\n", "runtime.timeout_s", "2:14",
     "0 (no limit) or at least 1 s"},
    // unknown keys and structure
    {"unknown_section", "modle:\n  d_model: 64\n", "modle", "1:1", "did you mean model?"},
    {"unknown_key", "model:\n  d_modle: 64\n", "model.d_modle", "2:3", "did you mean model.d_model?"},
    {"key_in_wrong_section", "model:\n  top_k: 2\n", "model.top_k", "2:3", "did you mean model.moe.top_k?"},
    {"unknown_nested_key", "model:\n  moe:\n    n_expert: 8\n", "model.moe.n_expert", "3:5", "did you mean model.moe.n_experts?"},
    {"unknown_far_from_all", "train:\n  zzzzzzzzzz: 1\n", "train.zzzzzzzzzz", "2:3", "expected one of: seed, steps"},
    {"misspelt_train", "trian:\n  lr: 0.1\n", "trian", "1:1", "did you mean train?"},
    {"section_is_scalar", "model: 5\n", "model", "1:8", "expected a mapping of keys"},
    {"top_level_is_list", "- a\n- b\n", "(top level)", "1:1", "expected a mapping of keys"},
    {"nested_section_is_scalar", "model:\n  moe: 3\n", "model.moe", "2:8", "expected a mapping of keys"},
    {"duplicate_key", "model:\n  d_model: 64\n  d_model: 128\n", "model.d_model", "3:3", "duplicate key (first given at"},
    {"value_is_list", "train:\n  lr: [1, 2]\n", "train.lr", "2:7", "got a list"},
    {"value_is_mapping", "data:\n  path: {a: 1}\n", "data.path", "2:9", "got a mapping"},
    {"blend_weight_zero", "data:\n  path: [[0, a], [1, b]]\n", "data.path[0][0]", "2:9", "got '0', expected a weight > 0"},
    {"blend_item_not_pair", "data:\n  valid_path: [a, b]\n", "data.valid_path[0]", "2:15", "got 'a', expected a pair [weight, prefix]"},
    {"dotted_key", "model:\n  d_model: 128\nmodel.d_model: 64\n", "model.d_model", "3:1", "may not contain '.'"},
    {"quoted_integer", "model:\n  d_model: \"256\"\n", "model.d_model", "2:12", "got the quoted string '256'"},
    {"quoted_bool", "fp8:\n  power_of_two_scales: 'true'\n", "fp8.power_of_two_scales", "2:24", "quoted string"},
    {"two_documents", "model:\n  d_model: 64\n---\nmodel:\n  d_model: 32\n", "one YAML document", "", "found 2"},
    // YAML syntax
    {"unclosed_flow_list", "model:\n  d_model: [64\n", "YAML syntax error", "", ""},
    {"tab_indentation", "model:\n\td_model: 64\n", "YAML syntax error", "", ""},
    {"control_byte_in_yaml_error", "a: \"\\\x05\"\n", "YAML syntax error", "", "unknown escape character: \\x05"},
    {"nested_too_deep", kDeepNesting.c_str(), "YAML nested too deeply", "", "a config nests three levels"},
    // what the message shows of a value
    {"long_value_cut", kLongValue.c_str(), "model.d_model", "2:12", "x... (100000 bytes)', expected an integer"},
    {"control_bytes_escaped", "model:\n  d_model: \"\\x01\\x1b[31m\"\n", "model.d_model", "2:12",
     "got the quoted string '\\x01\\x1B[31m'"},
    // types and ranges: model
    {"int_not_a_number", "model:\n  d_model: abc\n", "model.d_model", "2:12", "expected an integer in [1, 1048576]"},
    {"int_is_fractional", "model:\n  d_model: 64.5\n", "model.d_model", "2:12", "got '64.5'"},
    {"int_is_empty", "model:\n  d_model:\n", "model.d_model", "", "got nothing"},
    {"int_in_exponent_form", "model:\n  d_ff_dense: 1e3\n", "model.d_ff_dense", "2:15", "expected an integer"},
    {"int_with_trailing_text", "model:\n  n_heads: 8x\n", "model.n_heads", "2:12", "got '8x'"},
    {"n_layers_zero", "model:\n  n_layers: 0\n", "model.n_layers", "2:13", "expected an integer in [1, 4096]"},
    {"n_heads_negative", "model:\n  n_heads: -8\n", "model.n_heads", "2:12", "got '-8'"},
    {"vocab_too_small", "model:\n  vocab_size: 1\n", "model.vocab_size", "2:15", "expected an integer in [2,"},
    {"rope_theta_zero", "model:\n  rope_theta: 0\n", "model.rope_theta", "2:15", "expected a number > 0.0"},
    {"norm_eps_too_big", "model:\n  norm_eps: 1.5\n", "model.norm_eps", "2:13", "expected a number in (0.0, 1.0)"},
    {"init_std_negative", "model:\n  init_std: -0.1\n", "model.init_std", "2:13", ""},
    {"top_k_zero", "model:\n  moe:\n    top_k: 0\n", "model.moe.top_k", "3:12", ""},
    {"gating_unknown", "model:\n  moe:\n    gating: relu\n", "model.moe.gating", "3:13", "expected one of softmax, sigmoid"},
    {"aux_loss_negative", "model:\n  moe:\n    aux_loss_coef: -1\n", "model.moe.aux_loss_coef", "3:20", "expected a number >= 0.0"},
    {"capacity_nan", "model:\n  moe:\n    capacity_factor: .nan\n", "model.moe.capacity_factor", "3:22", "got '.nan'"},
    {"shared_experts_too_many", "model:\n  moe:\n    n_shared_experts: 100\n", "model.moe.n_shared_experts", "3:23", "[0, 64]"},
    // parallel
    {"tensor_zero", "parallel:\n  tensor: 0\n", "parallel.tensor", "2:11", "expected an integer in [1,"},
    {"micro_batches_word", "parallel:\n  micro_batches: two\n", "parallel.micro_batches", "2:18", "got 'two'"},
    // train
    {"steps_zero", "train:\n  steps: 0\n", "train.steps", "2:10", "expected an integer >= 1"},
    {"lr_zero", "train:\n  lr: 0\n", "train.lr", "2:7", "expected a number > 0.0"},
    {"beta1_one", "train:\n  beta1: 1.0\n", "train.beta1", "2:10", "expected a number in [0.0, 1.0)"},
    {"beta2_negative", "train:\n  beta2: -0.1\n", "train.beta2", "2:10", ""},
    {"eps_zero", "train:\n  eps: 0\n", "train.eps", "2:8", ""},
    {"schedule_unknown", "train:\n  schedule: exponential\n", "train.schedule", "2:13", "expected one of cosine, linear, constant"},
    {"moments_fp16", "train:\n  moments_dtype: fp16\n", "train.moments_dtype", "2:18", "expected one of fp32, bf16"},
    {"loss_scale_negative", "train:\n  loss_scale: -5\n", "train.loss_scale", "2:15", "none, dynamic, or a number > 0"},
    {"loss_scale_word", "train:\n  loss_scale: auto\n", "train.loss_scale", "2:15", "got 'auto'"},
    {"recompute_all", "train:\n  recompute: all\n", "train.recompute", "2:14", "expected one of none, selective, moe, full"},
    {"activations_fp16", "train:\n  activations: fp16\n", "train.activations", "2:16", "expected one of fp32, bf16"},
    {"hp_gemm_fp16", "train:\n  hp_gemm: fp16\n", "train.hp_gemm", "2:12", "expected one of fp32, bf16"},
    {"grad_reduce_fp16", "optim:\n  grad_reduce: fp16\n", "optim.grad_reduce", "2:16", "expected one of fp32, bf16"},
    {"seed_negative", "train:\n  seed: -1\n", "train.seed", "2:9", "expected an integer >= 0"},
    {"global_batch_overflow", "train:\n  global_batch: 99999999999\n", "train.global_batch", "2:17", "got '99999999999'"},
    {"grad_clip_inf", "train:\n  grad_clip: .inf\n", "train.grad_clip", "2:14", ""},
    // fp8
    {"format_e5m2", "fp8:\n  format: e5m2\n", "fp8.format", "2:11", "expected one of e4m3, hybrid"},
    {"recipe_misspelt", "fp8:\n  recipe: blockwize\n", "fp8.recipe", "2:11", "expected one of off, delayed, current, blockwise"},
    {"amax_compute_mean", "fp8:\n  amax_compute: mean\n", "fp8.amax_compute", "2:17", ""},
    {"margin_negative", "fp8:\n  margin: -1\n", "fp8.margin", "2:11", ""},
    {"tile_zero", "fp8:\n  tile: 0\n", "fp8.tile", "2:9", "expected an integer in [1, 4096]"},
    {"pow2_yes", "fp8:\n  power_of_two_scales: yes\n", "fp8.power_of_two_scales", "2:24", "expected true or false"},
    {"layers_not_a_list", "fp8:\n  layers: attention\n", "fp8.layers", "2:11", "expected a list drawn from"},
    {"layers_unknown_item", "fp8:\n  layers: [attention, router]\n", "fp8.layers[1]", "2:11", "got 'router'"},
    {"layers_repeated_item", "fp8:\n  layers: [mlp, mlp]\n", "fp8.layers[1]", "2:11", "a second time"},
    // data, eval, checkpoint, log
    {"checkpoint_dir_empty", "checkpoint:\n  dir: ''\n", "checkpoint.dir", "2:8", "expected a non-empty string"},
    {"keep_last_zero", "checkpoint:\n  keep_last: 0\n", "checkpoint.keep_last", "2:14", ""},
    {"resume_empty", "checkpoint:\n  resume:\n", "checkpoint.resume", "", "expected a non-empty string"},
    {"log_every_zero", "log:\n  every: 0\n", "log.every", "2:10", ""},
    {"eval_batches_zero", "eval:\n  batches: 0\n", "eval.batches", "2:12", ""},
    // rules between keys
    {"kv_heads_not_divisor", "model:\n  n_kv_heads: 3\n", "model.n_kv_heads", "2:15", "a divisor of model.n_heads = 8"},
    {"kv_heads_more_than_heads", "model:\n  n_heads: 4\n  n_kv_heads: 8\n", "model.n_kv_heads", "3:15", "a divisor of model.n_heads = 4"},
    {"head_dim_odd", "model:\n  head_dim: 33\n", "model.head_dim", "2:13", "an even number"},
    {"mla_rope_odd", "model:\n  attention: mla\n  qk_rope_head_dim: 7\n", "model.qk_rope_head_dim", "3:21", "an even number"},
    {"attention_bad_kind", "model:\n  attention: mqa\n", "model.attention", "2:14", "one of gqa, mla"},
    {"mtp_deeper_than_sequence", "model:\n  mtp_depth: 8\ntrain:\n  seq_len: 8\n", "model.mtp_depth", "2:14",
     "fewer than train.seq_len = 8"},
    {"mla_tile_straddles_tp_shard", "model:\n  attention: mla\n  qk_nope_head_dim: 16\n  qk_rope_head_dim: 8\nparallel:\n  tensor: 2\n",
     "fp8.tile", "", "model.n_heads x (model.qk_nope_head_dim + model.qk_rope_head_dim) / parallel.tensor = 192 / 2 = 96"},
    {"dense_layers_beyond_depth", "model:\n  first_dense_layers: 5\n", "model.first_dense_layers", "2:23", "at most model.n_layers = 4"},
    {"top_k_above_experts", "model:\n  moe:\n    top_k: 9\n", "model.moe.top_k", "3:12", "at most model.moe.n_experts = 8"},
    {"min_lr_above_lr", "train:\n  min_lr: 1.0\n", "train.min_lr", "2:11", "at most train.lr = 0.0003"},
    {"warmup_not_below_steps", "train:\n  steps: 10\n  warmup_steps: 10\n", "train.warmup_steps", "3:17", "fewer than train.steps = 10"},
    {"exit_interval_without_saving", "train:\n  exit_interval: 5\ncheckpoint:\n  save: false\n", "train.exit_interval", "2:18",
     "0 with checkpoint.save false"},
    {"bf16_moments_with_slow_beta2", "train:\n  moments_dtype: bf16\n  beta2: 0.999\n", "train.beta2", "3:10", "at most 0.996 with train.moments_dtype bf16"},
    {"bf16_rows_not_whole_words", "model:\n  d_model: 66\ntrain:\n  activations: bf16\n", "model.d_model", "2:12",
     "a multiple of 4 with train.activations bf16"},
    {"hybrid_with_blockwise", "fp8:\n  format: hybrid\n", "fp8.format", "2:11", "e4m3 with fp8.recipe blockwise"},
    {"default_value_breaks_rule", "model:\n  n_heads: 6\n", "model.n_kv_heads", "", "(the default)"},
    {"tensor_not_dividing_heads", "parallel:\n  tensor: 3\n", "parallel.tensor", "2:11", "a divisor of model.n_heads = 8"},
    {"tensor_not_dividing_kv_heads", "model:\n  n_heads: 8\n  n_kv_heads: 2\nparallel:\n  tensor: 4\n", "parallel.tensor", "5:11", "a divisor of model.n_kv_heads = 2"},
    {"tensor_not_dividing_d_ff", "model:\n  d_ff_dense: 1001\nparallel:\n  tensor: 2\n", "parallel.tensor", "4:11", "a divisor of model.d_ff_dense = 1001"},
    {"tensor_not_dividing_vocab", "model:\n  vocab_size: 255\nparallel:\n  tensor: 2\n", "parallel.tensor", "4:11", "a divisor of model.vocab_size = 255"},
    {"tensor_not_dividing_d_expert", "model:\n  moe:\n    d_expert: 100\nparallel:\n  tensor: 8\n", "parallel.tensor", "5:11", "a divisor of model.moe.d_expert = 100"},
    {"expert_not_dividing_experts", "parallel:\n  expert: 3\n", "parallel.expert", "2:11", "a divisor of model.moe.n_experts = 8"},
    {"pipeline_deeper_than_model", "parallel:\n  pipeline: 5\n", "parallel.pipeline", "2:13", "at most model.n_layers = 4"},
    {"recompute_layers_past_the_model", "train:\n  recompute_layers: [1, 4]\n", "train.recompute_layers", "2:21", "block indices below model.n_layers = 4, got 4"},
    {"recompute_layers_twice", "train:\n  recompute_layers: [1, 1]\n", "train.recompute_layers[1]", "2:21", "got '1' a second time"},
    // Only the last stage may hold no block (the head alone).
    {"stage_layers_empty_first", "parallel:\n  pipeline: 2\n  stage_layers: [0, 4]\n", "parallel.stage_layers[0]", "3:17", "got '0', expected an integer >= 1"},
    {"stage_layers_negative_last", "parallel:\n  pipeline: 2\n  stage_layers: [4, -1]\n", "parallel.stage_layers[1]", "3:17", "expected an integer >= 0"},
    // DualPipeV: two ranks at least, 2 x pipeline micro-batches and chunks, stage_layers per chunk.
    {"pipeline_schedule_unknown", "parallel:\n  pipeline_schedule: zbv\n", "parallel.pipeline_schedule", "2:22",
     "expected one of 1f1b, dualpipev, zb1p"},
    // Pairs of micro-batches: on one stage, with the exchanges posted.
    {"pairs_across_stages", "parallel:\n  pipeline: 2\n  pair_micro_batches: true\n", "parallel.pipeline", "2:13",
     "1 with parallel.pair_micro_batches"},
    {"pairs_exchanges_in_line", "parallel:\n  pair_micro_batches: true\nruntime:\n  overlap_expert_comm: false\n",
     "parallel.pair_micro_batches", "2:23", "false unless runtime.overlap_expert_comm is true"},
    {"dualpipev_one_stage", "parallel:\n  pipeline_schedule: dualpipev\n", "parallel.pipeline", "",
     "at least 2 with parallel.pipeline_schedule dualpipev"},
    {"dualpipev_few_micro_batches", "parallel:\n  pipeline: 2\n  pipeline_schedule: dualpipev\n", "parallel.micro_batches",
     "", "at least 2 x parallel.pipeline = 4 with parallel.pipeline_schedule dualpipev"},
    {"dualpipev_more_chunks_than_blocks", "parallel:\n  pipeline: 4\n  micro_batches: 8\n  pipeline_schedule: dualpipev\n",
     "parallel.pipeline", "2:13", "at most model.n_layers / 2 = 2 with parallel.pipeline_schedule dualpipev"},
    {"dualpipev_stage_layers_per_stage",
     "parallel:\n  pipeline: 2\n  micro_batches: 4\n  pipeline_schedule: dualpipev\n  stage_layers: [2, 2]\n",
     "parallel.stage_layers", "5:17", "one count per chunk with parallel.pipeline_schedule dualpipev: 2 x parallel.pipeline = 4 counts, got 2"},
    // The modules alone on the last stage: with modules, several stages, and a last stage of no block.
    {"mtp_own_stage_without_modules", "parallel:\n  pipeline: 2\n  stage_layers: [4, 0]\n  mtp_own_stage: true\n",
     "parallel.mtp_own_stage", "", "false without multi-token prediction (model.mtp_depth 0)"},
    {"mtp_own_stage_even_split", "model:\n  mtp_depth: 1\nparallel:\n  pipeline: 2\n  mtp_own_stage: true\n",
     "parallel.stage_layers", "", "balanced or a list ending in 0 with parallel.mtp_own_stage"},
    {"mtp_own_stage_last_stage_blocks",
     "model:\n  mtp_depth: 1\nparallel:\n  pipeline: 2\n  stage_layers: [3, 1]\n  mtp_own_stage: true\n",
     "parallel.stage_layers", "", "a list ending in 0 with parallel.mtp_own_stage"},
    {"recompute_delayed_pipeline", "train:\n  recompute: moe\nfp8:\n  recipe: delayed\nparallel:\n  pipeline: 2\n",
     "train.recompute", "2:14", "none with fp8.recipe delayed and parallel.pipeline > 1"},
    // selective rebuilds layers' inputs with the forward's delayed scale too
    {"selective_delayed_pipeline", "train:\n  recompute: selective\nfp8:\n  recipe: delayed\nparallel:\n  pipeline: 2\n",
     "train.recompute", "2:14", "none with fp8.recipe delayed and parallel.pipeline > 1"},
    {"tile_straddles_tp_shard", "model:\n  n_kv_heads: 4\nparallel:\n  tensor: 2\nfp8:\n  tile: 128\n", "fp8.tile", "6:9",
     "model.n_kv_heads x model.head_dim / parallel.tensor = 128 / 2 = 64"},
    // world size (this run has 1 rank)
    {"tensor_exceeds_world", "parallel:\n  tensor: 2\n", "parallel.tensor", "2:11", "a divisor of the world size 1"},
    {"pipeline_exceeds_world", "parallel:\n  pipeline: 2\n", "parallel.pipeline", "2:13", "dividing the world size 1"},
    {"expert_exceeds_data", "parallel:\n  expert: 2\n", "parallel.expert", "2:11", "a divisor of the data-parallel size 1"},
    {"global_batch_vs_micro_batches", "parallel:\n  micro_batches: 3\n", "train.global_batch", "", "a multiple of data-parallel size x parallel.micro_batches = 1 x 3 = 3"},
    // --set
    {"set_bad_type", "", "model.d_model", "", "--set model.d_model=abc: model.d_model: got 'abc'", {"model.d_model=abc"}},
    {"set_unknown_key", "", "model.d_modle", "", "--set model.d_modle=64: model.d_modle: unknown key; did you mean model.d_model?", {"model.d_modle=64"}},
    {"set_section", "", "model", "", "is a section", {"model=5"}},
    {"set_unknown_sections", "", "a.b.c.d", "", "unknown key; there is no section a; the sections are: model, parallel, train",
     {"a.b.c.d=1"}},
    {"set_unknown_subsection", "", "model.foo.bar", "", "there is no section model.foo; model has: vocab_size, d_model",
     {"model.foo.bar=1"}},
    {"set_without_equals", "", "--set model.d_model", "", "expected key.path=value", {"model.d_model"}},
    {"set_bad_yaml", "", "model.n_layers", "", "a YAML value", {"model.n_layers=[1"}},
    {"set_into_scalar_section", "model: 5\n", "model", "1:8", "expected a mapping of keys", {"model.d_model=64"}},
    {"set_breaks_rule_of_file", "model:\n  n_heads: 8\n", "model.n_kv_heads", "", "--set model.n_kv_heads=3", {"model.n_kv_heads=3"}},
    // several ranks: still one message, every rank exits 2
    {"np4_unknown_key", "model:\n  d_modle: 64\n", "model.d_modle", "2:3", "did you mean model.d_model?", {}, 4},
    {"np4_pipeline_vs_world", "parallel:\n  tensor: 2\n  pipeline: 4\n", "parallel.pipeline", "3:13", "parallel.tensor x parallel.pipeline = 2 x 4 dividing the world size 4", {}, 4},
    {"np4_expert_vs_data", "parallel:\n  tensor: 2\n  expert: 4\n", "parallel.expert", "3:11", "a divisor of the data-parallel size 2 = world 4 / (tensor 2 x pipeline 1)", {}, 4},
    {"np4_global_batch", "train:\n  global_batch: 6\n", "train.global_batch", "2:17", "a multiple of data-parallel size x parallel.micro_batches = 4 x 1 = 4", {}, 4},
    // runtime
    {"device_bad_choice", "runtime:\n  device: gpu\n", "runtime.device", "2:11", "one of auto, cpu, cuda"},
    {"nccl_on_cpu", "runtime:\n  device: cpu\n  comm: nccl\n", "runtime.comm", "", "NCCL needs the CUDA backend"},
    {"cuda_blockwise_tile", "runtime:\n  device: cuda\nfp8:\n  tile: 64\n", "fp8.tile", "",
     "128 with runtime.device cuda and fp8.recipe blockwise"},
    {"attention_bad_choice", "runtime:\n  attention: flash\n", "runtime.attention", "2:14", "one of auto, cudnn, reference"},
    {"cudnn_attention_on_cpu", "runtime:\n  device: cpu\n  attention: cudnn\n", "runtime.attention", "",
     "auto or reference unless runtime.device is cuda"},
    {"np2_tile_vs_shard", "model:\n  d_ff_dense: 640\nparallel:\n  tensor: 2\n", "fp8.tile", "", "model.d_ff_dense / parallel.tensor = 640 / 2 = 320", {}, 2},
};

// runtime.device cuda where no GPU is visible: exit 2 naming the key, on every rank (only where
// this machine has no GPU, of course).
TEST(Cli, CudaWithoutAGpuTrainsNotButDryRunsSayingSo) {
  const RunResult v = run({exe(), "--version"});
  if (v.out.find("GPUs:       none visible") == std::string::npos && v.out.find("CUDA:       not built") == std::string::npos)
    GTEST_SKIP() << "a GPU is visible here";
  TempDir tmp;
  const std::string file = tmp.write("case.yaml", "runtime:\n  device: cuda\n");
  for (int ranks : {1, 2}) {
    std::vector<std::string> argv;
    if (ranks > 1) argv = {mpiexec(), "-n", "2", "--oversubscribe"};
    argv.insert(argv.end(), {exe(), "train", file, "--set", "parallel.tensor=1", "--set", "parallel.pipeline=1", "--set",
                             "parallel.expert=1"});
    // Training refuses, before it reads any data.
    RunResult r = run(argv, 120);
    EXPECT_EQ(r.status, 2) << r.all();
    EXPECT_EQ(count(r.err, "fp8moe: error: "), 1u) << r.err;
    EXPECT_NE(r.err.find("runtime.device: cuda, but a rank sees no CUDA device"), std::string::npos) << r.err;
    // A dry run (a login node validating a config before sbatch) validates, builds the grid and
    // prints, with one line saying the device was not checked here.
    argv.push_back("--dry-run");
    r = run(argv, 120);
    EXPECT_EQ(r.status, 0) << r.all();
    EXPECT_EQ(count(r.out, "not checked here: a rank sees no CUDA device"), 1u) << r.out;
    EXPECT_NE(r.out.find("device: cuda, comm nccl"), std::string::npos) << r.out;
    EXPECT_NE(r.out.find("dry run: the config is valid and the process grid is built"), std::string::npos) << r.out;
  }
}

TEST(Cli, DryRunLaysOutAWorldFromOneProcess) {
  // DeepSeek-V3's 2,048-rank layout checked from one process, as before an sbatch.
  const std::string cfg = source_dir() + "/configs/deepseek-v3-671b.yaml";
  RunResult r = run({exe(), "train", cfg, "--dry-run", "--world", "2048"}, 60);
  EXPECT_EQ(r.status, 0) << r.all();
  EXPECT_NE(r.out.find("on 2048 ranks (--world: laid out from this process, not launched)"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("process grid: world 2048 = tensor 1 x pipeline 16 x data 128; data 128 = expert 64 x "
                       "expert-data 2"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("... (1984 more ranks)"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("dry run: the config is valid and the process grid is laid out"), std::string::npos) << r.out;
  // The world size is validated as for a launched run; --world needs --dry-run and one process.
  r = run({exe(), "train", cfg, "--dry-run", "--world", "2047"}, 60);
  EXPECT_EQ(r.status, 2) << r.all();
  EXPECT_NE(r.err.find("dividing the world size 2047"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("--world N lays it out"), std::string::npos) << r.err;  // --world was given
  // Without --world, one process is a world of 1; the message says how to lay out the real one.
  r = run({exe(), "train", cfg, "--dry-run"}, 60);
  EXPECT_EQ(r.status, 2) << r.all();
  EXPECT_NE(r.err.find("dividing the world size 1 (a dry run from one process lays the run out for 1 rank: "
                       "--world N lays it out for N)"), std::string::npos) << r.err;
  r = run({exe(), "train", cfg, "--world", "2048"}, 60);
  EXPECT_EQ(r.status, 2) << r.all();
  r = run({mpiexec(), "-n", "2", "--oversubscribe", exe(), "train", cfg, "--dry-run", "--world", "2048"}, 120);
  EXPECT_EQ(r.status, 2) << r.all();
  EXPECT_EQ(count(r.err, "fp8moe: error: --world lays a run out from one process"), 1u) << r.err;
}

class BadConfigTest : public testing::TestWithParam<BadConfig> {};

TEST_P(BadConfigTest, ExitsTwoWithOneMessageNamingTheKey) {
  const BadConfig& c = GetParam();
  TempDir tmp;
  const std::string file = tmp.write("case.yaml", c.yaml);
  std::vector<std::string> argv;
  if (c.ranks > 1) argv = {mpiexec(), "-n", std::to_string(c.ranks), "--oversubscribe"};
  argv.insert(argv.end(), {exe(), "train", file, "--dry-run"});
  for (const std::string& s : c.sets) argv.insert(argv.end(), {"--set", s});
  const RunResult r = run(argv, c.ranks > 1 ? 240 : 60);

  ASSERT_FALSE(r.timed_out) << r.all();
  EXPECT_EQ(r.status, 2) << r.all();
  EXPECT_EQ(count(r.err, "fp8moe: error: "), 1u) << r.err;  // one message, from rank 0 only
  EXPECT_EQ(r.out.find("effective config"), std::string::npos) << "ran after a bad config:\n" << r.out;
  EXPECT_EQ(r.err.find("fatal"), std::string::npos) << r.err;  // no abort, no stack trace
  const std::string key = c.key;
  EXPECT_NE(r.err.find(key.find(' ') == std::string::npos ? " " + key + ": " : key), std::string::npos)
      << "key " << key << " not named:\n" << r.err;
  if (*c.where) {
    const std::string at = file + ":" + c.where + ": " + key + ": ";
    EXPECT_NE(r.err.find(at), std::string::npos) << "expected '" << at << "' in:\n" << r.err;
  }
  if (*c.also) {
    EXPECT_NE(r.err.find(c.also), std::string::npos) << "expected '" << c.also << "' in:\n" << r.err;
  }
}

INSTANTIATE_TEST_SUITE_P(Configs, BadConfigTest, testing::ValuesIn(kBadConfigs),
                         [](const testing::TestParamInfo<BadConfig>& i) { return std::string(i.param.name); });

TEST(BadConfigTable, HasAtLeastFiftyCases) { EXPECT_GE(std::size(kBadConfigs), 50u); }

}  // namespace
}  // namespace fp8moe::test
