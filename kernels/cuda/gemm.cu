#include <cublasLt.h>
#include <cuda_bf16.h>

#include <map>
#include <mutex>
#include <string>

#include "kernels/check.h"
#include "kernels/cuda/context.h"
#include "kernels/cuda/gemm.h"

namespace fp8moe::cuda {
namespace {

constexpr int64_t kBlock = kTnBlock;
int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }

cudaDataType_t fp8_type(Fp8Dtype d) { return d == Fp8Dtype::e4m3 ? CUDA_R_8F_E4M3 : CUDA_R_8F_E5M2; }

cublasLtMatmulMatrixScale_t lt_mode(ScaleMode m) {
  switch (m) {
    case ScaleMode::vec128: return CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
    case ScaleMode::blk128: return CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
    default: return CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F;
  }
}
const char* mode_name(ScaleMode m) {
  return m == ScaleMode::vec128 ? "VEC128_32F" : m == ScaleMode::blk128 ? "BLK128x128_32F" : "SCALAR_32F";
}

// The largest power of two (up to 256) dividing the address.
uint32_t alignment_of(const void* p) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  uint32_t al = 256;
  while (al > 1 && a % al != 0) al /= 2;
  return al;
}

// RAII for the descriptors of one call.
struct LtCall {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr, d = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  ~LtCall() {
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    if (d && d != c) cublasLtMatrixLayoutDestroy(d);
    if (c) cublasLtMatrixLayoutDestroy(c);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (desc) cublasLtMatmulDescDestroy(desc);
  }
  template <class T>
  void set(cublasLtMatmulDescAttributes_t attr, const T& v) {
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, attr, &v, sizeof v));
  }
  // Runs the heuristic's first algorithm for this problem (cached per `key`: the shape, types,
  // modes and leading dimensions); a clear error when there is none.
  void run(const void* alpha, const void* A, const void* B, const void* beta, const void* C, void* D,
           cudaStream_t stream, std::string key) {
    Context& ctx = context();
    // The workspace is shared: every GEMM runs on the compute stream.
    FP8MOE_ASSERT(stream == ctx.compute, "cuBLASLt GEMMs run on the context's compute stream");
    // The heuristic does not see the pointers: it assumes 256-byte alignment unless told the
    // actual one (CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_*_BYTES), which is therefore part of the key.
    const uint32_t align[4] = {alignment_of(A), alignment_of(B), alignment_of(C), alignment_of(D)};
    key += detail::concat(", alignment ", align[0], "/", align[1], "/", align[2], "/", align[3]);
    static std::mutex mu;
    static std::map<std::string, cublasLtMatmulAlgo_t> cache;
    cublasLtMatmulAlgo_t algo;
    bool cached = false;
    {
      std::lock_guard<std::mutex> lock(mu);
      auto it = cache.find(key);
      if (it != cache.end()) algo = it->second, cached = true;
    }
    if (!cached) {
      CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
      CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                        &ctx.workspace_bytes, sizeof ctx.workspace_bytes));
      const cublasLtMatmulPreferenceAttributes_t align_attr[4] = {
          CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
          CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
      for (int i = 0; i < 4; ++i)
        CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, align_attr[i], &align[i], sizeof align[i]));
      cublasLtMatmulHeuristicResult_t heur{};
      int found = 0;
      const cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(ctx.lt, desc, a, b, c, d, pref, 1, &heur, &found);
      if (st != CUBLAS_STATUS_SUCCESS || found == 0)
        fatal_error(__FILE__, __LINE__,
                    detail::concat("cuBLASLt has no kernel for ", key, " on this device (",
                                   st == CUBLAS_STATUS_SUCCESS ? "no algorithm found" : cublasLtGetStatusString(st),
                                   "); cuBLASLt ", cublasLtGetVersion()));
      algo = heur.algo;
      std::lock_guard<std::mutex> lock(mu);
      cache.emplace(key, algo);
    }
    CUBLAS_CHECK(cublasLtMatmul(ctx.lt, desc, alpha, A, a, B, b, beta, C, c, D, d, &algo, ctx.workspace,
                                ctx.workspace_bytes, stream));
  }
};

