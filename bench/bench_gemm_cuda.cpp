// cuBLASLt GEMM throughput on the GPU, side by side in one run: BF16, FP8 per-tensor (E4M3 x E4M3,
// fast accumulation, as a forward GEMM) and FP8 block-scaled (1x128 activations x 128x128 weights,
// split accumulation), at DeepSeek-V3-like shapes (M = 4096 tokens; N, K in {2048, 7168}) and one
// grouped expert shape (a loop over the local experts' GEMMs), with the fraction of the dense FP8
// peak (1979 TFLOP/s on H100 / H200 SXM); beside them CUTLASS's grouped block-scaled FP8 GEMM
// (kernels/cuda/grouped_gemm.h: every group in one launch, FP32 output where the loop writes BF16)
// and its ratio to the loop of cuBLASLt block-scaled calls. Prints a table; exits 77 (SKIPPED)
// without a GPU.
//   bench_gemm_cuda [iterations]
#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kernels/backend.h"
#include "kernels/backend_info.h"
#include "kernels/check.h"
#include "kernels/cuda/backend.h"
#include "kernels/cuda/gemm_fp8.h"
#if FP8MOE_HAVE_CUTLASS
#include "kernels/cuda/grouped_gemm.h"
#endif
#include "kernels/fp8.h"
#include "kernels/tensor.h"

using namespace fp8moe;

