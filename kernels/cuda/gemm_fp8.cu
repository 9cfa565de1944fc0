// cuBLASLt GEMMs (kernels/cuda/gemm_fp8.h).
//
// Against the CPU's kernels/cpu/gemm_fp8.cpp: close. The FP8 products are exact on both sides;
// the accumulation differs (Hopper's FP8 tensor cores keep about 14 bits in the accumulator and
// promote to FP32 every 128 of K without fast accumulation; the CPU accumulates in FP32 or BF16
// hardware). sgemm: FP32 (no TF32) in another summation order than the CPU's (oneDNN). The packing is exact
// (bytes and scales moved, never re-rounded) and checked against the CPU by
// tests/kernels/test_tn_layout.cpp through kernels/tn_layout.h's index functions.
#include <cublasLt.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <string>

#include "kernels/check.h"
#include "kernels/cuda/gemm_fp8.h"
#include "kernels/cuda/launch.cuh"

namespace fp8moe::cuda {
namespace {

// Padding of the packed operands and the output: cuBLASLt's FP8 kernels want 16-byte aligned
// pointers and leading dimensions, and K in whole 128-blocks with block scaling.
constexpr int64_t kPadOuter = 16, kPadK = 16;
constexpr uint32_t kFp8MinAlignment = 16;

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
  LtCall() = default;
  LtCall(const LtCall&) = delete;
  LtCall& operator=(const LtCall&) = delete;
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
  // Runs the heuristic's first algorithm for this problem, cached per `key` (the device, shape,
  // types, modes, leading dimensions and pointer alignments); a clear error when there is none.
  void run(const LtContext& lt, const void* alpha, const void* A, const void* B, const void* beta, const void* C,
           void* D, cudaStream_t stream, std::string key) {
    // The heuristic does not see the pointers: it assumes 256-byte alignment unless told the
    // actual one (CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_*_BYTES), which is therefore part of the key.
    const uint32_t align[4] = {alignment_of(A), alignment_of(B), alignment_of(C), alignment_of(D)};
    key += detail::concat(", alignment ", align[0], "/", align[1], "/", align[2], "/", align[3], ", device ",
                          lt.device);
    // NOTE: the one piece of state shared by every backend of the process: algorithms found by the
    // heuristic, keyed by everything the choice depends on (the device included), under a mutex.
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
                                                        &lt.workspace_bytes, sizeof lt.workspace_bytes));
      const cublasLtMatmulPreferenceAttributes_t align_attr[4] = {
          CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
          CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
      for (int i = 0; i < 4; ++i)
        CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, align_attr[i], &align[i], sizeof align[i]));
      cublasLtMatmulHeuristicResult_t heur{};
      int found = 0;
      const cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(lt.handle, desc, a, b, c, d, pref, 1, &heur, &found);
      if (st != CUBLAS_STATUS_SUCCESS || found == 0)
        fatal_error(__FILE__, __LINE__,
                    detail::concat("cuBLASLt has no kernel for ", key, " on this device (",
                                   st == CUBLAS_STATUS_SUCCESS ? "no algorithm found" : cublasLtGetStatusString(st),
                                   "); cuBLASLt ", cublasLtGetVersion()));
      algo = heur.algo;
      std::lock_guard<std::mutex> lock(mu);
      cache.emplace(key, algo);
    }
    CUBLAS_CHECK(cublasLtMatmul(lt.handle, desc, alpha, A, a, B, b, beta, C, c, D, d, &algo, lt.workspace,
                                lt.workspace_bytes, stream));
  }
};

// The packing of kernels/tn_layout.h, one thread per packed byte / scale slot.
__global__ void pack_kernel(const uint8_t* __restrict__ in, int64_t rows, int64_t cols, bool k_along_rows, int64_t n,
                            int64_t K_p, uint8_t* __restrict__ out) {
  FP8MOE_GRID_STRIDE(e, n) out[e] = tn_packed_byte(in, rows, cols, k_along_rows, K_p, e);
}

__global__ void pack_scales_kernel(const float* __restrict__ si, Tiling t, int tile, int64_t rows, int64_t cols,
                                   bool k_along_rows, ScaleMode mode, int64_t outer_p, int64_t K_p, int64_t n,
                                   float* __restrict__ out) {
  FP8MOE_GRID_STRIDE(e, n) out[e] = tn_packed_scale(si, t, tile, rows, cols, k_along_rows, mode, outer_p, K_p, e);
}

