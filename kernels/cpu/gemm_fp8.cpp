#include "kernels/gemm_fp8.h"

#include <algorithm>
#include <map>
#include <mutex>
#include <oneapi/dnnl/dnnl.hpp>
#include <vector>

#include "kernels/check.h"
#include "kernels/elementwise.h"
#include "kernels/cpu/fp8_simd.h"

namespace fp8moe {

const char* to_string(GemmPath p) {
  switch (p) {
    case GemmPath::automatic: return "automatic";
    case GemmPath::dequant_bf16: return "dequant_bf16";
    case GemmPath::dequant_fp32: return "dequant_fp32";
    default: return "block_scaled";
  }
}

void sgemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
           const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  if (M == 0 || N == 0) return;
  if (K == 0) {  // the product is empty: C = beta C (an expert without tokens: its weight gradient)
    if (beta == 1.0f) return;
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n) C[m * ldc + n] = beta == 0.0f ? 0.0f : beta * C[m * ldc + n];
    return;
  }
  const dnnl_status_t st = dnnl_sgemm(trans_a ? 'T' : 'N', trans_b ? 'T' : 'N', M, N, K, alpha, A, lda, B, ldb, beta,
                                      C, ldc);
  FP8MOE_ASSERT(st == dnnl_success, "sgemm: oneDNN's dnnl_sgemm failed (status ", int(st), ") for ", M, " x ", N,
                " x ", K, ", lda ", lda, ", ldb ", ldb, ", ldc ", ldc);
}

namespace {

constexpr int kMinExp = -100, kMaxExp = 100;  // scale_inv range that keeps dequantized values normal

// Exponent k of a power-of-two float, or a value outside [kMinExp, kMaxExp] when it is not one.
int pow2_exponent(float s) {
  const uint32_t u = float_bits(s);
  if ((u & 0x807FFFFFu) != 0) return kMaxExp + 1;  // negative, or a mantissa: not 2^k
  return int(u >> 23) - 127;
}

// (rows, cols) of op(X) and where K lies in storage.
struct Operand {
  QuantView q;
  bool trans;
  bool k_along_cols;  // storage dimension that is the reduction dimension
};

void check_tiling(const Operand& op, const char* name) {
  const Tiling t = op.q.tiling;
  const bool ok = t == Tiling::per_tensor || t == Tiling::blocks_TxT ||
                  (t == Tiling::rows_1xT && op.k_along_cols) || (t == Tiling::cols_Tx1 && !op.k_along_cols);
  FP8MOE_ASSERT(ok, "gemm_fp8: operand ", name, " has ", to_string(t), " tiles across the reduction dimension (",
                op.k_along_cols ? "K is its columns" : "K is its rows", "); quantize it with the other tiling");
}

void check_sizes(const QuantTensor& q, const char* name) {
  FP8MOE_ASSERT(q.data.size() == size_t(q.rows * q.cols), "gemm_fp8: operand ", name, " has ", q.data.size(),
                " bytes for shape ", q.rows, " x ", q.cols);
  FP8MOE_ASSERT(q.scale_inv.size() == size_t(q.scale_rows() * q.scale_cols()), "gemm_fp8: operand ", name, " has ",
                q.scale_inv.size(), " scales, its tiling needs ", q.scale_rows() * q.scale_cols());
}

// Dequantize to FP32 (exact for power-of-two scales).
void dequant_fp32(const QuantView& q, std::vector<float>& out) {
  out.resize(size_t(q.rows * q.cols));
  cpu::dequantize(q, out.data());
}

// Dequantize to BF16 bits: BF16 of an FP8 value is its FP32 bits >> 16 (<= 3 mantissa bits), and
// times 2^k only its exponent field changes (values stay normal by the range check). Vectorized
// (kernels/cpu/fp8_simd.h), one run of a shared scale at a time. The output is rows_p x cols_p
// (>= the operand's rows x cols), the padding zero.
void dequant_bf16(const QuantView& q, std::vector<uint16_t>& out, int64_t rows_p, int64_t cols_p) {
  out.resize(size_t(rows_p * cols_p));
  const int64_t cols = q.cols;
  uint16_t* dst_all = out.data();
  const auto zero_pad = [&](int64_t r) {
    std::fill(dst_all + r * cols_p + cols, dst_all + (r + 1) * cols_p, uint16_t(0));
  };
  if (q.tiling == Tiling::cols_Tx1) {
    // A scale per column per band of T rows: a chunk of columns' exponent steps, then its rows.
    // The chunks share a band among the threads (an expert's tokens are often one band).
    constexpr int64_t kChunk = 128;
    const int64_t bands = q.scale_rows(), chunks = (cols + kChunk - 1) / kChunk;
#pragma omp parallel for collapse(2) schedule(static)
    for (int64_t b = 0; b < bands; ++b)
      for (int64_t j = 0; j < chunks; ++j) {
        const int64_t c0 = j * kChunk, w = std::min(cols, c0 + kChunk) - c0;
        int16_t add[kChunk];
        for (int64_t c = 0; c < w; ++c) add[c] = int16_t(pow2_exponent(q.scale_inv[b * cols + c0 + c]) * 128);
        for (int64_t r = b * q.tile; r < std::min(q.rows, (b + 1) * q.tile); ++r) {
          cpu::fp8_to_bf16_span(q.dtype, q.data + r * cols + c0, dst_all + r * cols_p + c0, w, add);
          if (j == chunks - 1) zero_pad(r);
        }
      }
  } else {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < q.rows; ++r) {
      const uint8_t* src = q.data + r * cols;
      uint16_t* dst = dst_all + r * cols_p;
      q.for_each_scale_run(r, [&](int64_t c0, int64_t c1, float s) {
        cpu::fp8_to_bf16_span(q.dtype, src + c0, dst + c0, c1 - c0, pow2_exponent(s));
      });
      zero_pad(r);
    }
  }
  std::fill(dst_all + q.rows * cols_p, dst_all + rows_p * cols_p, uint16_t(0));
}

