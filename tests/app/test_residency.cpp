// The training step keeps its tensors on the device (README "CUDA backend"): `fp8moe train` on the
// emulated device (kernels/host_backend.h: CPU kernels on memory the host cannot dereference, so a
// host access of a tensor outside the backend's ops crashes the run) against the same run on the
// cpu backend, for every recipe, the recompute modes (selective included), cached FP8 activations and the tp2, ep2 and
// pp2 layouts on 2 ranks. Checked per step, from the JSONL log:
//   - loss and gradient norm bitwise equal to the cpu run's (the same kernels in the same order);
//   - host_syncs at most (MoE layers x micro-batches + 1), with the device's own collectives
//     (runtime.comm nccl): one per MoE layer and micro-batch (the expert loads), one for the step;
//   - what crosses between host and device: to the device the step's tokens and targets and the
//     router-bias loads, back the loads, the losses, the FP8 counters and the gradient norm, and
//     nothing else (no weights, gradients or activations). (The relay across nodes, which these
//     one-node layouts do not use, also reads each row's token back in the same synchronisation
//     and uploads its gathers' row indices: parallel/expert_dispatch.h.)
// The same layouts with runtime.comm mpi (staged through host memory, a synchronisation per
// collective) must give the same bits too.
#include <gtest/gtest.h>

#include <cstdio>
#include <map>
#include <regex>
#include <sstream>
#include <fstream>
#include <ostream>

#include "tests/test_util.h"

namespace fp8moe::test {
namespace {

// The model: 3 blocks, 2 of them MoE (4 experts, top-2, a shared one), d_model 64.
constexpr int kMoeLayers = 2, kExperts = 4, kSeqLen = 32, kBatch = 8, kSteps = 4;

struct StepRecord {
  std::string loss, grad_norm;  // as written (round-trip digits): compared as text
  int64_t host_syncs = 0, h2d = 0, d2h = 0;
};

std::map<int, StepRecord> read_log(const std::string& path) {
  std::map<int, StepRecord> m;
  static const std::regex re(
      R"re("step":(\d+),"loss":([^,]+),.*"grad_norm":([^,]+),.*"host_syncs":(\d+),"h2d_bytes":(\d+),"d2h_bytes":(\d+)[,}])re");
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) {
    std::smatch s;
    if (std::regex_search(line, s, re))
      m[std::stoi(s[1])] = {s[2], s[3], std::stoll(s[4]), std::stoll(s[5]), std::stoll(s[6])};
  }
  return m;
}

struct Case {
  const char* name;
  int ranks;
  std::vector<std::string> sets;
  int micro_batches;
  bool staged = false;  // runtime.comm mpi: bits only, the synchronisations are the staging's
  bool pipeline = false;
  int mtp = 0;  // multi-token prediction modules (each one more MoE block, its tokens and targets, a loss)
};
// Multi-head latent attention on the test model's 4 heads: latents of 32, heads of 16 + 8 rotary
// query/key channels and 16 value channels.
const char* const kMla[] = {"model.attention=mla",        "model.q_lora_rank=32",      "model.kv_lora_rank=32",
                            "model.qk_nope_head_dim=16", "model.qk_rope_head_dim=8", "model.v_head_dim=16"};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }  // ctest's name of the case: "... # GetParam() = off"

class Residency : public testing::TestWithParam<Case> {
 protected:
  static void SetUpTestSuite() {
    dir_ = new TempDir;
    std::vector<std::string> prep = {exe(), "prepare-data", "--output", dir_->path + "/data/lic", "--val-fraction",
                                     "0.2", "--seed", "3", "--input"};
    for (const char* f : {"GPL-3", "GPL-2", "Apache-2.0"}) prep.push_back(std::string("/usr/share/common-licenses/") + f);
    ASSERT_EQ(run(prep).status, 0);
  }
  static void TearDownTestSuite() { delete dir_; }
  // Trains the case on `device`; returns its log's records.
  static std::map<int, StepRecord> train(const Case& c, const std::string& device) {
    const std::string tag = std::string(c.name) + "-" + device;
    const std::string log = dir_->path + "/" + tag + ".jsonl";
    const std::string cfg = dir_->write(
        tag + ".yaml",
        "model: {d_model: 64, n_layers: 3, n_heads: 4, n_kv_heads: 2, head_dim: 16, first_dense_layers: 1,\n"
        "        d_ff_dense: 128, moe: {n_experts: 4, top_k: 2, n_shared_experts: 1, d_expert: 32,\n"
        "                               aux_loss_coef: 0.01, capacity_factor: 1.5}}\n"
        "train: {steps: 4, warmup_steps: 1, global_batch: 8, seq_len: 32, lr: 3.0e-3, min_lr: 3.0e-4}\n"
        "fp8: {tile: 16, amax_history_len: 4}\n"
        "eval: {every: 0}\n"
        "log: {every: 1, jsonl: " + log + "}\n"
        "data: {path: " + dir_->path + "/data/lic.train}\n"
        "checkpoint: {dir: " + dir_->path + "/ckpt-" + tag + ", resume: none}\n"
        "runtime: {device: " + device + (c.staged ? ", comm: mpi" : "") + "}\n");
    std::vector<std::string> argv = {mpiexec(), "-n", std::to_string(c.ranks), exe(), "train", cfg,
                                     "--set", "parallel.micro_batches=" + std::to_string(c.micro_batches)};
    for (const auto& s : c.sets) argv.push_back("--set"), argv.push_back(s);
    const RunResult r = run(argv, 600);
    EXPECT_EQ(r.status, 0) << device << ":\n" << r.all();
    return read_log(log);
  }
  static TempDir* dir_;
};
TempDir* Residency::dir_ = nullptr;