// C (M, N) = beta C, leading dimension ldc: sgemm with K = 0. NOTE: beta == 0 writes 0 (never
// 0 * C, which would keep NaN), as the CPU's sgemm.
__global__ void scale_matrix_kernel(float* __restrict__ C, int64_t M, int64_t N, int64_t ldc, float beta) {
  FP8MOE_GRID_STRIDE(e, M * N) {
    float* c = &C[(e / N) * ldc + e % N];
    *c = beta == 0.0f ? 0.0f : __fmul_rn(beta, *c);
  }
}

// tn_layout.h's tn_mode_of, on a view: the mode a tiling packs to, false when its tiles do not run
// along K (a 1 x T tensor whose K runs along its rows, or a T x 1 one along its columns) or are
// not cuBLASLt's 128.
bool tn_mode_of_view(const QuantView& q, bool k_along_rows, ScaleMode* mode) {
  switch (q.tiling) {
    case Tiling::per_tensor: *mode = ScaleMode::per_tensor; return true;
    case Tiling::rows_1xT: *mode = ScaleMode::vec128; return !k_along_rows && q.tile == kTnBlock;
    case Tiling::cols_Tx1: *mode = ScaleMode::vec128; return k_along_rows && q.tile == kTnBlock;
    default: *mode = ScaleMode::blk128; return q.tile == kTnBlock;
  }
}

Fp8GemmPlan::Side plan_side(const QuantView& q, bool k_along_rows, int64_t outer, int64_t outer_p, int64_t K,
                            int64_t K_p, const char* name) {
  Fp8GemmPlan::Side s;
  s.k_along_rows = k_along_rows, s.outer = outer, s.outer_p = outer_p;
  if (!tn_mode_of_view(q, k_along_rows, &s.mode))
    fatal_error(__FILE__, __LINE__,
                detail::concat("the CUDA backend's block-scaled GEMMs need fp8.tile 128 (cuBLASLt's blocks) with "
                               "1 x 128 tiles along K; operand ", name, " is ", to_string(q.tiling), " with tile ",
                               q.tile, k_along_rows ? ", K along its rows" : ", K along its columns"));
  // Already TN and aligned: read in place.
  s.pack_data = !(!k_along_rows && outer_p == outer && K_p == K && alignment_of(q.data) >= kFp8MinAlignment);
  s.data_bytes = s.pack_data ? outer_p * K_p : 0;
  s.pack_scales = s.mode != ScaleMode::per_tensor || alignment_of(q.scale_inv) < kFp8MinAlignment;
  s.scale_count = s.pack_scales ? tn_scale_count(s.mode, outer_p, K_p) : 0;
  return s;
}

// The operand cuBLASLt reads: q in place, or packed into (data, scale).
Fp8Operand operand(const Fp8GemmPlan::Side& s, const QuantView& q, int64_t K_p, uint8_t* data, float* scale,
                   cudaStream_t stream) {
  Fp8Operand op{q.data, s.outer_p, K_p, q.dtype, s.mode, q.scale_inv};
  if (s.pack_data) {
    FP8MOE_ASSERT(data, "gemm_fp8: no scratch for a packed operand");
    pack_kernel<<<grid_for(s.data_bytes), kBlockThreads, 0, stream>>>(q.data, q.rows, q.cols, s.k_along_rows,
                                                                      s.data_bytes, K_p, data);
    check_launch();
    op.data = data;
  }
  if (s.pack_scales) {
    FP8MOE_ASSERT(scale, "gemm_fp8: no scratch for packed scales");
    if (s.mode == ScaleMode::per_tensor) {
      CUDA_CHECK(cudaMemcpyAsync(scale, q.scale_inv, sizeof(float), cudaMemcpyDeviceToDevice, stream));
    } else {
      pack_scales_kernel<<<grid_for(s.scale_count), kBlockThreads, 0, stream>>>(
          q.scale_inv, q.tiling, q.tile, q.rows, q.cols, s.k_along_rows, s.mode, s.outer_p, K_p, s.scale_count, scale);
      check_launch();
    }
    op.scale = scale;
  }
  return op;
}

}  // namespace

