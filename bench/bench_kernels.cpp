// CPU kernel throughput (Google Benchmark). Prints GB/s of memory traffic per op.
#include <benchmark/benchmark.h>

#include <random>
#include <vector>

#include "kernels/swiglu.h"

namespace {

std::vector<float> random_vector(size_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, 2.0f);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

void BM_SwigluForward(benchmark::State& state) {
  const int64_t n = state.range(0);
  const auto a = random_vector(n, 1), b = random_vector(n, 2);
  std::vector<float> y(n);
  for (auto _ : state) {
    fp8moe::cpu::swiglu_forward(a.data(), b.data(), n, y.data(), 1, n);
    benchmark::DoNotOptimize(y.data());
  }
  state.SetBytesProcessed(state.iterations() * n * 3 * int64_t(sizeof(float)));  // 2 reads + 1 write
}

void BM_SwigluBackward(benchmark::State& state) {
  const int64_t n = state.range(0);
  const auto a = random_vector(n, 1), b = random_vector(n, 2), dy = random_vector(n, 3);
  std::vector<float> da(n), db(n);
  for (auto _ : state) {
    fp8moe::cpu::swiglu_backward(a.data(), b.data(), n, dy.data(), da.data(), db.data(), 1, n);
    benchmark::DoNotOptimize(da.data());
  }
  state.SetBytesProcessed(state.iterations() * n * 5 * int64_t(sizeof(float)));  // 3 reads + 2 writes
}

// One MoE layer's worth of expert activations of tiny.yaml (8 x 256 tokens x 256 wide) and a 16M slab.
BENCHMARK(BM_SwigluForward)->Arg(8 * 256 * 256)->Arg(1 << 24)->UseRealTime();
BENCHMARK(BM_SwigluBackward)->Arg(8 * 256 * 256)->Arg(1 << 24)->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
