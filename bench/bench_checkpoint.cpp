// Checkpoint save and load throughput beside `dd` on the same disk, in the same run.
//
//   mpirun -np R build/bench/bench_checkpoint [DIR] [REPS] [STAGING_BYTES] [SHAPE]
//
// SHAPE `moe` (the default): a model of ~96M parameters (d_model 1024, 12 routed experts of width
// 2048): FP32 masters and FP32 Adam moments make a checkpoint of ~1.15 GB. SHAPE `v3`:
// configs/deepseek-v3-671b.yaml's shape at tiny dimensions (the same 61 blocks of which 58 MoE,
// 256 routed experts, MLA and one MTP module; d_model 64, experts of width 16): 48M parameters,
// ~0.6 GB, and as many tensors as the 671B model, so that the per-dataset costs show; each rank
// writes what it would under expert parallelism over the R ranks (whole experts, E / R of each
// layer; the other tensors' rows split evenly, as ZeRO-1's). Each repetition: save (the whole commit
// protocol, fsync included), `dd if=/dev/zero of=... bs=64M conv=fsync` of the same size, load
// (open, read, checksums), `dd of=/dev/null` of dd's file. Both reads come from the page cache
// when it holds the file (the machine's memory decides; both are treated alike). Prints GB/s for
// each and the ratios checkpoint / dd, best of REPS. Then the same state saved asynchronously
// (AsyncCheckpointer): the time the caller is blocked per save (the copy to host memory) beside the
// synchronous save's, medians of REPS. The tensors go through the checkpoint code's
// staging buffer (io/checkpoint.h: checkpoint.staging_bytes, 64 MiB per rank; STAGING_BYTES sets
// another).
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "io/checkpoint.h"
#include "kernels/backend.h"
#include "parallel/mpi_session.h"

using namespace fp8moe;
namespace fs = std::filesystem;

namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

double timed_system(const std::string& cmd) {
  const auto t0 = std::chrono::steady_clock::now();
  if (std::system(cmd.c_str()) != 0) {
    std::fprintf(stderr, "bench_checkpoint: failed: %s\n", cmd.c_str());
    std::exit(1);
  }
  return seconds_since(t0);
}

// ~96M parameters, a few large tensors.
Config moe_96m() {
  Config cfg;
  cfg.model.vocab_size = 256;
  cfg.model.d_model = 1024;
  cfg.model.n_layers = 2;
  cfg.model.first_dense_layers = 1;
  cfg.model.n_heads = 8;
  cfg.model.n_kv_heads = 8;
  cfg.model.head_dim = 128;
  cfg.model.d_ff_dense = 4096;
  cfg.model.moe.n_experts = 12;
  cfg.model.moe.d_expert = 2048;
  return cfg;
}

// configs/deepseek-v3-671b.yaml's blocks, experts, attention and MTP, at tiny widths.
Config deepseek_v3_tiny() {
  Config cfg;
  ModelConfig& m = cfg.model;
  m.vocab_size = 256;
  m.d_model = 64;
  m.n_layers = 61;
  m.first_dense_layers = 3;
  m.n_heads = 2;
  m.attention = AttentionKind::mla;
  m.q_lora_rank = 32;
  m.kv_lora_rank = 16;
  m.qk_nope_head_dim = 16;
  m.qk_rope_head_dim = 8;
  m.v_head_dim = 16;
  m.d_ff_dense = 128;
  m.mtp_depth = 1;
  m.moe.n_experts = 256;
  m.moe.top_k = 8;
  m.moe.n_shared_experts = 1;
  m.moe.d_expert = 16;
  return cfg;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

}  // namespace

