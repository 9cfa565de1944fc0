// The grouped block-scaled FP8 GEMM of kernels/cuda/grouped_gemm.h on CUTLASS 4.2 (Hopper, sm_90a):
// the kernel configuration follows CUTLASS's example 68 (128 x 128 x 128 tiles, clusters of 2
// along N, the cooperative ptr-array schedule with FP8 block scaling), with FP32 row-major output.
// A setup kernel turns the device offsets into CUTLASS's per-group arrays (problem sizes,
// pointers, strides, scale layouts) and two packing kernels move the scales into the layouts it
// reads (MN-major on Hopper): the host computes nothing from the offsets and never waits.
#include "kernels/cuda/grouped_gemm.h"

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/epilogue/dispatch_policy.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>
#include <cutlass/numeric_types.h>
#include <cutlass/util/packed_stride.hpp>

#include <algorithm>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "kernels/check.h"
#include "kernels/cuda/launch.cuh"

namespace fp8moe::cuda {
namespace {

using namespace cute;

constexpr int64_t kBlock = 128;

#if defined(CUTLASS_ARCH_MMA_SM90_SUPPORTED) && defined(CUTLASS_ARCH_MMA_MODIFIABLE_TMA_SM90_SUPPORTED)
#define FP8MOE_GROUPED_GEMM 1
#endif

using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;  // (M, N, K) per group
using Shape3 = typename ProblemShape::UnderlyingProblemShape;

// The two kernel instances (kernels/cuda/grouped_gemm_kernel.inc, included once per scale
// granularity along N, at namespace scope: nvcc's host pass rejects these CUTLASS builders inside a
// class template): 128 (B in 128 x 128 blocks: forward and dgrad) and 1 (B in 1 x 128 tiles along
// K: the weight gradient's x, tiled along tokens). A is 1 x 128 in both.
#define FP8MOE_GROUPED_NS blocks
#define FP8MOE_GROUPED_SCALE_N 128
#include "kernels/cuda/grouped_gemm_kernel.inc"
#undef FP8MOE_GROUPED_NS
#undef FP8MOE_GROUPED_SCALE_N
#define FP8MOE_GROUPED_NS tiles
#define FP8MOE_GROUPED_SCALE_N 1
#include "kernels/cuda/grouped_gemm_kernel.inc"
#undef FP8MOE_GROUPED_NS
#undef FP8MOE_GROUPED_SCALE_N
using Blocks = blocks::Kernel;  // forward, dgrad
using Tiles = tiles::Kernel;    // wgrad

size_t align256(size_t n) { return (n + 255) / 256 * 256; }

__host__ __device__ inline int64_t round16(int64_t n) { return (n + 15) / 16 * 16; }

// Carves the arrays out of `base` (nullptr: only counts); returns the bytes used before the workspace.
template <class Kn>
size_t carve(const GroupedGemmFp8& p, char* base, typename Kn::Arrays* g) {
  const bool wgrad = p.form == GroupedGemm::wgrad;
  const size_t G = size_t(p.groups), kb = size_t(p.K / kBlock), nb = size_t(p.N / kBlock);
  const size_t padded_rows = size_t(p.rows) + 15 * G;  // every group's tokens rounded up to 16
  size_t at = 0;
  auto take = [&](auto*& ptr, size_t count) {
    using T = std::remove_pointer_t<std::remove_reference_t<decltype(ptr)>>;
    ptr = base ? reinterpret_cast<T*>(base + at) : nullptr;
    at += align256(count * sizeof(T));
  };
  take(g->problem, G);
  take(g->a, G), take(g->b, G), take(g->c, G), take(g->d, G), take(g->sfa, G), take(g->sfb, G);
  take(g->stride_a, G), take(g->stride_b, G), take(g->stride_c, G), take(g->stride_d, G);
  take(g->layout_sfa, G), take(g->layout_sfb, G);
  take(g->packed_sfa, wgrad ? 0 : size_t(p.rows) * kb);
  take(g->packed_sfb, p.form == GroupedGemm::forward ? G * nb * kb : 0);
  take(g->t_a, wgrad ? padded_rows * size_t(p.N) : 0);
  take(g->t_b, wgrad ? padded_rows * size_t(p.K) : p.form == GroupedGemm::dgrad ? G * size_t(p.N) * size_t(p.K) : 0);
  g->workspace = base ? base + at : nullptr;
  return at;
}

#ifdef FP8MOE_GROUPED_GEMM
// One thread per group: its problem size, pointers, strides and scale layouts from the offsets.
template <class Kn>
__global__ void setup_kernel(GroupedGemmFp8 p, typename Kn::Arrays g) {
  const int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e >= p.groups) return;
  const int64_t r0 = p.row_offsets[e], rows = p.row_offsets[e + 1] - r0;
  const int64_t kb = p.K / kBlock, nb = p.N / kBlock;
  int M = int(rows), N = int(p.N), K = int(p.K);
  if (p.form == GroupedGemm::wgrad) {  // D_g (N, K) += dy_g^T x_g: the tokens are the reduction
    // No tokens: no tiles at all (M = 0), not tiles of an empty reduction, whose accumulators the
    // kernel would never clear.
    M = rows > 0 ? int(p.N) : 0, N = int(p.K), K = int(round16(rows));
    const int64_t slot = r0 + 15 * e;
    g.a[e] = reinterpret_cast<const typename Kn::ElementA*>(g.t_a + slot * p.N);
    g.b[e] = reinterpret_cast<const typename Kn::ElementB*>(g.t_b + slot * p.K);
    g.sfa[e] = p.a_scale[e];  // (ceil(T_g / 128), N): M contiguous, CUTLASS's layout
    g.sfb[e] = p.b_scale[e];  // (ceil(T_g / 128), K): N contiguous, likewise
  } else {
    g.a[e] = reinterpret_cast<const typename Kn::ElementA*>(p.A[e]);
    g.sfa[e] = g.packed_sfa + r0 * kb;
    if (p.form == GroupedGemm::dgrad) {
      g.b[e] = reinterpret_cast<const typename Kn::ElementB*>(g.t_b + e * p.N * p.K);
      g.sfb[e] = p.b_scale[e];  // (K/128, N/128) row-major: N contiguous, CUTLASS's layout
    } else {
      g.b[e] = reinterpret_cast<const typename Kn::ElementB*>(p.B[e]);
      g.sfb[e] = g.packed_sfb + e * nb * kb;
    }
  }
  g.c[e] = p.D[e];
  g.d[e] = p.D[e];
  g.problem[e] = Shape3(M, N, K);
  g.stride_a[e] = cutlass::make_cute_packed_stride(typename Kn::StrideA{}, {M, K, 1});
  g.stride_b[e] = cutlass::make_cute_packed_stride(typename Kn::StrideB{}, {N, K, 1});
  g.stride_c[e] = cutlass::make_cute_packed_stride(typename Kn::StrideC{}, {M, N, 1});
  g.stride_d[e] = cutlass::make_cute_packed_stride(typename Kn::StrideD{}, {M, N, 1});
  g.layout_sfa[e] = Kn::ScaleConfig::tile_atom_to_shape_SFA(make_shape(M, N, K, 1));
  g.layout_sfb[e] = Kn::ScaleConfig::tile_atom_to_shape_SFB(make_shape(M, N, K, 1));
}

// A's scales: per group (M_g, K/128) row-major -> (K/128, M_g), M contiguous, group g at
// row_offsets[g] * K/128.
__global__ void pack_sfa_kernel(GroupedGemmFp8 p, float* out) {
  const int64_t kb = p.K / kBlock, n = p.rows * kb;
  FP8MOE_GRID_STRIDE(i, n) {
    const int64_t r = i / kb, k = i % kb;
    int64_t lo = 0, hi = p.groups;  // the group holding row r: row_offsets[lo] <= r < row_offsets[lo + 1]
    while (hi - lo > 1) {
      const int64_t mid = (lo + hi) / 2;
      if (p.row_offsets[mid] <= r) lo = mid; else hi = mid;
    }
    const int64_t r0 = p.row_offsets[lo], M = p.row_offsets[lo + 1] - r0;
    out[r0 * kb + k * M + (r - r0)] = p.a_scale[lo][(r - r0) * kb + k];
  }
}

// B's scales: per group (N/128, K/128) row-major -> (K/128, N/128), N contiguous.
__global__ void pack_sfb_kernel(GroupedGemmFp8 p, float* out) {
  const int64_t kb = p.K / kBlock, nb = p.N / kBlock, n = p.groups * nb * kb;
  FP8MOE_GRID_STRIDE(i, n) {
    const int64_t e = i / (nb * kb), j = i % (nb * kb), nr = j / kb, k = j % kb;
    out[e * nb * kb + k * nb + nr] = p.b_scale[e][nr * kb + k];
  }
}

// Group z's (R_z, C) row-major bytes -> (C, ld_z) row-major, zero in columns R_z .. ld_z, through
// 32 x 32 tiles in shared memory (both sides coalesced). dgrad: every group (K, N) -> (N, K) at
// z N K; wgrad: (T_z, C) -> (C, round16(T_z)) at (offsets[z] + 15 z) C.
constexpr int kTransposeTile = 32, kTransposeRows = 8;
__global__ void transpose_kernel(const uint8_t* const* in, const int64_t* row_offsets, int64_t fixed_rows, int64_t C,
                                 uint8_t* out) {
  __shared__ uint8_t tile[kTransposeTile][kTransposeTile + 1];
  const int64_t z = blockIdx.z;
  const int64_t R = row_offsets ? row_offsets[z + 1] - row_offsets[z] : fixed_rows;
  const int64_t ld = row_offsets ? round16(R) : R;
  const int64_t r0 = int64_t(blockIdx.y) * kTransposeTile, c0 = int64_t(blockIdx.x) * kTransposeTile;
  if (r0 >= ld) return;
  const uint8_t* src = in[z];
  uint8_t* dst = out + (row_offsets ? (row_offsets[z] + 15 * z) * C : z * fixed_rows * C);
  for (int j = threadIdx.y; j < kTransposeTile; j += kTransposeRows)
    tile[j][threadIdx.x] = (r0 + j < R && c0 + threadIdx.x < C) ? src[(r0 + j) * C + c0 + threadIdx.x] : uint8_t(0);
  __syncthreads();
  for (int j = threadIdx.y; j < kTransposeTile; j += kTransposeRows)
    if (c0 + j < C && r0 + threadIdx.x < ld) dst[(c0 + j) * ld + r0 + threadIdx.x] = tile[threadIdx.x][j];
}

void transpose(const uint8_t* const* in, const int64_t* row_offsets, int64_t rows, int64_t C, int64_t groups,
               uint8_t* out, cudaStream_t stream) {
  FP8MOE_ASSERT(groups <= 65535 && (rows + kTransposeTile - 1) / kTransposeTile <= 65535,
                "grouped FP8 GEMM: a transpose of ", groups, " groups of up to ", rows, " rows in one launch");
  const dim3 grid(unsigned((C + kTransposeTile - 1) / kTransposeTile),
                  unsigned((rows + kTransposeTile - 1) / kTransposeTile), unsigned(groups));
  transpose_kernel<<<grid, dim3(kTransposeTile, kTransposeRows), 0, stream>>>(in, row_offsets, rows, C, out);
  check_launch();
}

template <class Kn>
cutlass::KernelHardwareInfo hardware_info(int device) {
  // NOTE: a process-wide cache of a fixed property of each device (its SM count and how many
  // clusters of this kernel fit), under a mutex.
  static std::mutex mutex;
  static std::map<int, cutlass::KernelHardwareInfo> cache;
  const std::lock_guard<std::mutex> lock(mutex);
  auto it = cache.find(device);
  if (it == cache.end())
    it = cache.emplace(device, cutlass::KernelHardwareInfo::make_kernel_hardware_info<typename Kn::GemmKernel>(device)).first;
  return it->second;
}

template <class Kn>
typename Kn::Gemm::Arguments arguments(const GroupedGemmFp8& p, const typename Kn::Arrays& g, int device) {
  typename Kn::Gemm::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGrouped,
      {int(p.groups), g.problem, nullptr},  // problem sizes in device memory only
      {g.a, g.stride_a, g.b, g.stride_b, g.sfa, g.layout_sfa, g.sfb, g.layout_sfb},
      {{}, g.c, g.stride_c, g.d, g.stride_d},
      hardware_info<Kn>(device)};
  auto& f = args.epilogue.thread;
  f.alpha = p.alpha, f.beta = p.beta;
  f.alpha_ptr = nullptr, f.beta_ptr = nullptr, f.alpha_ptr_array = nullptr, f.beta_ptr_array = nullptr;
  f.dAlpha = {cute::_0{}, cute::_0{}, 0};
  f.dBeta = {cute::_0{}, cute::_0{}, 0};
  return args;
}