// The packing of kernels/tn_layout.h, one thread per packed byte / scale slot.
__global__ void pack_kernel(const uint8_t* __restrict__ in, int64_t rows, int64_t cols, bool k_along_rows,
                            int64_t n, int64_t K_p, uint8_t* __restrict__ out) {
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < n; e += int64_t(gridDim.x) * blockDim.x)
    out[e] = tn_packed_byte(in, rows, cols, k_along_rows, K_p, e);
}

__global__ void pack_scales_kernel(const float* __restrict__ si, Tiling t, int tile, int64_t rows, int64_t cols,
                                   bool k_along_rows, ScaleMode mode, int64_t outer_p, int64_t K_p, int64_t n,
                                   float* __restrict__ out) {
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < n; e += int64_t(gridDim.x) * blockDim.x)
    out[e] = tn_packed_scale(si, t, tile, rows, cols, k_along_rows, mode, outer_p, K_p, e);
}

unsigned grid_for(int64_t n) {
  const int64_t want = (n + 255) / 256;
  return unsigned(want < 65535 ? (want > 0 ? want : 1) : 65535);
}

// A host QuantTensor made into a padded TN operand on the device.
struct PackedOperand {
  Buffer<uint8_t> data;
  Buffer<float> scale;
  Fp8Operand op;
};

PackedOperand pack(const QuantTensor& q, bool k_along_rows, int64_t outer_p, int64_t K_p, cudaStream_t stream) {
  PackedOperand p;
  ScaleMode mode = ScaleMode::per_tensor;
  if (!tn_mode_of(q, k_along_rows, &mode))
    fatal_error(__FILE__, __LINE__,
                detail::concat("the CUDA backend's block-scaled GEMMs need fp8.tile 128 (cuBLASLt's blocks) with "
                               "1 x 128 tiles along K; got a ", to_string(q.tiling), " operand with tile ", q.tile,
                               k_along_rows ? ", K along its rows" : ", K along its columns"));
  FP8MOE_ASSERT(q.tiling != Tiling::per_tensor || q.scale_inv.size() == 1, "a per-tensor QuantTensor without its scale");
  Buffer<uint8_t> raw = to_device(q.data.data(), int64_t(q.data.size()));
  Buffer<float> raw_si = to_device(q.scale_inv.data(), int64_t(q.scale_inv.size()));
  p.data = Buffer<uint8_t>(outer_p * K_p);
  pack_kernel<<<grid_for(outer_p * K_p), 256, 0, stream>>>(raw.get(), q.rows, q.cols, k_along_rows, outer_p * K_p,
                                                           K_p, p.data.get());
  p.scale = Buffer<float>(tn_scale_count(mode, outer_p, K_p));
  if (mode == ScaleMode::per_tensor)
    CUDA_CHECK(cudaMemcpyAsync(p.scale.get(), raw_si.get(), sizeof(float), cudaMemcpyDeviceToDevice, stream));
  else
    pack_scales_kernel<<<grid_for(p.scale.size()), 256, 0, stream>>>(raw_si.get(), q.tiling, q.tile, q.rows, q.cols,
                                                                     k_along_rows, mode, outer_p, K_p, p.scale.size(),
                                                                     p.scale.get());
  CUDA_CHECK(cudaGetLastError());
  p.op = {p.data.get(), outer_p, K_p, q.dtype, mode, p.scale.get()};
  return p;
}

}  // namespace

std::string fp8_unsupported_reason(bool block_scaling) {
  int dev = 0;
  CUDA_CHECK(cudaGetDevice(&dev));
  static std::mutex mu;
  static std::map<int, int> cc_of;  // device -> compute capability (major * 10 + minor)
  int cc = 0;
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = cc_of.find(dev);
    if (it == cc_of.end()) {
      int major = 0, minor = 0;
      CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
      CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
      it = cc_of.emplace(dev, major * 10 + minor).first;
    }
    cc = it->second;
  }
  if (cc < 89) return detail::concat("FP8 GEMMs need compute capability 8.9 or newer; device ", dev, " is ", cc / 10, ".", cc % 10);
  // cuBLASLt offers VEC128_32F / BLK128x128_32F on Hopper only (newer GPUs scale blocks as MXFP8).
  if (block_scaling && cc != 90)
    return detail::concat("block-scaled FP8 GEMMs (1x128 / 128x128 scales) need compute capability 9.0 (Hopper), "
                          "the only one cuBLASLt offers them on; device ", dev, " is ", cc / 10, ".", cc % 10);
  if (block_scaling && cublasLtGetVersion() < 120900)
    return detail::concat("block-scaled FP8 GEMMs need cuBLASLt 12.9 or newer; this is ", cublasLtGetVersion());
  return "";
}