struct Dnnl {
  dnnl::engine engine{dnnl::engine::kind::cpu, 0};
};
Dnnl& dnnl_ctx() {
  static Dnnl ctx;
  return ctx;
}

// oneDNN's descriptor of a row-major matrix of rows x cols, stored transposed when `trans`.
dnnl::memory::desc matrix_desc(int64_t rows, int64_t cols, bool trans, dnnl::memory::data_type type, int64_t ld) {
  return {{rows, cols}, type, trans ? dnnl::memory::dims{1, ld} : dnnl::memory::dims{ld, 1}};
}

// The BF16 GEMM's dimensions are padded to multiples of kBf16Pad (zero rows and columns in the
// BF16 copies, which are made anyway): oneDNN 2.6's AMX matmul runs whole 32-row tiles several
// times faster than ragged ones (M x N x K = 177 x 512 x 256: 616 us built for that shape, 94 us
// padded to 192 rows, on a 2-core Xeon with AMX), and
// one primitive per padded shape serves the routed experts' token counts, which change every
// micro-batch (a primitive per exact shape cost ~1 ms of JIT each, 160 a step on tiny.yaml).
constexpr int64_t kBf16Pad = 32;
int64_t pad_dim(int64_t n) { return (n + kBf16Pad - 1) / kBf16Pad * kBf16Pad; }

// A BF16 matmul primitive of one (padded) shape, built once.
struct MatmulKey {
  int64_t M, N, K, lda, ldb, ldc;
  bool trans_a, trans_b;
  uint32_t alpha, beta;  // bit patterns
  auto operator<=>(const MatmulKey&) const = default;
};
struct Matmul {
  dnnl::matmul prim;
  std::string impl;
  dnnl::memory::desc scratchpad;  // the caller's (user-managed: threads may run a primitive at once)
};
// A copy (the primitive is a shared handle), so that a clear() by another thread cannot pull it away.
Matmul bf16_matmul_primitive(const MatmulKey& k) {
  static std::mutex mu;
  static std::map<MatmulKey, Matmul> cache;
  std::lock_guard<std::mutex> lock(mu);
  if (auto it = cache.find(k); it != cache.end()) return it->second;
  if (cache.size() >= 4096) cache.clear();  // bounded
  using dnnl::memory;
  const memory::desc a_md = matrix_desc(k.M, k.K, k.trans_a, memory::data_type::bf16, k.lda);
  const memory::desc b_md = matrix_desc(k.K, k.N, k.trans_b, memory::data_type::bf16, k.ldb);
  const memory::desc c_md = matrix_desc(k.M, k.N, false, memory::data_type::f32, k.ldc);
  dnnl::primitive_attr attr;
  // oneDNN's own scratchpad is one for all primitives, not safe from several threads at once; the
  // BF16 GEMMs run inside OpenMP loops (kernels/cpu/attention.cpp), so each call brings its own.
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  if (k.alpha != float_bits(1.0f)) attr.set_output_scales(0, {bits_float(k.alpha)});
  if (k.beta != 0) {
    dnnl::post_ops po;
    po.append_sum(bits_float(k.beta));
    attr.set_post_ops(po);
  }
  const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(a_md, b_md, c_md), attr, dnnl_ctx().engine);
  return cache.emplace(k, Matmul{dnnl::matmul(pd), pd.impl_info_str(), pd.scratchpad_desc()}).first->second;
}

