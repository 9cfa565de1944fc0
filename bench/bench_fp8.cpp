// FP8 on the CPU (Google Benchmark): quantize throughput per recipe, and the emulated FP8 GEMM of
// each path beside oneDNN's SGEMM on the same shapes in the same run. After the runs a table
// prints each FP8 path's GFLOPS as a ratio to SGEMM's.
//   build/bench/bench_fp8 [--benchmark_filter=Gemm] [--benchmark_min_time=0.5]
#include <benchmark/benchmark.h>

#include <cstdio>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "kernels/gemm_fp8.h"

namespace {

using namespace fp8moe;

std::vector<float> normal(int64_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = d(rng);
  return v;
}

// ---- quantize -----------------------------------------------------------------------------------

enum Recipe { kCurrent, kDelayed, kRows1x128, kCols128x1, kBlocks128 };
const char* kRecipeNames[] = {"current_per_tensor", "delayed_per_tensor", "blockwise_1x128", "blockwise_128x1",
                              "blockwise_128x128"};

void BM_Quantize(benchmark::State& state) {
  const auto recipe = static_cast<Recipe>(state.range(0));
  const int64_t rows = 4096, cols = 4096;
  const std::vector<float> x = normal(rows * cols, 1);
  QuantTensor q;
  DelayedScaling delayed = make_delayed_scaling(16);
  for (auto _ : state) {
    switch (recipe) {
      case kCurrent: quantize_current(x.data(), rows, cols, Fp8Dtype::e4m3, {}, {}, &q); break;
      case kDelayed:
        quantize_delayed(x.data(), rows, cols, Fp8Dtype::e4m3, delayed, DelayedScaling::Compute::max, {}, {}, &q);
        break;
      case kRows1x128: quantize_tiled(x.data(), rows, cols, Tiling::rows_1xT, 128, Fp8Dtype::e4m3, {}, &q); break;
      case kCols128x1: quantize_tiled(x.data(), rows, cols, Tiling::cols_Tx1, 128, Fp8Dtype::e4m3, {}, &q); break;
      case kBlocks128: quantize_tiled(x.data(), rows, cols, Tiling::blocks_TxT, 128, Fp8Dtype::e4m3, {}, &q); break;
    }
    benchmark::DoNotOptimize(q.data.data());
  }
  // Bytes moved: FP32 in, FP8 out (scales are negligible).
  state.SetBytesProcessed(state.iterations() * rows * cols * 5);
  state.SetLabel(kRecipeNames[recipe]);
}
BENCHMARK(BM_Quantize)->DenseRange(kCurrent, kBlocks128)->Unit(benchmark::kMillisecond)->UseRealTime();

// ---- GEMM ---------------------------------------------------------------------------------------

// The forward GEMM of a linear layer: y (M,N) = x (M,K) . W^T, W (N,K).
struct GemmInputs {
  int64_t M, N, K;
  std::vector<float> x, w, y;
  QuantTensor qx, qw;
  GemmInputs(int64_t M, int64_t N, int64_t K) : M(M), N(N), K(K), x(normal(M * K, 2)), w(normal(N * K, 3)), y(M * N) {
    quantize_tiled(x.data(), M, K, Tiling::rows_1xT, 128, Fp8Dtype::e4m3, {}, &qx);
    quantize_tiled(w.data(), N, K, Tiling::blocks_TxT, 128, Fp8Dtype::e4m3, {}, &qw);
  }
};

void set_flops(benchmark::State& state, const GemmInputs& in) {
  state.counters["GFLOPS"] =
      benchmark::Counter(2.0 * double(in.M) * double(in.N) * double(in.K) * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

void BM_Sgemm(benchmark::State& state) {
  GemmInputs in(state.range(0), state.range(1), state.range(2));
  for (auto _ : state) {
    sgemm(false, true, in.M, in.N, in.K, 1.0f, in.x.data(), in.K, in.w.data(), in.K, 0.0f, in.y.data(), in.N);
    benchmark::DoNotOptimize(in.y.data());
  }
  set_flops(state, in);
  state.SetLabel("oneDNN sgemm");
}

void BM_Fp8Gemm(benchmark::State& state) {
  GemmInputs in(state.range(0), state.range(1), state.range(2));
  const auto path = static_cast<GemmPath>(state.range(3));
  GemmInfo info;
  for (auto _ : state) {
    gemm_fp8(in.qx, false, in.qw, true, 1.0f, 0.0f, in.y.data(), in.N, path, &info);
    benchmark::DoNotOptimize(in.y.data());
  }
  set_flops(state, in);
  std::string label = to_string(path);
  label.append(": ").append(info.impl);
  state.SetLabel(label);
}

// (M, N, K): a square GEMM, and the skinny shapes of small MoE layers.
const std::vector<std::vector<int64_t>> kShapes = {{2048, 2048, 2048}, {4096, 256, 256}, {256, 4096, 256}};

void register_gemms() {
  for (const auto& s : kShapes) {
    benchmark::RegisterBenchmark("BM_Sgemm", BM_Sgemm)->Args({s[0], s[1], s[2]})->UseRealTime()->Unit(benchmark::kMillisecond);
    for (GemmPath p : {GemmPath::dequant_bf16, GemmPath::dequant_fp32, GemmPath::block_scaled})
      benchmark::RegisterBenchmark("BM_Fp8Gemm", BM_Fp8Gemm)
          ->Args({s[0], s[1], s[2], int64_t(p)})
          ->UseRealTime()
          ->Unit(benchmark::kMillisecond);
  }
}

// Prints the usual table, then GFLOPS of each FP8 path as a ratio to SGEMM at the same shape.
class RatioReporter : public benchmark::ConsoleReporter {
 public:
  void ReportRuns(const std::vector<Run>& runs) override {
    ConsoleReporter::ReportRuns(runs);
    for (const Run& r : runs) {
      auto it = r.counters.find("GFLOPS");
      if (it == r.counters.end() || r.run_type != Run::RT_Iteration) continue;
      results_.push_back({r.benchmark_name(), r.report_label, double(it->second)});
    }
  }
  void Finalize() override {
    ConsoleReporter::Finalize();
    if (results_.empty()) return;
    std::printf("\nFP8 GEMM (emulated, blockwise 1x128 x 128x128, power-of-two scales) vs oneDNN SGEMM, CPU ISA %s:\n",
                cpu_isa_name().c_str());
    std::printf("%-22s %-58s %9s %7s\n", "M,N,K", "path", "GFLOPS", "ratio");
    std::map<std::string, double> sgemm;  // shape -> SGEMM GFLOPS
    for (const auto& r : results_)
      if (r.name.rfind("BM_Sgemm/", 0) == 0) sgemm[shape_of(r.name, 3)] = r.gflops;
    for (const auto& r : results_) {
      const std::string shape = shape_of(r.name, 3);
      const double base = sgemm.count(shape) ? sgemm[shape] : 0.0;
      std::printf("%-22s %-58.58s %9.1f %6.2fx\n", shape.c_str(), r.label.c_str(), r.gflops, base > 0 ? r.gflops / base : 0.0);
    }
  }

 private:
  struct Result {
    std::string name, label;
    double gflops;
  };
  // "BM_Fp8Gemm/2048/2048/2048/1/real_time" -> "2048,2048,2048"
  static std::string shape_of(const std::string& name, int fields) {
    std::string out;
    size_t pos = name.find('/');
    for (int i = 0; i < fields && pos != std::string::npos; ++i) {
      const size_t next = name.find('/', pos + 1);
      if (i) out += ',';
      out.append(name, pos + 1, next - pos - 1);
      pos = next;
    }
    return out;
  }
  std::vector<Result> results_;
};

}  // namespace

int main(int argc, char** argv) {
  register_gemms();
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  RatioReporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  benchmark::Shutdown();
  return 0;
}