void gemm_fp8_tn(const Fp8Operand& A, const Fp8Operand& B, float alpha, float beta, void* D, int64_t ldd,
                 OutType out, bool fast_accum, cudaStream_t stream) {
  FP8MOE_ASSERT(A.K == B.K, "gemm_fp8_tn: K ", A.K, " vs ", B.K);
  const int64_t M = A.outer, N = B.outer, K = A.K;
  if (M == 0 || N == 0) return;
  FP8MOE_ASSERT(!(A.dtype == Fp8Dtype::e5m2 && B.dtype == Fp8Dtype::e5m2), "E5M2 x E5M2 has no FP8 GEMM");
  FP8MOE_ASSERT(!(A.mode == ScaleMode::blk128 && B.mode == ScaleMode::blk128),
                "cuBLASLt has no BLK128x128 x BLK128x128 FP8 GEMM");
  FP8MOE_ASSERT((A.mode == ScaleMode::per_tensor) == (B.mode == ScaleMode::per_tensor),
                "per-tensor and block scaling cannot be mixed in one GEMM");
  const bool block = A.mode != ScaleMode::per_tensor;
  if (const std::string why = fp8_unsupported_reason(block); !why.empty()) fatal_error(__FILE__, __LINE__, why);
  const cudaDataType_t dt = out == OutType::f32 ? CUDA_R_32F : CUDA_R_16BF;
  LtCall call;
  CUBLAS_CHECK(cublasLtMatmulDescCreate(&call.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  // Column-major view: D^T (N, M) = B (N, K) . A^T, so cuBLASLt's "A" is our B (transposed) and its "B" our A.
  call.set(CUBLASLT_MATMUL_DESC_TRANSA, CUBLAS_OP_T);
  call.set(CUBLASLT_MATMUL_DESC_TRANSB, CUBLAS_OP_N);
  call.set(CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, static_cast<const void*>(B.scale));
  call.set(CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, static_cast<const void*>(A.scale));
  if (block) {
    call.set(CUBLASLT_MATMUL_DESC_A_SCALE_MODE, int32_t(lt_mode(B.mode)));
    call.set(CUBLASLT_MATMUL_DESC_B_SCALE_MODE, int32_t(lt_mode(A.mode)));
  }
  // NOTE: fast accumulation only for per-tensor scales: with block scaling cuBLASLt promotes the
  // partial sums to FP32 once per 128-wide K block anyway (DeepSeek-V3's promotion), as TE does.
  call.set(CUBLASLT_MATMUL_DESC_FAST_ACCUM, int8_t(fast_accum && !block ? 1 : 0));
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&call.a, fp8_type(B.dtype), uint64_t(K), uint64_t(N), K));
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&call.b, fp8_type(A.dtype), uint64_t(K), uint64_t(M), K));
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&call.c, dt, uint64_t(N), uint64_t(M), ldd));
  call.d = call.c;
  const std::string what = detail::concat("the FP8 GEMM ", to_string(A.dtype), " x ", to_string(B.dtype), " (", M, "x",
                                          N, "x", K, ", scales ", mode_name(A.mode), " x ", mode_name(B.mode), ", ",
                                          out == OutType::f32 ? "FP32" : "BF16", " out, ldd ", ldd,
                                          fast_accum && !block ? ", fast accumulation" : "",
                                          beta != 0.0f ? ", beta" : "", ")");
  call.run(&alpha, B.data, A.data, &beta, D, D, stream, what);
}

