// CPU kernel throughput (Google Benchmark): the element and row ops of one step of tiny.yaml on one
// rank (8 sequences x 256 tokens, d_model 256, 8 heads of 32, vocabulary 256, 8 experts), each with
// the rate that matters for it: GB/s of memory traffic for the elementwise ops, elements (scores,
// logits) per second for the softmax ops.
#include <benchmark/benchmark.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "kernels/adamw.h"
#include "kernels/attention.h"
#include "kernels/cpu/vmath.h"
#include "kernels/cross_entropy.h"
#include "kernels/rmsnorm.h"
#include "kernels/rope.h"
#include "kernels/router.h"
#include "kernels/swiglu.h"

namespace {

std::vector<float> random_vector(size_t n, unsigned seed, float stddev = 2.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, stddev);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

constexpr int64_t kTokens = 8 * 256, kModel = 256;

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

// One layer's attention: B 8, T 256, 8 heads of 32 (items: the causal scores, T (T + 1) / 2 per head).
constexpr int64_t kB = 8, kT = 256, kH = 8, kHd = 32;
int64_t causal_scores() { return kB * kH * kT * (kT + 1) / 2; }

void BM_AttentionForward(benchmark::State& state) {
  const int64_t n = kB * kT * kH * kHd;
  const auto q = random_vector(n, 4), k = random_vector(n, 5), v = random_vector(n, 6);
  std::vector<float> out(n), lse(size_t(kB * kH * kT));
  for (auto _ : state) {
    fp8moe::cpu::attention_forward(q.data(), k.data(), v.data(), kB, kT, kH, kH, kHd, kHd, out.data(), lse.data());
    benchmark::DoNotOptimize(out.data());
  }
  state.SetItemsProcessed(state.iterations() * causal_scores());
}

void BM_AttentionBackward(benchmark::State& state) {
  const int64_t n = kB * kT * kH * kHd;
  const auto q = random_vector(n, 4), k = random_vector(n, 5), v = random_vector(n, 6), dout = random_vector(n, 7);
  std::vector<float> out(n), lse(size_t(kB * kH * kT)), dq(n), dk(n), dv(n);
  fp8moe::cpu::attention_forward(q.data(), k.data(), v.data(), kB, kT, kH, kH, kHd, kHd, out.data(), lse.data());
  for (auto _ : state) {
    fp8moe::cpu::attention_backward(q.data(), k.data(), v.data(), out.data(), lse.data(), dout.data(), kB, kT, kH, kH,
                                    kHd, kHd, dq.data(), dk.data(), dv.data());
    benchmark::DoNotOptimize(dq.data());
  }
  state.SetItemsProcessed(state.iterations() * causal_scores());
}

// The head's loss and gradient (items: logits), whole vocabulary and the vocabulary-parallel steps.
void BM_CrossEntropy(benchmark::State& state) {
  const int64_t V = state.range(0);
  const auto logits = random_vector(size_t(kTokens * V), 8, 3.0f);
  std::vector<int32_t> t(static_cast<size_t>(kTokens));
  for (int64_t n = 0; n < kTokens; ++n) t[size_t(n)] = int32_t((n * 7919) % V);
  std::vector<float> dl(logits.size());
  int64_t count = 0;
  for (auto _ : state) {
    const double loss = fp8moe::cpu::cross_entropy(logits.data(), t.data(), kTokens, V, -1, 0.5f, dl.data(), &count);
    benchmark::DoNotOptimize(loss);
    benchmark::DoNotOptimize(dl.data());
  }
  state.SetItemsProcessed(state.iterations() * kTokens * V);
}

void BM_CrossEntropyVocabParallel(benchmark::State& state) {
  const int64_t V = state.range(0);
  const auto logits = random_vector(size_t(kTokens * V), 8, 3.0f);
  std::vector<int32_t> t(static_cast<size_t>(kTokens));
  for (int64_t n = 0; n < kTokens; ++n) t[size_t(n)] = int32_t((n * 7919) % V);
  std::vector<float> dl(logits.size()), mx(static_cast<size_t>(kTokens));
  std::vector<double> se(static_cast<size_t>(kTokens)), tl(static_cast<size_t>(kTokens));
  for (auto _ : state) {
    fp8moe::cpu::ce_row_max(logits.data(), kTokens, V, mx.data());
    fp8moe::cpu::ce_partials(logits.data(), t.data(), kTokens, V, 0, -1, mx.data(), se.data(), tl.data());
    benchmark::DoNotOptimize(fp8moe::cpu::ce_finish(logits.data(), t.data(), kTokens, V, 0, -1, mx.data(), se.data(),
                                                    tl.data(), 0.5f, dl.data()));
    benchmark::DoNotOptimize(dl.data());
  }
  state.SetItemsProcessed(state.iterations() * kTokens * V);
}

// The MoE router: 8 experts, top 2 (items: scores); range(0) 1 sigmoid, 0 softmax.
void BM_Route(benchmark::State& state) {
  const int64_t N = kTokens, E = 8, k = 2;
  const auto z = random_vector(size_t(N * E), 9);
  std::vector<float> bias(static_cast<size_t>(E), 0.0f), prob(size_t(N * E)), gate(size_t(N * k));
  std::vector<int32_t> expert(size_t(N * k)), row_slot(size_t(N * k)), slot_row(size_t(N * k));
  std::vector<uint8_t> kept(size_t(N * k));
  std::vector<int64_t> load(static_cast<size_t>(E)), offsets(size_t(E + 1)), row_token(size_t(N * k));
  fp8moe::RouterRule rule;
  rule.top_k = k, rule.sigmoid = state.range(0) == 1, rule.capacity = N * k;
  const fp8moe::RoutingBuffers r{N, E, k, prob.data(), expert.data(), gate.data(), kept.data(), load.data(),
                                 offsets.data(), row_token.data(), row_slot.data(), slot_row.data()};
  for (auto _ : state) {
    fp8moe::cpu::route(z.data(), bias.data(), rule, r);
    benchmark::DoNotOptimize(gate.data());
  }
  state.SetItemsProcessed(state.iterations() * N * E);
}

void BM_RmsNormForward(benchmark::State& state) {
  const int64_t n = kTokens * kModel;
  const auto x = random_vector(n, 10), w = random_vector(kModel, 11);
  std::vector<float> y(n), rstd(static_cast<size_t>(kTokens));
  for (auto _ : state) {
    fp8moe::cpu::rmsnorm_forward(x.data(), w.data(), kTokens, kModel, 1e-6f, y.data(), rstd.data());
    benchmark::DoNotOptimize(y.data());
  }
  state.SetBytesProcessed(state.iterations() * n * 2 * int64_t(sizeof(float)));  // x read, y written
}

void BM_RmsNormBackward(benchmark::State& state) {
  const int64_t n = kTokens * kModel;
  const auto x = random_vector(n, 10), w = random_vector(kModel, 11), dy = random_vector(n, 12);
  std::vector<float> y(n), rstd(static_cast<size_t>(kTokens)), dx(n), dw(static_cast<size_t>(kModel));
  fp8moe::cpu::rmsnorm_forward(x.data(), w.data(), kTokens, kModel, 1e-6f, y.data(), rstd.data());
  for (auto _ : state) {
    fp8moe::cpu::rmsnorm_backward(x.data(), w.data(), rstd.data(), dy.data(), kTokens, kModel, dx.data(), dw.data());
    benchmark::DoNotOptimize(dx.data());
  }
  state.SetBytesProcessed(state.iterations() * n * 3 * int64_t(sizeof(float)));  // x, dy read, dx written
}

// RoPE on the queries of one layer (in place: read and written).
void BM_Rope(benchmark::State& state) {
  const int64_t n = kB * kT * kH * kHd;
  auto x = random_vector(n, 13);
  std::vector<float> cs(size_t(kT * kHd / 2)), sn(cs.size());
  fp8moe::cpu::rope_table(kT, kHd, 10000.0, false, cs.data(), sn.data());
  for (auto _ : state) {
    fp8moe::cpu::rope(x.data(), kB, kT, kH, kHd, cs.data(), sn.data(), kHd);
    benchmark::DoNotOptimize(x.data());
  }
  state.SetBytesProcessed(state.iterations() * n * 2 * int64_t(sizeof(float)));
}

// AdamW over 4M parameters (tiny.yaml has 7.3M); range(0) 1: BF16 moments.
void BM_AdamW(benchmark::State& state) {
  const int64_t n = 1 << 22;
  const bool bf16 = state.range(0) == 1;
  auto w = random_vector(n, 14), m = random_vector(n, 15, 0.1f), v = random_vector(n, 16, 0.1f);
  const auto g = random_vector(n, 17);
  for (float& x : v) x = x * x;
  std::vector<uint16_t> m16(size_t(n), 0), v16(size_t(n), 0x3c00);
  const fp8moe::AdamWStep h{0.9f, 0.95f, 0.19f, 0.0975f, 3e-4f, 1e-8f, 0.9999f, 0.7f};
  for (auto _ : state) {
    if (bf16) fp8moe::cpu::adamw(h, w.data(), g.data(), nullptr, nullptr, m16.data(), v16.data(), n);
    else fp8moe::cpu::adamw(h, w.data(), g.data(), m.data(), v.data(), nullptr, nullptr, n);
    benchmark::DoNotOptimize(w.data());
  }
  // w, m, v read and written, g read.
  const int64_t moment = bf16 ? 2 : 4;
  state.SetBytesProcessed(state.iterations() * n * (2 * 4 + 4 + 4 * moment));
}

void BM_SumSquares(benchmark::State& state) {
  const int64_t n = 1 << 22;
  const auto g = random_vector(n, 18);
  for (auto _ : state) benchmark::DoNotOptimize(fp8moe::cpu::sum_squares(g.data(), n, 0.5f));
  state.SetBytesProcessed(state.iterations() * n * int64_t(sizeof(float)));
}

// One softmax row of tiny.yaml's attention (256 scores): exp(x - max) and its sum in double, as
// glibc's scalar exp in double (the CPU ops' form before kernels/cpu/vmath.h), and as vmath.h's
// FP32 and double functions on each level (range(0): scalar, SSE2, AVX, AVX-512).
void BM_ExpRowGlibc(benchmark::State& state) {
  const int64_t n = 256;
  const auto x = random_vector(n, 19);
  for (auto _ : state) {
    double s = 0;
    for (int64_t i = 0; i < n; ++i) s += std::exp(double(x[i]) - 1.5);
    benchmark::DoNotOptimize(s);
  }
  state.SetItemsProcessed(state.iterations() * n);
}

void exp_row_on_level(benchmark::State& state, bool f64) {
  namespace vm = fp8moe::cpu::vm;
  const vm::Level level = vm::kLevels[state.range(0)];
  if (!vm::supported(level)) return state.SkipWithError("this CPU lacks the level");
  const vm::Level previous = vm::set_level(level);
  state.SetLabel(vm::to_string(level));
  const int64_t n = 256;
  const auto x = random_vector(n, 19);
  std::vector<float> y(n);
  for (auto _ : state) {
    const double s = f64 ? vm::exp_sub_sum_f64(x.data(), 1.5, n) : vm::exp_sub_sum(x.data(), 1.5f, y.data(), n);
    benchmark::DoNotOptimize(s);
  }
  vm::set_level(previous);
  state.SetItemsProcessed(state.iterations() * n);
}
void BM_ExpRow(benchmark::State& state) { exp_row_on_level(state, false); }
void BM_ExpRowF64(benchmark::State& state) { exp_row_on_level(state, true); }

// One MoE layer's worth of expert activations of tiny.yaml (8 x 256 tokens x 256 wide) and a 16M slab.
BENCHMARK(BM_SwigluForward)->Arg(8 * 256 * 256)->Arg(1 << 24)->UseRealTime();
BENCHMARK(BM_SwigluBackward)->Arg(8 * 256 * 256)->Arg(1 << 24)->UseRealTime();
BENCHMARK(BM_AttentionForward)->UseRealTime();
BENCHMARK(BM_AttentionBackward)->UseRealTime();
// tiny.yaml's vocabulary, and a 32K one.
BENCHMARK(BM_CrossEntropy)->Arg(256)->Arg(32768)->UseRealTime();
BENCHMARK(BM_CrossEntropyVocabParallel)->Arg(256)->UseRealTime();
BENCHMARK(BM_Route)->Arg(1)->Arg(0)->UseRealTime();
BENCHMARK(BM_RmsNormForward)->UseRealTime();
BENCHMARK(BM_RmsNormBackward)->UseRealTime();
BENCHMARK(BM_Rope)->UseRealTime();
BENCHMARK(BM_AdamW)->Arg(0)->Arg(1)->UseRealTime();
BENCHMARK(BM_SumSquares)->UseRealTime();
BENCHMARK(BM_ExpRowGlibc)->UseRealTime();
BENCHMARK(BM_ExpRow)->DenseRange(0, 3)->UseRealTime();
BENCHMARK(BM_ExpRowF64)->DenseRange(0, 3)->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