const char* status_text(cutlass::Status s) { return cutlassGetStatusString(s); }

template <class Kn>
size_t scratch_bytes(const GroupedGemmFp8& p, int device) {
  typename Kn::Arrays g{};
  const size_t arrays = carve<Kn>(p, nullptr, &g);
  return arrays + align256(Kn::Gemm::get_workspace_size(arguments<Kn>(p, g, device)));
}

template <class Kn>
void run(const GroupedGemmFp8& p, void* scratch, size_t bytes, int device, cudaStream_t stream) {
  const size_t need = scratch_bytes<Kn>(p, device);
  FP8MOE_ASSERT(scratch && bytes >= need, "grouped FP8 GEMM: scratch of ", bytes, " bytes, ", need, " needed");
  typename Kn::Arrays g{};
  carve<Kn>(p, static_cast<char*>(scratch), &g);
  const int64_t kb = p.K / kBlock;
  if (p.form == GroupedGemm::wgrad) {
    // The tokens become K: both operands transposed, each group's rows padded to 16 (zeros).
    transpose(p.A, p.row_offsets, p.max_rows, p.N, p.groups, g.t_a, stream);
    transpose(p.B, p.row_offsets, p.max_rows, p.K, p.groups, g.t_b, stream);
  } else {
    pack_sfa_kernel<<<grid_for(p.rows * kb), kBlockThreads, 0, stream>>>(p, g.packed_sfa);
    check_launch();
    if (p.form == GroupedGemm::dgrad)
      transpose(p.B, nullptr, p.K, p.N, p.groups, g.t_b, stream);
    else {
      pack_sfb_kernel<<<grid_for(p.groups * (p.N / kBlock) * kb), kBlockThreads, 0, stream>>>(p, g.packed_sfb);
      check_launch();
    }
  }
  setup_kernel<Kn><<<grid_for(p.groups), kBlockThreads, 0, stream>>>(p, g);
  check_launch();
  typename Kn::Gemm gemm;
  const typename Kn::Gemm::Arguments args = arguments<Kn>(p, g, device);
  if (const cutlass::Status s = gemm.can_implement(args); s != cutlass::Status::kSuccess)
    fatal_error(__FILE__, __LINE__, std::string("grouped FP8 GEMM: CUTLASS cannot run it: ") + status_text(s));
  if (const cutlass::Status s = gemm.initialize(args, g.workspace, stream); s != cutlass::Status::kSuccess)
    fatal_error(__FILE__, __LINE__, std::string("grouped FP8 GEMM: initialize: ") + status_text(s));
  if (const cutlass::Status s = gemm.run(stream); s != cutlass::Status::kSuccess)
    fatal_error(__FILE__, __LINE__, std::string("grouped FP8 GEMM: run: ") + status_text(s));
  check_launch();
}
#endif