// C (M,N) = alpha op(A) op(B) + beta C with BF16 operands stored as given (strides express the
// transposes; dimensions already padded) and FP32 accumulation and output. Returns oneDNN's
// implementation name.
std::string bf16_matmul(const uint16_t* A, bool trans_a, const uint16_t* B, bool trans_b, int64_t M, int64_t N,
                        int64_t K, float alpha, float beta, float* C, int64_t ldc, int64_t lda = 0, int64_t ldb = 0) {
  using dnnl::memory;
  if (lda == 0) lda = trans_a ? M : K;
  if (ldb == 0) ldb = trans_b ? K : N;
  const MatmulKey key{M, N, K, lda, ldb, ldc, trans_a, trans_b, float_bits(alpha),
                      beta == 0.0f ? 0u : float_bits(beta)};
  // The calling thread's primitive, memory objects (their pointers set per call), scratchpad and
  // stream, made once per shape: the BF16 GEMMs run inside OpenMP loops too, many small ones
  // (kernels/cpu/attention.cpp), where making them per call cost more than the products.
  struct Bound {
    Matmul mm;
    memory a, b, c, sp;
    std::vector<uint8_t> scratch;
  };
  thread_local std::map<MatmulKey, Bound> bound;
  thread_local dnnl::stream stream{dnnl_ctx().engine};
  auto it = bound.find(key);
  if (it == bound.end()) {
    if (bound.size() >= 1024) bound.clear();  // bounded
    const dnnl::engine& e = dnnl_ctx().engine;
    Bound nb{bf16_matmul_primitive(key), memory(matrix_desc(M, K, trans_a, memory::data_type::bf16, lda), e, nullptr),
             memory(matrix_desc(K, N, trans_b, memory::data_type::bf16, ldb), e, nullptr),
             memory(matrix_desc(M, N, false, memory::data_type::f32, ldc), e, nullptr), memory(), {}};
    nb.scratch.resize(nb.mm.scratchpad.get_size());
    nb.sp = memory(nb.mm.scratchpad, e, nb.scratch.data());
    it = bound.emplace(key, std::move(nb)).first;
  }
  Bound& m = it->second;
  m.a.set_data_handle(const_cast<uint16_t*>(A));
  m.b.set_data_handle(const_cast<uint16_t*>(B));
  m.c.set_data_handle(C);
  m.mm.prim.execute(stream,
                    {{DNNL_ARG_SRC, m.a}, {DNNL_ARG_WEIGHTS, m.b}, {DNNL_ARG_DST, m.c}, {DNNL_ARG_SCRATCHPAD, m.sp}});
  stream.wait();
  return m.mm.impl;
}

// Scale of operand X at reduction index k (a multiple of the block) and output index i.
float scale_at(const Operand& op, int64_t k, int64_t i) {
  const int64_t r = op.k_along_cols ? i : k, c = op.k_along_cols ? k : i;
  return op.q.scale_inv[size_t(op.q.scale_index(r, c))];
}