std::string fp8_unsupported_reason(bool block_scaling) {
  int dev = 0;
  CUDA_CHECK(cudaGetDevice(&dev));
  // NOTE: a process-wide cache of a fixed property of each device, under a mutex.
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
  if (cc < 89)
    return detail::concat("FP8 GEMMs need compute capability 8.9 or newer; device ", dev, " is ", cc / 10, ".",
                          cc % 10);
  // cuBLASLt offers VEC128_32F / BLK128x128_32F on Hopper only (newer GPUs scale blocks as MXFP8).
  if (block_scaling && cc != 90)
    return detail::concat("block-scaled FP8 GEMMs (1x128 / 128x128 scales) need compute capability 9.0 (Hopper), "
                          "the only one cuBLASLt offers them on; device ", dev, " is ", cc / 10, ".", cc % 10);
  if (block_scaling && cublasLtGetVersion() < 120900)
    return detail::concat("block-scaled FP8 GEMMs need cuBLASLt 12.9 or newer; this is ", cublasLtGetVersion());
  return "";
}

void gemm_fp8_tn(const LtContext& lt, const Fp8Operand& A, const Fp8Operand& B, float alpha, float beta, void* D,
                 int64_t ldd, OutType out, bool fast_accum, cudaStream_t stream) {
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
  call.run(lt, &alpha, B.data, A.data, &beta, D, D, stream, what);
}

Fp8GemmPlan plan_gemm_fp8(const QuantView& A, bool trans_a, const QuantView& B, bool trans_b, const float* C,
                          int64_t ldc) {
  Fp8GemmPlan p;
  p.M = trans_a ? A.cols : A.rows, p.K = trans_a ? A.rows : A.cols;
  p.N = trans_b ? B.rows : B.cols;
  const int64_t Kb = trans_b ? B.cols : B.rows;
  FP8MOE_ASSERT(p.K == Kb, "gemm_fp8: op(A) is ", p.M, " x ", p.K, " but op(B) is ", Kb, " x ", p.N);
  FP8MOE_ASSERT(ldc >= p.N, "gemm_fp8: ldc ", ldc, " < N ", p.N);
  FP8MOE_ASSERT((A.tiling == Tiling::per_tensor) == (B.tiling == Tiling::per_tensor),
                "the CUDA backend's FP8 GEMMs take per-tensor scales on both operands or block scales on both; got ",
                to_string(A.tiling), " x ", to_string(B.tiling));
  p.empty = p.M == 0 || p.N == 0;
  if (p.empty) return p;  // an expert with no tokens
  // K = 0 (the weight gradient of an expert with no tokens): the product is empty, C = beta C;
  // no operand is packed and no GEMM runs.
  p.k_empty = p.K == 0;
  if (p.k_empty) return p;
  const bool block = A.tiling != Tiling::per_tensor;
  p.M_p = round_up(p.M, kPadOuter), p.N_p = round_up(p.N, kPadOuter);
  p.K_p = round_up(std::max<int64_t>(p.K, 1), block ? kTnBlock : kPadK);
  // A is (M, K) as stored unless transposed; B is (K, N) as stored unless transposed.
  p.a = plan_side(A, trans_a, p.M, p.M_p, p.K, p.K_p, "A");
  p.b = plan_side(B, !trans_b, p.N, p.N_p, p.K, p.K_p, "B");
  p.direct_out = p.M_p == p.M && p.N_p == p.N && ldc == p.N && alignment_of(C) >= kFp8MinAlignment;
  p.out_count = p.direct_out ? 0 : p.M_p * p.N_p;
  return p;
}

void gemm_fp8(const LtContext& lt, const Fp8GemmPlan& p, const QuantView& A, const QuantView& B, float alpha,
              float beta, float* C, int64_t ldc, const Fp8GemmScratch& s, bool fast_accum, cudaStream_t stream) {
  if (p.empty) return;
  if (p.k_empty) {
    if (beta != 1.0f) {
      scale_matrix_kernel<<<grid_for(p.M * p.N), kBlockThreads, 0, stream>>>(C, p.M, p.N, ldc, beta);
      CUDA_CHECK(cudaGetLastError());
    }
    return;
  }
  const Fp8Operand a = operand(p.a, A, p.K_p, s.a_data, s.a_scale, stream);
  const Fp8Operand b = operand(p.b, B, p.K_p, s.b_data, s.b_scale, stream);
  if (p.direct_out) {
    gemm_fp8_tn(lt, a, b, alpha, beta, C, p.N, OutType::f32, fast_accum, stream);
    return;
  }
  FP8MOE_ASSERT(s.d, "gemm_fp8: no scratch for the padded output");
  // NOTE: the padded rows and columns of d are never initialised: each output element depends
  // only on its own C element and its row and column of the (zero-padded) operands, and the
  // padding is not copied back.
  const size_t pitch = size_t(p.N_p) * sizeof(float), cpitch = size_t(ldc) * sizeof(float);
  const size_t width = size_t(p.N) * sizeof(float);
  if (beta != 0.0f)
    CUDA_CHECK(cudaMemcpy2DAsync(s.d, pitch, C, cpitch, width, size_t(p.M), cudaMemcpyDeviceToDevice, stream));
  gemm_fp8_tn(lt, a, b, alpha, beta, s.d, p.N_p, OutType::f32, fast_accum, stream);
  CUDA_CHECK(cudaMemcpy2DAsync(C, cpitch, s.d, pitch, width, size_t(p.M), cudaMemcpyDeviceToDevice, stream));
}