void check_shape(const GroupedGemmFp8& p) {
  FP8MOE_ASSERT(p.groups >= 0 && p.rows >= 0 && p.N > 0 && p.K > 0, "grouped FP8 GEMM: groups ", p.groups, ", rows ",
                p.rows, ", N ", p.N, ", K ", p.K);
  FP8MOE_ASSERT(p.N % kBlock == 0 && p.K % kBlock == 0, "grouped FP8 GEMM: N ", p.N, " and K ", p.K,
                " must be multiples of 128 (the weight blocks)");
  FP8MOE_ASSERT(p.form != GroupedGemm::wgrad || p.max_rows >= 0, "grouped FP8 GEMM: wgrad needs max_rows");
}

// ---- the shape check of each entry point (host code, no device) ---------------------------------

// "e4m3 in 1x128 tiles", "per-tensor e5m2", ...
std::string describe(Fp8Dtype dtype, Tiling t, int tile) {
  if (t == Tiling::per_tensor) return detail::concat("per-tensor ", to_string(dtype));
  const std::string T = std::to_string(tile);
  const std::string shape = t == Tiling::rows_1xT ? "1x" + T : t == Tiling::cols_Tx1 ? T + "x1" : T + "x" + T;
  return detail::concat(to_string(dtype), " in ", shape, t == Tiling::blocks_TxT ? " blocks" : " tiles");
}