TEST_P(Residency, EmulatedDeviceTrainsBitwiseAsTheCpuWithBoundedHostTraffic) {
  const Case& c = GetParam();
  const auto cpu = train(c, "cpu"), dev = train(c, "emulated");
  ASSERT_EQ(cpu.size(), size_t(kSteps));
  ASSERT_EQ(dev.size(), size_t(kSteps));
  const int M = c.micro_batches;
  const int64_t moe_layers = kMoeLayers + c.mtp;
  const int64_t sync_bound = moe_layers * M + 1;
  // Bytes each way per step on one rank, at most (the JSONL has the maxima over the ranks): the
  // step's tokens and targets (one replica's share, int32), and per MoE layer the step's loads for
  // the bias update (int64 per expert); back: per MoE layer and micro-batch the loads, per
  // micro-batch its CE and aux-loss slots, the two FP8 counters and the norm part (8 bytes each).
  const int tp = [&] {
    for (const auto& s : c.sets)
      if (s == "parallel.tensor=2") return 2;
    return 1;
  }();
  const int pp = c.pipeline ? 2 : 1, replicas = c.ranks / tp / pp;
  const int64_t tokens = int64_t(kBatch) / replicas * kSeqLen;
  const int64_t h2d_bound = 2 * (1 + c.mtp) * tokens * 4 + moe_layers * kExperts * 8;
  const int64_t d2h_bound = moe_layers * M * kExperts * 8 + int64_t(M) * (1 + moe_layers + c.mtp) * 8 + 3 * 8;
  for (const auto& [step, want] : cpu) {
    const StepRecord& got = dev.at(step);
    EXPECT_EQ(got.loss, want.loss) << c.name << " step " << step;
    EXPECT_EQ(got.grad_norm, want.grad_norm) << c.name << " step " << step;
    std::printf("[ MEASURE  ] %s step %d: host_syncs %lld (bound %lld), h2d %lld B (bound %lld), d2h %lld B (bound %lld)\n",
                c.name, step, (long long)got.host_syncs, (long long)sync_bound, (long long)got.h2d,
                (long long)h2d_bound, (long long)got.d2h, (long long)d2h_bound);
    if (c.staged) continue;
    EXPECT_LE(got.host_syncs, sync_bound) << c.name << " step " << step;
    // Step 1 also uploads the delayed-scaling states' first values (their histories start empty).
    if (step > 1) {
      EXPECT_LE(got.h2d, h2d_bound) << c.name << " step " << step;
    }
    EXPECT_LE(got.d2h, d2h_bound) << c.name << " step " << step;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Step, Residency,
    testing::Values(Case{"off", 1, {"fp8.recipe=off"}, 2}, Case{"delayed", 1, {"fp8.recipe=delayed"}, 2},
                    Case{"current", 1, {"fp8.recipe=current", "fp8.format=hybrid"}, 2},
                    Case{"blockwise", 1, {"fp8.recipe=blockwise"}, 2},
                    Case{"blockwise_cached", 1, {"fp8.recipe=blockwise", "fp8.cache_activations=true"}, 1},
                    Case{"recompute_moe_delayed", 1, {"fp8.recipe=delayed", "train.recompute=moe"}, 2},
                    Case{"recompute_full_blockwise", 1, {"fp8.recipe=blockwise", "train.recompute=full"}, 2},
                    Case{"tp2", 2, {"parallel.tensor=2", "fp8.recipe=blockwise"}, 2},
                    Case{"ep2", 2, {"parallel.expert=2", "fp8.recipe=current"}, 2},
                    Case{"pp2", 2, {"parallel.pipeline=2", "fp8.recipe=blockwise"}, 2, false, true},
                    Case{"tp2_staged", 2, {"parallel.tensor=2", "fp8.recipe=delayed"}, 1, true},
                    Case{"ep2_staged", 2, {"parallel.expert=2", "fp8.recipe=blockwise"}, 1, true},
                    Case{"pp2_staged", 2, {"parallel.pipeline=2", "fp8.recipe=current"}, 2, true, true},
                    // DeepSeek-V3's latent attention and one multi-token prediction module: on one
                    // rank (its blocks recomputed), with the heads split, and across two stages (the
                    // module's embeddings sent from the first stage to the last and back).
                    Case{"mla_mtp", 1, {kMla[0], kMla[1], kMla[2], kMla[3], kMla[4], kMla[5], "model.mtp_depth=1",
                                        "fp8.recipe=blockwise", "train.recompute=full"}, 2, false, false, 1},
                    Case{"mla_mtp_tp2", 2, {kMla[0], kMla[1], kMla[2], kMla[3], kMla[4], kMla[5], "model.mtp_depth=1",
                                            "fp8.recipe=blockwise", "parallel.tensor=2"}, 2, false, false, 1},
                    Case{"mla_mtp_pp2", 2, {kMla[0], kMla[1], kMla[2], kMla[3], kMla[4], kMla[5], "model.mtp_depth=1",
                                            "fp8.recipe=current", "parallel.pipeline=2"}, 2, false, true, 1},
                    // train.activations bf16: FP8 rows and their scales dispatched on the device
                    // (blockwise), BF16 rows (recipe off, recomputed), BF16 pipeline messages with
                    // the module's embeddings and the kept BF16 activations of MLA; with the
                    // gradients' reduction in BF16 (optim.grad_reduce) on ep2's two replicas.
                    Case{"bf16_ep2", 2, {"parallel.expert=2", "fp8.recipe=blockwise", "train.activations=bf16",
                                         "optim.grad_reduce=bf16"}, 2},
                    Case{"bf16_off_recompute", 1, {"fp8.recipe=off", "train.recompute=full", "train.activations=bf16"}, 2},
                    // The per-tensor recipes' FP8 rows (one scale per exchange, its amax reduced
                    // over the expert group on the device), E5M2 gradients under hybrid; a
                    // recomputation reusing the forward's scale.
                    Case{"bf16_current_hybrid_ep2", 2, {"parallel.expert=2", "fp8.recipe=current", "fp8.format=hybrid",
                                                        "train.activations=bf16"}, 2},
                    Case{"bf16_delayed_recompute_ep2", 2, {"parallel.expert=2", "fp8.recipe=delayed",
                                                           "train.recompute=full", "train.activations=bf16"}, 2},
                    Case{"bf16_mla_mtp_pp2", 2, {kMla[0], kMla[1], kMla[2], kMla[3], kMla[4], kMla[5], "model.mtp_depth=1",
                                                 "fp8.recipe=blockwise", "parallel.pipeline=2", "train.activations=bf16"},
                         2, false, true, 1},
                    // train.recompute selective: MLA's queries, keys and values, the router's input
                    // and the SwiGLU outputs made again in backward on the device, the heads split
                    // (current scaling: the rebuilt inputs' amax reduced over the tensor group); and
                    // train.hp_gemm bf16: the router, the vocabulary-parallel head and eh_proj as
                    // BF16 GEMMs.
                    Case{"selective_mla_mtp_tp2", 2, {kMla[0], kMla[1], kMla[2], kMla[3], kMla[4], kMla[5],
                                                      "model.mtp_depth=1", "fp8.recipe=current", "parallel.tensor=2",
                                                      "train.activations=bf16", "train.recompute=selective",
                                                      "train.hp_gemm=bf16"},
                         2, false, false, 1},
                    // train.moe_gates expert: the rows' gates dispatched and the gates' FP64
                    // gradients combined back on the device, the gated SwiGLU (made again in
                    // selective's backward; a recomputed block keeps its rows' gates), also through
                    // the staged MPI transport.
                    Case{"gates_in_experts_ep2", 2, {"parallel.expert=2", "fp8.recipe=blockwise", "train.activations=bf16",
                                                     "train.recompute=selective", "fp8.cache_activations=true",
                                                     "train.moe_gates=expert"}, 2},
                    Case{"gates_in_experts_tp2_full", 2, {"parallel.tensor=2", "fp8.recipe=delayed", "train.recompute=full",
                                                          "train.moe_gates=expert"}, 2},
                    Case{"gates_in_experts_ep2_staged", 2, {"parallel.expert=2", "fp8.recipe=off", "train.moe_gates=expert"},
                         1, true}),
    [](const testing::TestParamInfo<Case>& i) { return std::string(i.param.name); });

}  // namespace
}  // namespace fp8moe::test