namespace {

// Row-major C (M, N) FP32 = alpha op(A) op(B) + beta C, A and B of type `ab` (FP32 or BF16), FP32
// accumulation (no TF32): sgemm and gemm_bf16.
void gemm_row_major(const LtContext& lt, cudaDataType_t ab, const char* what, bool trans_a, bool trans_b, int64_t M,
                    int64_t N, int64_t K, float alpha, const void* A, int64_t lda, const void* B, int64_t ldb,
                    float beta, float* C, int64_t ldc, cudaStream_t stream) {
  if (M == 0 || N == 0) return;
  if (K == 0) {  // cuBLASLt needs K >= 1: C = beta C
    if (beta != 1.0f) {
      scale_matrix_kernel<<<grid_for(M * N), kBlockThreads, 0, stream>>>(C, M, N, ldc, beta);
      check_launch();
    }
    return;
  }
  LtCall call;
  CUBLAS_CHECK(cublasLtMatmulDescCreate(&call.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));  // exact FP32, no TF32
  // Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T: swap the operands.
  call.set(CUBLASLT_MATMUL_DESC_TRANSA, trans_b ? CUBLAS_OP_T : CUBLAS_OP_N);
  call.set(CUBLASLT_MATMUL_DESC_TRANSB, trans_a ? CUBLAS_OP_T : CUBLAS_OP_N);
  // Column-major shapes of the stored matrices: B is (K, N) row-major -> (N, K) col-major when not transposed.
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&call.a, ab, trans_b ? uint64_t(K) : uint64_t(N),
                                          trans_b ? uint64_t(N) : uint64_t(K), ldb));
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&call.b, ab, trans_a ? uint64_t(M) : uint64_t(K),
                                          trans_a ? uint64_t(K) : uint64_t(M), lda));
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&call.c, CUDA_R_32F, uint64_t(N), uint64_t(M), ldc));
  call.d = call.c;
  call.run(lt, &alpha, B, A, &beta, C, C, stream,
           detail::concat(what, " ", M, "x", N, "x", K, trans_a ? " T" : " N", trans_b ? "T" : "N", " lda ", lda,
                          " ldb ", ldb, " ldc ", ldc, beta != 0.0f ? " beta" : ""));
}

}  // namespace

void sgemm(const LtContext& lt, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
           const float* A, int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc,
           cudaStream_t stream) {
  gemm_row_major(lt, CUDA_R_32F, "the FP32 GEMM", trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc,
                 stream);
}

void gemm_bf16(const LtContext& lt, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
               const uint16_t* A, int64_t lda, const uint16_t* B, int64_t ldb, float beta, float* C, int64_t ldc,
               cudaStream_t stream) {
  gemm_row_major(lt, CUDA_R_16BF, "the BF16 GEMM", trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc,
                 stream);
}

void gemm_bf16_tn(const LtContext& lt, const uint16_t* A, const uint16_t* B, uint16_t* D, int64_t M, int64_t N,
                  int64_t K, cudaStream_t stream) {
  if (M == 0 || N == 0) return;
  FP8MOE_ASSERT(K >= 1, "gemm_bf16_tn with K = ", K);
  LtCall call;
  CUBLAS_CHECK(cublasLtMatmulDescCreate(&call.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  call.set(CUBLASLT_MATMUL_DESC_TRANSA, CUBLAS_OP_T);
  call.set(CUBLASLT_MATMUL_DESC_TRANSB, CUBLAS_OP_N);
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&call.a, CUDA_R_16BF, uint64_t(K), uint64_t(N), K));
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&call.b, CUDA_R_16BF, uint64_t(K), uint64_t(M), K));
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&call.c, CUDA_R_16BF, uint64_t(N), uint64_t(M), N));
  call.d = call.c;
  const float alpha = 1.0f, beta = 0.0f;
  call.run(lt, &alpha, B, A, &beta, D, D, stream, detail::concat("the BF16 GEMM TN ", M, "x", N, "x", K));
}

}  // namespace fp8moe::cuda