// Why operand `name` of every group is not E4M3 in 128-wide tiles of tiling t ("" when it is).
std::string tiling_reason(const char* name, const std::vector<QuantView>& q, Tiling t) {
  for (const QuantView& v : q)
    if (v.tiling != t || v.tile != kBlock || v.dtype != Fp8Dtype::e4m3)
      return detail::concat(name, " is ", describe(v.dtype, v.tiling, v.tile), " (the kernel takes ",
                            describe(Fp8Dtype::e4m3, t, int(kBlock)), ")");
  return "";
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Why the kernel cannot take W's dimensions (N, K) or the output's row stride ld (the output `out`
// is out_cols wide); the loop takes any.
std::string dims_reason(int64_t N, int64_t K, int64_t ld, const char* out, int64_t out_cols) {
  if (N % kBlock || K % kBlock)
    return detail::concat("N ", N, " and K ", K, " must be multiples of 128 (the weight blocks)");
  if (ld != out_cols) return detail::concat(out, "'s row stride ", ld, " is not its width ", out_cols);
  return "";
}

// forward Y_g = X_g W_g^T, X_g (M_g, K), and dgrad dX_g = dY_g W_g, dY_g (M_g, N): A in 1 x 128
// tiles along its width (the reduction), W (N, K) in 128 x 128 blocks, one shape for every group.
std::string by_rows_reason(GroupedGemm e, const std::vector<QuantView>& A, const std::vector<QuantView>& W,
                           const std::vector<float*>& C, int64_t ld) {
  const bool fwd = e == GroupedGemm::forward;
  const char* a = fwd ? "X" : "dY";
  if (std::string r = tiling_reason(a, A, Tiling::rows_1xT); !r.empty()) return r;
  if (std::string r = tiling_reason("W", W, Tiling::blocks_TxT); !r.empty()) return r;
  const int64_t N = W[0].rows, K = W[0].cols;
  if (std::string r = dims_reason(N, K, ld, fwd ? "Y" : "dX", fwd ? N : K); !r.empty()) return r;
  for (size_t g = 0; g < A.size(); ++g) {
    if (W[g].rows != N || W[g].cols != K) return "the experts' weights differ in shape";
    if (A[g].cols != (fwd ? K : N)) return detail::concat(a, "'s width is not W's ", fwd ? "K" : "N");
    if ((A[g].rows > 0 && !aligned16(A[g].data)) || !aligned16(W[g].data) || !aligned16(C[g]))
      return detail::concat(a, ", W or ", fwd ? "Y" : "dX", " not 16-byte aligned");
  }
  return "";
}

// wgrad dW_g += dY_g^T X_g: dY_g (T_g, N) and X_g (T_g, K) in 128 x 1 tiles along the tokens.
std::string wgrad_reason(const std::vector<QuantView>& dY, const std::vector<QuantView>& X,
                         const std::vector<float*>& dW, int64_t ld) {
  if (std::string r = tiling_reason("dY", dY, Tiling::cols_Tx1); !r.empty()) return r;
  if (std::string r = tiling_reason("X", X, Tiling::cols_Tx1); !r.empty()) return r;
  const int64_t N = dY[0].cols, K = X[0].cols;
  if (std::string r = dims_reason(N, K, ld, "dW", K); !r.empty()) return r;
  for (size_t g = 0; g < dY.size(); ++g) {  // each expert's own tokens: the rows differ
    if (dY[g].cols != N || X[g].cols != K) return "the experts' dY or X differ in width";
    if (dY[g].rows != X[g].rows) return "an expert's dY and X differ in tokens";
    if (!aligned16(dW[g])) return "dW not 16-byte aligned";
  }
  return "";
}

}  // namespace

std::string grouped_gemm_unsupported_reason(GroupedGemm e, const std::vector<QuantView>& A,
                                            const std::vector<QuantView>& B, const std::vector<float*>& C,
                                            int64_t ld) {
  check_grouped_operands(e, A, B, C);
  if (A.empty()) return "no groups";
  return e == GroupedGemm::wgrad ? wgrad_reason(A, B, C, ld) : by_rows_reason(e, A, B, C, ld);
}

GroupedGemmCall grouped_gemm_call(GroupedGemm e, const std::vector<QuantView>& A, const std::vector<QuantView>& B,
                                  const std::vector<float*>& C) {
  check_grouped_operands(e, A, B, C);
  std::vector<size_t> live;
  int64_t max_rows = 0;
  for (size_t g = 0; g < A.size(); ++g)
    if (A[g].rows > 0) live.push_back(g), max_rows = std::max(max_rows, A[g].rows);
  GroupedGemmCall call;
  GroupedGemmFp8& p = call.p;
  p.form = e, p.groups = int64_t(live.size()), p.max_rows = max_rows;
  // forward and dgrad write their output, wgrad adds into it (kernels/grouped_gemm.h).
  p.alpha = 1.0f, p.beta = e == GroupedGemm::wgrad ? 1.0f : 0.0f;
  if (live.empty()) return call;
  const int64_t G = p.groups;
  call.args.resize(size_t(G + 1 + 5 * G));
  uint64_t* off = call.args.data();
  uint64_t* ptr = off + G + 1;  // A, a_scale, B, b_scale, D: G each
  off[0] = 0;
  for (int64_t i = 0; i < G; ++i) {
    const size_t g = live[size_t(i)];
    off[i + 1] = off[i] + uint64_t(A[g].rows);
    ptr[i] = reinterpret_cast<uintptr_t>(A[g].data);
    ptr[G + i] = reinterpret_cast<uintptr_t>(A[g].scale_inv);
    ptr[2 * G + i] = reinterpret_cast<uintptr_t>(B[g].data);
    ptr[3 * G + i] = reinterpret_cast<uintptr_t>(B[g].scale_inv);
    ptr[4 * G + i] = reinterpret_cast<uintptr_t>(C[g]);
  }
  p.rows = int64_t(off[G]);
  // The kernel's N (each D_g's columns) and K: forward B = W (N, K); dgrad B = W (N, K) read as
  // stored, so D_g = dX_g (M_g, W's K) reduces over W's N; wgrad A = dY (T_g, N), B = X (T_g, K).
  const QuantView &a = A[live[0]], &b = B[live[0]];
  p.N = e == GroupedGemm::forward ? b.rows : e == GroupedGemm::dgrad ? b.cols : a.cols;
  p.K = e == GroupedGemm::dgrad ? b.rows : b.cols;
  return call;
}

void point_at(GroupedGemmFp8* p, const uint64_t* d) {
  const int64_t G = p->groups;
  p->row_offsets = reinterpret_cast<const int64_t*>(d);
  p->A = reinterpret_cast<const uint8_t* const*>(d + G + 1);
  p->a_scale = reinterpret_cast<const float* const*>(d + G + 1 + G);
  p->B = reinterpret_cast<const uint8_t* const*>(d + G + 1 + 2 * G);
  p->b_scale = reinterpret_cast<const float* const*>(d + G + 1 + 3 * G);
  p->D = reinterpret_cast<float* const*>(d + G + 1 + 4 * G);
}

std::string grouped_gemm_unsupported_reason(int device) {
#if !FP8MOE_SM90A
  // NOTE: without an sm_90a target the kernel body is CUTLASS's "arch conditional MMA" stub, which
  // returns without writing D: refuse instead.
  (void)device;
  return "built without an sm_90a target (CMAKE_CUDA_ARCHITECTURES has no 90a): CUTLASS's FP8 kernels need it";
#elif defined(FP8MOE_GROUPED_GEMM)
  int major = 0, minor = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
    (void)cudaGetLastError();
    return "cannot read the compute capability of device " + std::to_string(device);
  }
  if (major != 9 || minor != 0)
    return "CUTLASS's grouped block-scaled FP8 GEMM is built for sm_90a (Hopper); device " + std::to_string(device) +
           " is sm_" + std::to_string(major * 10 + minor);
  return "";
#else
  (void)device;
  return "built without CUTLASS's SM90 tensor-map support (nvcc older than 12.3 or no sm_90a target)";
#endif
}

size_t grouped_gemm_fp8_scratch_bytes(const GroupedGemmFp8& p, int device) {
  check_shape(p);
#ifdef FP8MOE_GROUPED_GEMM
  return p.form == GroupedGemm::wgrad ? scratch_bytes<Tiles>(p, device) : scratch_bytes<Blocks>(p, device);
#else
  (void)device;
  return 0;
#endif
}

void grouped_gemm_fp8(const GroupedGemmFp8& p, void* scratch, size_t scratch_bytes, int device, cudaStream_t stream) {
  check_shape(p);
  if (p.groups == 0 || p.rows == 0) return;  // nothing to write
#ifdef FP8MOE_GROUPED_GEMM
  if (p.form == GroupedGemm::wgrad)
    run<Tiles>(p, scratch, scratch_bytes, device, stream);
  else
    run<Blocks>(p, scratch, scratch_bytes, device, stream);
#else
  (void)scratch, (void)scratch_bytes, (void)stream;
  fatal_error(__FILE__, __LINE__, "grouped FP8 GEMM: " + grouped_gemm_unsupported_reason(device));
#endif
}

}  // namespace fp8moe::cuda