void block_scaled(const Operand& a, const Operand& b, int64_t M, int64_t N, int64_t K, float alpha, float beta,
                  float* C, int64_t ldc) {
  const int ta = a.q.tiling == Tiling::per_tensor ? 0 : a.q.tile;
  const int tb = b.q.tiling == Tiling::per_tensor ? 0 : b.q.tile;
  FP8MOE_ASSERT(ta == 0 || tb == 0 || ta == tb, "gemm_fp8 block_scaled: tiles of A (", ta, ") and B (", tb,
                ") must be equal so that their K blocks line up");
  const int64_t T = ta ? ta : (tb ? tb : std::max<int64_t>(K, 1));

  thread_local std::vector<float> araw, braw, part;
  const float* fa = fp8_decode_table(a.q.dtype);
  const float* fb = fp8_decode_table(b.q.dtype);
  araw.resize(size_t(a.q.rows * a.q.cols));
  braw.resize(size_t(b.q.rows * b.q.cols));
  for (size_t i = 0; i < araw.size(); ++i) araw[i] = fa[a.q.data[i]];
  for (size_t i = 0; i < braw.size(); ++i) braw[i] = fb[b.q.data[i]];
  part.resize(size_t(M * N));

  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) C[m * ldc + n] = beta == 0.0f ? 0.0f : beta * C[m * ldc + n];
  std::vector<float> sa(static_cast<size_t>(M)), sb(static_cast<size_t>(N));
  const int64_t lda = a.q.cols, ldb = b.q.cols;
  for (int64_t k0 = 0; k0 < K; k0 += T) {
    const int64_t kt = std::min(T, K - k0);
    // Raw FP8 values of this K block: products exact, sums in FP32.
    const float* ap = a.k_along_cols ? araw.data() + k0 : araw.data() + k0 * lda;
    const float* bp = b.k_along_cols ? braw.data() + k0 : braw.data() + k0 * ldb;
    sgemm(a.trans, b.trans, M, N, kt, 1.0f, ap, lda, bp, ldb, 0.0f, part.data(), N);
    for (int64_t m = 0; m < M; ++m) sa[m] = alpha * scale_at(a, k0, m);
    for (int64_t n = 0; n < N; ++n) sb[n] = scale_at(b, k0, n);
    // NOTE: plain pointers, not the thread_local vectors: OpenMP workers have their own (empty) ones.
    const float *P = part.data(), *SA = sa.data(), *SB = sb.data();
#pragma omp parallel for schedule(static)
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n) C[m * ldc + n] += (SA[m] * SB[n]) * P[m * N + n];
  }
}

}  // namespace

bool has_exact_pow2_scales(const QuantView& q) {
  return std::all_of(q.scale_inv, q.scale_inv + q.scale_count(), [](float s) {
    const int k = pow2_exponent(s);
    return k >= kMinExp && k <= kMaxExp;
  });
}
bool has_exact_pow2_scales(const QuantTensor& q) { return has_exact_pow2_scales(q.view()); }

bool cpu_has_bf16_gemm() {
  // oneDNN's ISA values are bit sets in which each ISA contains the ones it extends.
  const auto isa = static_cast<unsigned>(dnnl::get_effective_cpu_isa());
  const auto bf16 = static_cast<unsigned>(dnnl::cpu_isa::avx512_core_bf16);
  return (isa & bf16) == bf16;
}

std::string cpu_isa_name() {
  switch (dnnl::get_effective_cpu_isa()) {
    case dnnl::cpu_isa::avx512_core_amx: return "avx512_core_amx";
    case dnnl::cpu_isa::avx512_core_bf16: return "avx512_core_bf16";
    case dnnl::cpu_isa::avx512_core_vnni: return "avx512_core_vnni";
    case dnnl::cpu_isa::avx512_core: return "avx512_core";
    case dnnl::cpu_isa::avx2_vnni: return "avx2_vnni";
    case dnnl::cpu_isa::avx2: return "avx2";
    default: return "older than avx2";
  }
}

void gemm_fp8(const QuantTensor& A, bool trans_a, const QuantTensor& B, bool trans_b, float alpha, float beta,
              float* C, int64_t ldc, GemmPath path, GemmInfo* info) {
  check_sizes(A, "A");
  check_sizes(B, "B");
  gemm_fp8(A.view(), trans_a, B.view(), trans_b, alpha, beta, C, ldc, path, info);
}