void gemm_fp8(const QuantTensor& A, bool trans_a, const QuantTensor& B, bool trans_b, float alpha, float beta,
              float* C, int64_t ldc, bool fast_accum) {
  const int64_t M = trans_a ? A.cols : A.rows, K = trans_a ? A.rows : A.cols;
  const int64_t N = trans_b ? B.rows : B.cols, Kb = trans_b ? B.cols : B.rows;
  FP8MOE_ASSERT(K == Kb, "gemm_fp8 (cuda): inner dimensions ", K, " and ", Kb);
  if (M == 0 || N == 0) return;
  Context& ctx = context();
  cudaStream_t s = ctx.compute;
  const bool block = A.tiling != Tiling::per_tensor;
  const int64_t Mp = round_up(M, 16), Np = round_up(N, 16), Kp = round_up(std::max<int64_t>(K, 1), block ? kBlock : 16);
  PackedOperand a = pack(A, trans_a, Mp, Kp, s);
  PackedOperand b = pack(B, !trans_b, Np, Kp, s);
  Buffer<float> d(Mp * Np);
  if (beta != 0.0f)
    CUDA_CHECK(cudaMemcpy2DAsync(d.get(), size_t(Np) * 4, C, size_t(ldc) * 4, size_t(N) * 4, size_t(M),
                                 cudaMemcpyHostToDevice, s));
  gemm_fp8_tn(a.op, b.op, alpha, beta, d.get(), Np, OutType::f32, fast_accum, s);
  CUDA_CHECK(cudaMemcpy2DAsync(C, size_t(ldc) * 4, d.get(), size_t(Np) * 4, size_t(N) * 4, size_t(M),
                               cudaMemcpyDeviceToHost, s));
  CUDA_CHECK(cudaStreamSynchronize(s));
}

void sgemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
           const float* B, int64_t ldb, float beta, float* C, int64_t ldc, cudaStream_t stream) {
  if (M == 0 || N == 0) return;
  if (K == 0) {  // cuBLASLt needs K >= 1: C = beta C
    FP8MOE_ASSERT(beta == 0.0f || beta == 1.0f, "sgemm with K = 0 and beta ", beta);
    if (beta == 0.0f) CUDA_CHECK(cudaMemset2DAsync(C, size_t(ldc) * 4, 0, size_t(N) * 4, size_t(M), stream));
    return;
  }
  LtCall call;
  CUBLAS_CHECK(cublasLtMatmulDescCreate(&call.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));  // exact FP32, no TF32
  // Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T: swap the operands.
  call.set(CUBLASLT_MATMUL_DESC_TRANSA, trans_b ? CUBLAS_OP_T : CUBLAS_OP_N);
  call.set(CUBLASLT_MATMUL_DESC_TRANSB, trans_a ? CUBLAS_OP_T : CUBLAS_OP_N);
  // Column-major shapes of the stored matrices: B is (K, N) row-major -> (N, K) col-major when not transposed.
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&call.a, CUDA_R_32F, trans_b ? uint64_t(K) : uint64_t(N),
                                          trans_b ? uint64_t(N) : uint64_t(K), ldb));
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&call.b, CUDA_R_32F, trans_a ? uint64_t(M) : uint64_t(K),
                                          trans_a ? uint64_t(K) : uint64_t(M), lda));
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&call.c, CUDA_R_32F, uint64_t(N), uint64_t(M), ldc));
  call.d = call.c;
  call.run(&alpha, B, A, &beta, C, C, stream,
           detail::concat("the FP32 GEMM ", M, "x", N, "x", K, trans_a ? " T" : " N", trans_b ? "T" : "N", " lda ", lda,
                          " ldb ", ldb, " ldc ", ldc, beta != 0.0f ? " beta" : ""));
}

void gemm_bf16_tn(const uint16_t* A, const uint16_t* B, uint16_t* D, int64_t M, int64_t N, int64_t K,
                  cudaStream_t stream) {
  LtCall call;
  CUBLAS_CHECK(cublasLtMatmulDescCreate(&call.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  call.set(CUBLASLT_MATMUL_DESC_TRANSA, CUBLAS_OP_T);
  call.set(CUBLASLT_MATMUL_DESC_TRANSB, CUBLAS_OP_N);
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&call.a, CUDA_R_16BF, uint64_t(K), uint64_t(N), K));
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&call.b, CUDA_R_16BF, uint64_t(K), uint64_t(M), K));
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&call.c, CUDA_R_16BF, uint64_t(N), uint64_t(M), N));
  call.d = call.c;
  const float alpha = 1.0f, beta = 0.0f;
  call.run(&alpha, B, A, &beta, D, D, stream, detail::concat("the BF16 GEMM TN ", M, "x", N, "x", K));
}

}  // namespace fp8moe::cuda