namespace {

constexpr double kFp8Peak = 1979e12;

// Valid FP8 values of N(0, 1) (no NaN codes) and BF16 values of the same.
std::vector<uint8_t> fp8_values(int64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<uint8_t> q(static_cast<size_t>(n));
  for (auto& b : q) b = fp8_encode(d(rng), Fp8Dtype::e4m3, true);
  return q;
}
std::vector<uint16_t> bf16_values(int64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<uint16_t> q(static_cast<size_t>(n));
  for (auto& b : q) b = bf16_encode(d(rng));
  return q;
}

// Seconds per call of fn: captured once into a CUDA graph (so that host-side descriptor set-up
// is not timed: the GPU runs the GEMMs back to back), then the median of 5 timings of `iters`
// graph launches after a warm-up.
double time_it(cudaStream_t s, const std::function<void()>& fn, int iters) {
  fn();  // first call outside the capture: the heuristic's choice is cached
  CUDA_CHECK(cudaStreamSynchronize(s));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  fn();
  CUDA_CHECK(cudaStreamEndCapture(s, &graph));
  CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (int i = 0; i < 3; ++i) CUDA_CHECK(cudaGraphLaunch(exec, s));
  cudaEvent_t a, b;
  CUDA_CHECK(cudaEventCreate(&a));
  CUDA_CHECK(cudaEventCreate(&b));
  std::vector<float> ms;
  for (int r = 0; r < 5; ++r) {
    CUDA_CHECK(cudaEventRecord(a, s));
    for (int i = 0; i < iters; ++i) CUDA_CHECK(cudaGraphLaunch(exec, s));
    CUDA_CHECK(cudaEventRecord(b, s));
    CUDA_CHECK(cudaEventSynchronize(b));
    float t = 0;
    CUDA_CHECK(cudaEventElapsedTime(&t, a, b));
    ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  CUDA_CHECK(cudaEventDestroy(a));
  CUDA_CHECK(cudaEventDestroy(b));
  CUDA_CHECK(cudaGraphExecDestroy(exec));
  CUDA_CHECK(cudaGraphDestroy(graph));
  return double(ms[ms.size() / 2]) * 1e-3 / iters;
}

struct Result {
  double bf16, fp8_tensor, fp8_block, grouped;  // TFLOP/s
};

// The cuBLASLt handle and workspace the benchmark's GEMMs use: the backend owns neither to lend,
// so the benchmark makes its own on the backend's device (the workspace from the backend's arena).
struct BenchLt {
  explicit BenchLt(Backend& be) : workspace(be, DType::u8, {int64_t(kWorkspaceBytes)}) {
    CUBLAS_CHECK(cublasLtCreate(&handle));
  }
  ~BenchLt() { cublasLtDestroy(handle); }
  cuda::LtContext context(Backend& be) const {
    return {handle, workspace.raw(), kWorkspaceBytes, cuda_backend(be).device()};
  }
  static constexpr size_t kWorkspaceBytes = size_t(32) << 20;  // as the backend's
  cublasLtHandle_t handle = nullptr;
  Tensor workspace;
};

// `groups` GEMMs of (M, N, K) each (groups > 1: the experts of one MoE layer on one GPU).
Result run_shape(Backend& be, const cuda::LtContext& lt, int64_t groups, int64_t M, int64_t N, int64_t K, int iters) {
  const cudaStream_t s = cuda_backend(be).compute_stream();
  const Tensor a8 = tensor_from(be, fp8_values(groups * M * K, 1), {groups * M * K});
  const Tensor b8 = tensor_from(be, fp8_values(groups * N * K, 2), {groups * N * K});
  const Tensor a16 = tensor_from(be, bf16_values(groups * M * K, 3), {groups * M * K});
  const Tensor b16 = tensor_from(be, bf16_values(groups * N * K, 4), {groups * N * K});
  Tensor d16(be, DType::bf16, {groups * M * N});
  // Scales: 1 per tensor; 2^-4 in every block (any value: the throughput does not depend on it).
  const Tensor s1 = tensor_from(be, std::vector<float>(1, 1.0f), {1});
  const int64_t na = tn_scale_count(ScaleMode::vec128, M, K), nb = tn_scale_count(ScaleMode::blk128, N, K);
  const Tensor gsa = tensor_from(be, std::vector<float>(static_cast<size_t>(groups * na), 0.0625f), {groups * na});
  const Tensor gsb = tensor_from(be, std::vector<float>(static_cast<size_t>(groups * nb), 0.0625f), {groups * nb});
  const uint8_t *pa8 = a8.data<uint8_t>(), *pb8 = b8.data<uint8_t>();
  const uint16_t *pa16 = a16.data<uint16_t>(), *pb16 = b16.data<uint16_t>();
  uint16_t* pd16 = d16.data<uint16_t>();
  const double flops = 2.0 * double(groups) * double(M) * double(N) * double(K);
  Result r{};
  r.bf16 = flops / time_it(s, [&] {
    for (int64_t g = 0; g < groups; ++g)
      cuda::gemm_bf16_tn(lt, pa16 + g * M * K, pb16 + g * N * K, pd16 + g * M * N, M, N, K, s);
  }, iters) * 1e-12;
  r.fp8_tensor = r.fp8_block = std::nan("");  // printed as nan where the device cannot run them
  if (cuda::fp8_unsupported_reason(false).empty()) {
    r.fp8_tensor = flops / time_it(s, [&] {
      for (int64_t g = 0; g < groups; ++g) {
        const cuda::Fp8Operand A{pa8 + g * M * K, M, K, Fp8Dtype::e4m3, ScaleMode::per_tensor, s1.f32()};
        const cuda::Fp8Operand B{pb8 + g * N * K, N, K, Fp8Dtype::e4m3, ScaleMode::per_tensor, s1.f32()};
        cuda::gemm_fp8_tn(lt, A, B, 1.0f, 0.0f, pd16 + g * M * N, N, cuda::OutType::bf16, true, s);
      }
    }, iters) * 1e-12;
  }
  if (cuda::fp8_unsupported_reason(true).empty()) {
    r.fp8_block = flops / time_it(s, [&] {
      for (int64_t g = 0; g < groups; ++g) {
        const cuda::Fp8Operand A{pa8 + g * M * K, M, K, Fp8Dtype::e4m3, ScaleMode::vec128, gsa.f32() + g * na};
        const cuda::Fp8Operand B{pb8 + g * N * K, N, K, Fp8Dtype::e4m3, ScaleMode::blk128, gsb.f32() + g * nb};
        cuda::gemm_fp8_tn(lt, A, B, 1.0f, 0.0f, pd16 + g * M * N, N, cuda::OutType::bf16, false, s);
      }
    }, iters) * 1e-12;
  }
  r.grouped = std::nan("");
#if FP8MOE_HAVE_CUTLASS
  const int device = cuda_backend(be).device();
  if (cuda::grouped_gemm_unsupported_reason(device).empty()) {
    std::vector<int64_t> off(static_cast<size_t>(groups + 1));
    for (int64_t g = 0; g <= groups; ++g) off[size_t(g)] = g * M;
    const Tensor goff = tensor_from(be, off, {groups + 1});
    const int64_t kb = K / 128, nbk = (N / 128) * kb;
    const Tensor sa = tensor_from(be, std::vector<float>(static_cast<size_t>(groups * M * kb), 0.0625f), {groups * M * kb});
    const Tensor sb = tensor_from(be, std::vector<float>(static_cast<size_t>(groups * nbk), 0.0625f), {groups * nbk});
    Tensor d32(be, DType::f32, {groups * M * N});
    std::vector<uint64_t> pa, psa, pb, psb, pd;  // the groups' argument arrays
    for (int64_t g = 0; g < groups; ++g) {
      pa.push_back(uint64_t(pa8 + g * M * K)), psa.push_back(uint64_t(sa.f32() + g * M * kb));
      pb.push_back(uint64_t(pb8 + g * N * K)), psb.push_back(uint64_t(sb.f32() + g * nbk));
      pd.push_back(uint64_t(d32.f32() + g * M * N));
    }
    const Tensor dpa = tensor_from(be, pa, {groups}), dpsa = tensor_from(be, psa, {groups}),
                 dpb = tensor_from(be, pb, {groups}), dpsb = tensor_from(be, psb, {groups}),
                 dpd = tensor_from(be, pd, {groups});
    cuda::GroupedGemmFp8 p;
    p.groups = groups, p.rows = groups * M, p.N = N, p.K = K, p.row_offsets = goff.data<int64_t>();
    p.A = reinterpret_cast<const uint8_t* const*>(dpa.raw()), p.a_scale = reinterpret_cast<const float* const*>(dpsa.raw());
    p.B = reinterpret_cast<const uint8_t* const*>(dpb.raw()), p.b_scale = reinterpret_cast<const float* const*>(dpsb.raw());
    p.D = reinterpret_cast<float* const*>(dpd.raw());
    const size_t bytes = cuda::grouped_gemm_fp8_scratch_bytes(p, device);
    Tensor scratch(be, DType::u8, {int64_t(bytes)});
    r.grouped = flops / time_it(s, [&] { cuda::grouped_gemm_fp8(p, scratch.raw(), bytes, device, s); }, iters) * 1e-12;
  }
#endif
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  std::string why;
  if (cuda_device_count(&why) == 0) {
    std::printf("[  SKIPPED ] no CUDA device visible: %s\n", why.c_str());
    return 77;
  }
  const int iters = argc > 1 ? std::atoi(argv[1]) : 20;
  const std::unique_ptr<Backend> be = make_backend(DeviceKind::cuda, 0);
  const BenchLt bench_lt(*be);
  const cuda::LtContext lt = bench_lt.context(*be);
  cudaDeviceProp prop{};
  CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("GEMM throughput on %s (sm_%d%d), cuBLASLt %zu; TFLOP/s, median of 5 x %d CUDA-graph launches\n", prop.name,
              prop.major, prop.minor, cublasLtGetVersion(), iters);
  for (bool block : {false, true})
    if (const std::string why = cuda::fp8_unsupported_reason(block); !why.empty())
      std::printf("FP8 %s: not run (nan below): %s\n", block ? "block-scaled" : "per-tensor", why.c_str());
#if FP8MOE_HAVE_CUTLASS
  if (const std::string why = cuda::grouped_gemm_unsupported_reason(0); !why.empty())
    std::printf("grouped (CUTLASS): not run (nan below): %s\n", why.c_str());
#else
  std::printf("grouped (CUTLASS): not built (nan below): no CUTLASS at configure time\n");
#endif
  std::printf("%-28s %8s %10s %7s %10s %7s %9s %8s %7s %12s\n", "shape (groups x M x N x K)", "BF16", "FP8 tensor",
              "%peak", "FP8 block", "%peak", "block/bf16", "grouped", "%peak", "grouped/block");
  struct Shape {
    int64_t g, M, N, K;
  };
  // DeepSeek-V3: d_model 7168, expert width 2048 (w1|w3 fused: 4096), 256 experts, 8 per token;
  // the grouped shape: 16 local experts of one GPU with 128 tokens each (their fused w1|w3 GEMMs).
  // configs/moe-3b.yaml's experts: 64 on one GPU, 4 x 2048 x 6 / 64 = 768 rows each, w2's 2048 x 1024.
  const Shape shapes[] = {{1, 4096, 2048, 2048}, {1, 4096, 2048, 7168}, {1, 4096, 7168, 2048},
                          {1, 4096, 7168, 7168}, {16, 128, 4096, 7168}, {64, 768, 2048, 1024}};
  for (const Shape& sh : shapes) {
    const Result r = run_shape(*be, lt, sh.g, sh.M, sh.N, sh.K, iters);
    char name[64];
    std::snprintf(name, sizeof name, "%lld x %lld x %lld x %lld", (long long)sh.g, (long long)sh.M, (long long)sh.N,
                  (long long)sh.K);
    std::printf("%-28s %8.0f %10.0f %6.1f%% %10.0f %6.1f%% %9.2f %8.0f %6.1f%% %12.2f\n", name, r.bf16, r.fp8_tensor,
                100 * r.fp8_tensor * 1e12 / kFp8Peak, r.fp8_block, 100 * r.fp8_block * 1e12 / kFp8Peak,
                r.bf16 > 0 ? r.fp8_block / r.bf16 : 0.0, r.grouped, 100 * r.grouped * 1e12 / kFp8Peak,
                r.fp8_block > 0 ? r.grouped / r.fp8_block : std::nan(""));
  }
  return 0;
}