void gemm_fp8(const QuantView& A, bool trans_a, const QuantView& B, bool trans_b, float alpha, float beta, float* C,
              int64_t ldc, GemmPath path, GemmInfo* info) {
  const int64_t M = trans_a ? A.cols : A.rows, K = trans_a ? A.rows : A.cols;
  const int64_t N = trans_b ? B.rows : B.cols, Kb = trans_b ? B.cols : B.rows;
  FP8MOE_ASSERT(K == Kb, "gemm_fp8: op(A) is ", M, " x ", K, " but op(B) is ", Kb, " x ", N);
  FP8MOE_ASSERT(ldc >= N, "gemm_fp8: ldc ", ldc, " < N ", N);
  const Operand a{A, trans_a, !trans_a}, b{B, trans_b, trans_b};
  check_tiling(a, "A");
  check_tiling(b, "B");

  const bool exact_pow2 = has_exact_pow2_scales(A) && has_exact_pow2_scales(B);
  if (path == GemmPath::automatic)
    path = !exact_pow2 ? GemmPath::block_scaled : cpu_has_bf16_gemm() ? GemmPath::dequant_bf16 : GemmPath::dequant_fp32;
  FP8MOE_ASSERT(exact_pow2 || path == GemmPath::block_scaled, "gemm_fp8: path ", to_string(path),
                " needs power-of-two scales in [2^-100, 2^100]");
  if (info) info->path = path;
  if (M == 0 || N == 0) return;  // an expert with no tokens
  if (K == 0) {
    sgemm(false, false, M, N, 0, alpha, nullptr, 1, nullptr, 1, beta, C, ldc);
    return;
  }

  switch (path) {
    case GemmPath::dequant_bf16: {
      // Zero-padded BF16 copies (pad_dim): the padding adds exact zeros to every sum, and rows and
      // columns of the product that are not kept.
      thread_local std::vector<uint16_t> a16, b16;
      thread_local std::vector<float> c32;
      const int64_t Mp = pad_dim(M), Np = pad_dim(N), Kp = pad_dim(K);
      dequant_bf16(A, a16, trans_a ? Kp : Mp, trans_a ? Mp : Kp);
      dequant_bf16(B, b16, trans_b ? Np : Kp, trans_b ? Kp : Np);
      std::string impl;
      if (Mp == M && Np == N) {
        impl = bf16_matmul(a16.data(), trans_a, b16.data(), trans_b, M, N, Kp, alpha, beta, C, ldc);
      } else {
        // Into a padded scratch, then its M x N corner into C (plus beta C).
        c32.resize(size_t(Mp * Np));
        impl = bf16_matmul(a16.data(), trans_a, b16.data(), trans_b, Mp, Np, Kp, alpha, 0.0f, c32.data(), Np);
        const float* P = c32.data();
#pragma omp parallel for schedule(static)
        for (int64_t m = 0; m < M; ++m)
          for (int64_t n = 0; n < N; ++n)
            C[m * ldc + n] = beta == 0.0f ? P[m * Np + n] : P[m * Np + n] + beta * C[m * ldc + n];
      }
      if (info) info->impl = "oneDNN " + impl;
      break;
    }
    case GemmPath::dequant_fp32: {
      thread_local std::vector<float> a32, b32;
      dequant_fp32(A, a32);
      dequant_fp32(B, b32);
      sgemm(trans_a, trans_b, M, N, K, alpha, a32.data(), A.cols, b32.data(), B.cols, beta, C, ldc);
      if (info) info->impl = "oneDNN sgemm";
      break;
    }
    default:
      block_scaled(a, b, M, N, K, alpha, beta, C, ldc);
      if (info) info->impl = "oneDNN sgemm per K block";
  }
}

void gemm_bf16(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const uint16_t* A,
               int64_t lda, const uint16_t* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  if (M == 0 || N == 0) return;
  static const bool bf16_hardware = cpu_has_bf16_gemm();
  if (K > 0 && bf16_hardware) {
    bf16_matmul(A, trans_a, B, trans_b, M, N, K, alpha, beta, C, ldc, lda, ldb);
    return;
  }
  // No BF16 hardware (or an empty product, C = beta C): the operands widened (exactly) and sgemm.
  // The stored matrices: A (M, K) or, transposed, (K, M); B (K, N) or (N, K); rows of ld elements,
  // the last one only as long as its columns.
  auto widen = [](const uint16_t* x, int64_t rows, int64_t cols, int64_t ld) {
    std::vector<float> w(rows > 0 ? size_t((rows - 1) * ld + cols) : 0);
    if (!w.empty()) cpu::from_bf16(x, w.data(), int64_t(w.size()));
    return w;
  };
  const std::vector<float> a = widen(A, trans_a ? K : M, trans_a ? M : K, lda);
  const std::vector<float> b = widen(B, trans_b ? N : K, trans_b ? K : N, ldb);
  sgemm(trans_a, trans_b, M, N, K, alpha, a.data(), lda, b.data(), ldb, beta, C, ldc);
}

}  // namespace fp8moe