int main(int argc, char** argv) {
  MpiSession mpi(&argc, &argv);
  const std::string root_dir = argc > 1 ? argv[1] : "build/bench-ckpt";
  const int reps = argc > 2 ? std::atoi(argv[2]) : 3;
  const bool root = mpi.rank() == 0;

  const std::string shape = argc > 4 ? argv[4] : "moe";
  if (shape != "moe" && shape != "v3") {
    if (root) std::fprintf(stderr, "bench_checkpoint: SHAPE must be moe or v3, not %s\n", shape.c_str());
    return 2;
  }
  Config cfg = shape == "v3" ? deepseek_v3_tiny() : moe_96m();
  cfg.fp8.recipe = Fp8Recipe::off;
  cfg.checkpoint.dir = root_dir + "/ckpt";
  cfg.checkpoint.keep_last = 2;  // the synchronous save of a repetition beside its asynchronous one
  cfg.checkpoint.resume = cfg.checkpoint.dir;
  if (argc > 3) cfg.checkpoint.staging_bytes = std::atoll(argv[3]);
  if (cfg.checkpoint.staging_bytes < 8) {  // as the config's validation (io/config_schema.cpp)
    if (root) std::fprintf(stderr, "bench_checkpoint: STAGING_BYTES must be at least 8\n");
    return 2;
  }

  const std::unique_ptr<Backend> be = make_backend(DeviceKind::cpu);
  Transformer model(*be, cfg);
  AdamW opt(*be, model.table(), cfg.train);
  LossScaler scaler(cfg.train);
  TrainProgress progress;
  for (size_t i = 0; i < model.table().params.size(); ++i) {  // realistic, non-zero moments
    const std::vector<float> p = model.store().param_to_host(i);
    for (int w = 0; w < 2; ++w) {
      std::vector<float> m(size_t(opt.moment(w, i).numel()));
      for (size_t j = 0; j < m.size(); ++j) m[j] = p[j] * (w == 0 ? 0.1f : 1e-4f);
      to_device(*be, m, opt.moment(w, i).f32());
    }
  }
  TrainerState state{&cfg, &model, &opt, &scaler, &progress, "bench", {}, {}};
  if (shape == "v3") {  // expert parallelism's writers: rank r the whole of experts [r E / R, (r + 1) E / R)
    const int64_t e = cfg.model.moe.n_experts;
    for (const ParamSpec& p : model.table().params) {
      const bool mine = p.expert < 0 || p.expert * mpi.size() / e == mpi.rank();
      const RowRange rows = p.expert < 0 ? replica_rows(p.rows, mpi.rank(), mpi.size()) : mine ? RowRange{0, p.rows} : RowRange{0, 0};
      state.write_rows.push_back(rows), state.moment_write_rows.push_back(rows);
    }
  }
  if (root) fs::create_directories(root_dir);
  MPI_Barrier(MPI_COMM_WORLD);

  double best_save = 1e30, best_load = 1e30, best_ddw = 1e30, best_ddr = 1e30;
  double bytes = 0;
  std::string dir_of_last;
  std::vector<double> sync_s, blocked_s, written_s;
  AsyncCheckpointer async(MPI_COMM_WORLD, *be);
  for (int rep = 0; rep < reps; ++rep) {
    progress.step = 2 * rep + 1;
    MPI_Barrier(MPI_COMM_WORLD);
    auto t0 = std::chrono::steady_clock::now();
    const std::string dir = save_checkpoint(MPI_COMM_WORLD, state);
    MPI_Barrier(MPI_COMM_WORLD);
    sync_s.push_back(seconds_since(t0));
    best_save = std::min(best_save, sync_s.back());
    // The same state saved asynchronously: the time the caller is blocked (the copy to host
    // memory), and the time until the writer committed it (nothing else runs meanwhile here).
    progress.step = 2 * rep + 2;
    MPI_Barrier(MPI_COMM_WORLD);
    t0 = std::chrono::steady_clock::now();
    async.start(MPI_COMM_WORLD, state);
    double blocked = seconds_since(t0);
    async.wait();
    double written = seconds_since(t0);
    MPI_Allreduce(MPI_IN_PLACE, &blocked, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    MPI_Allreduce(MPI_IN_PLACE, &written, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    blocked_s.push_back(blocked), written_s.push_back(written);
    bytes = double(fs::file_size(dir + "/" + kCheckpointFile));
    dir_of_last = dir;
    const long blocks = long(bytes / double(64 << 20)) + 1;
    if (root)
      best_ddw = std::min(best_ddw, timed_system("dd if=/dev/zero of=" + root_dir + "/dd.bin bs=64M count=" +
                                                 std::to_string(blocks) + " conv=fsync status=none"));
    MPI_Barrier(MPI_COMM_WORLD);
    t0 = std::chrono::steady_clock::now();
    resume_from_checkpoint(MPI_COMM_WORLD, state);
    MPI_Barrier(MPI_COMM_WORLD);
    best_load = std::min(best_load, seconds_since(t0));
    if (root) best_ddr = std::min(best_ddr, timed_system("dd if=" + root_dir + "/dd.bin of=/dev/null bs=64M status=none"));
    MPI_Barrier(MPI_COMM_WORLD);
  }
  if (root) {
    const double dd_bytes = double(fs::file_size(root_dir + "/dd.bin"));
    const double gs = bytes / best_save / 1e9, gl = bytes / best_load / 1e9;
    const double dw = dd_bytes / best_ddw / 1e9, dr = dd_bytes / best_ddr / 1e9;
    std::printf("checkpoint of %lld parameters: %.2f GB (FP32 masters + FP32 Adam moments), %d rank(s), best of %d\n",
                (long long)model.table().trainable_numel(), bytes / 1e9, mpi.size(), reps);
    std::printf("  shape %s: %zu datasets\n", shape.c_str(), inspect_checkpoint(dir_of_last, false).datasets.size());
    std::printf("  staged through %lld bytes of host memory per rank\n", (long long)cfg.checkpoint.staging_bytes);
    std::printf("  %-34s %8s %8s\n", "", "GB/s", "vs dd");
    std::printf("  %-34s %8.2f %8.2f\n", "save (commit protocol, fsync)", gs, gs / dw);
    std::printf("  %-34s %8.2f\n", "dd write (conv=fsync)", dw);
    std::printf("  %-34s %8.2f %8.2f\n", "load (read + every checksum)", gl, gl / dr);
    std::printf("  %-34s %8.2f\n", "dd read", dr);
    const double sync_med = median(sync_s), blocked_med = median(blocked_s);
    std::printf("  asynchronous save (checkpoint.async), median of %d: blocked %.3f s per save, %.1f%% of the "
                "synchronous save's %.3f s (the first, which allocates the host copy: %.3f s); committed after %.3f s\n",
                reps, blocked_med, 100.0 * blocked_med / sync_med, sync_med, blocked_s.front(), median(written_s));
    fs::remove_all(root_dir);
  }
  return 0;
}
