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

#include <map>
#include <mutex>

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
using ElementA = cutlass::float_e4m3_t;
using ElementB = cutlass::float_e4m3_t;
using ElementC = float;
using ElementD = float;
using LayoutA = cutlass::layout::RowMajor;     // (M, K), K contiguous
using LayoutB = cutlass::layout::ColumnMajor;  // (K, N) column-major = our (N, K) row-major
using LayoutC = cutlass::layout::RowMajor;
using LayoutD = cutlass::layout::RowMajor;
constexpr int kAlignA = 16, kAlignB = 16, kAlignC = 4, kAlignD = 4;  // 16 bytes
using ElementAccumulator = float;
using ArchTag = cutlass::arch::Sm90;
using OperatorClass = cutlass::arch::OpClassTensorOp;
using TileShape = Shape<_128, _128, _128>;
using ClusterShape = Shape<_1, _2, _1>;
using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, 128, 128>;  // 1 x 128 (A), 128 x 128 (B)
using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());
using KernelSchedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise;
using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
using Fusion = cutlass::epilogue::fusion::LinearCombination<ElementD, ElementAccumulator>;

using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    ArchTag, OperatorClass, TileShape, ClusterShape, cutlass::epilogue::collective::EpilogueTileAuto,
    ElementAccumulator, ElementAccumulator, ElementC, LayoutC*, kAlignC, ElementD, LayoutD*, kAlignD,
    EpilogueSchedule, Fusion>::CollectiveOp;

using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    ArchTag, OperatorClass, ElementA, cute::tuple<LayoutA*, LayoutSFA*>, kAlignA, ElementB,
    cute::tuple<LayoutB*, LayoutSFB*>, kAlignB, ElementAccumulator, TileShape, ClusterShape,
    cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename CollectiveEpilogue::SharedStorage))>,
    KernelSchedule>::CollectiveOp;

using GemmKernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>;
using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;
using StrideA = typename Gemm::GemmKernel::InternalStrideA;
using StrideB = typename Gemm::GemmKernel::InternalStrideB;
using StrideC = typename Gemm::GemmKernel::InternalStrideC;
using StrideD = typename Gemm::GemmKernel::InternalStrideD;
using Shape3 = typename ProblemShape::UnderlyingProblemShape;

// The per-group arrays CUTLASS reads, carved out of the scratch in this order.
struct GroupArrays {
  Shape3* problem;
  const ElementA** a;
  const ElementB** b;
  const ElementC** c;
  ElementD** d;
  const float** sfa;
  const float** sfb;
  StrideA* stride_a;
  StrideB* stride_b;
  StrideC* stride_c;
  StrideD* stride_d;
  LayoutSFA* layout_sfa;
  LayoutSFB* layout_sfb;
  float* packed_sfa;  // rows x K/128: group g's (K/128, M_g) M-major at offsets[g] * K/128
  float* packed_sfb;  // groups x (K/128, N/128) N-major
  uint8_t* transposed_b;  // b_rows_are_k: groups x (N, K)
  void* workspace;
};

size_t align256(size_t n) { return (n + 255) / 256 * 256; }

// Carves the arrays out of `base` (nullptr: only counts); returns the bytes used before the workspace.
size_t carve(const GroupedGemmFp8& p, char* base, GroupArrays* g) {
  const size_t G = size_t(p.groups), kb = size_t(p.K / kBlock), nb = size_t(p.N / kBlock);
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
  take(g->packed_sfa, size_t(p.rows) * kb);
  take(g->packed_sfb, p.b_rows_are_k ? 0 : G * nb * kb);
  take(g->transposed_b, p.b_rows_are_k ? G * size_t(p.N) * size_t(p.K) : 0);
  g->workspace = base ? base + at : nullptr;
  return at;
}

#ifdef FP8MOE_GROUPED_GEMM
// One thread per group: its problem size, pointers, strides and scale layouts from the offsets.
__global__ void setup_kernel(GroupedGemmFp8 p, GroupArrays g) {
  const int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e >= p.groups) return;
  const int64_t r0 = p.row_offsets[e];
  const int M = int(p.row_offsets[e + 1] - r0), N = int(p.N), K = int(p.K);
  const int64_t kb = p.K / kBlock, nb = p.N / kBlock;
  g.problem[e] = Shape3(M, N, K);
  g.a[e] = reinterpret_cast<const ElementA*>(p.A[e]);
  g.b[e] = reinterpret_cast<const ElementB*>(p.b_rows_are_k ? g.transposed_b + e * p.N * p.K : p.B[e]);
  g.c[e] = p.D[e];
  g.d[e] = p.D[e];
  g.sfa[e] = g.packed_sfa + r0 * kb;
  g.sfb[e] = p.b_rows_are_k ? p.b_scale[e] : g.packed_sfb + e * nb * kb;
  g.stride_a[e] = cutlass::make_cute_packed_stride(StrideA{}, {M, K, 1});
  g.stride_b[e] = cutlass::make_cute_packed_stride(StrideB{}, {N, K, 1});
  g.stride_c[e] = cutlass::make_cute_packed_stride(StrideC{}, {M, N, 1});
  g.stride_d[e] = cutlass::make_cute_packed_stride(StrideD{}, {M, N, 1});
  g.layout_sfa[e] = ScaleConfig::tile_atom_to_shape_SFA(make_shape(M, N, K, 1));
  g.layout_sfb[e] = ScaleConfig::tile_atom_to_shape_SFB(make_shape(M, N, K, 1));
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

// b_rows_are_k: B[g] (K, N) -> (N, K), through 32 x 32 tiles in shared memory (both sides coalesced).
constexpr int kTransposeTile = 32, kTransposeRows = 8;
__global__ void transpose_b_kernel(const uint8_t* const* in, int64_t K, int64_t N, uint8_t* out) {
  __shared__ uint8_t tile[kTransposeTile][kTransposeTile + 1];
  const uint8_t* src = in[blockIdx.z];
  uint8_t* dst = out + int64_t(blockIdx.z) * N * K;
  const int64_t n0 = int64_t(blockIdx.x) * kTransposeTile, k0 = int64_t(blockIdx.y) * kTransposeTile;
  for (int j = threadIdx.y; j < kTransposeTile; j += kTransposeRows)
    if (k0 + j < K && n0 + threadIdx.x < N) tile[j][threadIdx.x] = src[(k0 + j) * N + n0 + threadIdx.x];
  __syncthreads();
  for (int j = threadIdx.y; j < kTransposeTile; j += kTransposeRows)
    if (n0 + j < N && k0 + threadIdx.x < K) dst[(n0 + j) * K + k0 + threadIdx.x] = tile[threadIdx.x][j];
}

cutlass::KernelHardwareInfo hardware_info(int device) {
  // NOTE: a process-wide cache of a fixed property of each device (its SM count and how many
  // clusters of this kernel fit), under a mutex.
  static std::mutex mutex;
  static std::map<int, cutlass::KernelHardwareInfo> cache;
  const std::lock_guard<std::mutex> lock(mutex);
  auto it = cache.find(device);
  if (it == cache.end())
    it = cache.emplace(device, cutlass::KernelHardwareInfo::make_kernel_hardware_info<GemmKernel>(device)).first;
  return it->second;
}

typename Gemm::Arguments arguments(const GroupedGemmFp8& p, const GroupArrays& g, int device) {
  typename Gemm::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGrouped,
      {int(p.groups), g.problem, nullptr},  // problem sizes in device memory only
      {g.a, g.stride_a, g.b, g.stride_b, g.sfa, g.layout_sfa, g.sfb, g.layout_sfb},
      {{}, g.c, g.stride_c, g.d, g.stride_d},
      hardware_info(device)};
  auto& f = args.epilogue.thread;
  f.alpha = p.alpha, f.beta = p.beta;
  f.alpha_ptr = nullptr, f.beta_ptr = nullptr, f.alpha_ptr_array = nullptr, f.beta_ptr_array = nullptr;
  f.dAlpha = {cute::_0{}, cute::_0{}, 0};
  f.dBeta = {cute::_0{}, cute::_0{}, 0};
  return args;
}

const char* status_text(cutlass::Status s) { return cutlassGetStatusString(s); }
#endif

void check_shape(const GroupedGemmFp8& p) {
  FP8MOE_ASSERT(p.groups >= 0 && p.rows >= 0 && p.N > 0 && p.K > 0, "grouped FP8 GEMM: groups ", p.groups, ", rows ",
                p.rows, ", N ", p.N, ", K ", p.K);
  FP8MOE_ASSERT(p.N % kBlock == 0 && p.K % kBlock == 0, "grouped FP8 GEMM: N ", p.N, " and K ", p.K,
                " must be multiples of 128 (the weight blocks)");
}

}  // namespace

std::string grouped_gemm_unsupported_reason(int device) {
#ifdef FP8MOE_GROUPED_GEMM
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
  GroupArrays g{};
  const size_t arrays = carve(p, nullptr, &g);
#ifdef FP8MOE_GROUPED_GEMM
  return arrays + align256(Gemm::get_workspace_size(arguments(p, g, device)));
#else
  (void)device;
  return arrays;
#endif
}

void grouped_gemm_fp8(const GroupedGemmFp8& p, void* scratch, size_t scratch_bytes, int device, cudaStream_t stream) {
  check_shape(p);
  if (p.groups == 0 || p.rows == 0) return;  // nothing to write
#ifdef FP8MOE_GROUPED_GEMM
  const size_t need = grouped_gemm_fp8_scratch_bytes(p, device);
  FP8MOE_ASSERT(scratch && scratch_bytes >= need, "grouped FP8 GEMM: scratch of ", scratch_bytes, " bytes, ", need,
                " needed");
  GroupArrays g{};
  carve(p, static_cast<char*>(scratch), &g);
  setup_kernel<<<grid_for(p.groups), kBlockThreads, 0, stream>>>(p, g);
  check_launch();
  pack_sfa_kernel<<<grid_for(p.rows * (p.K / kBlock)), kBlockThreads, 0, stream>>>(p, g.packed_sfa);
  check_launch();
  if (p.b_rows_are_k) {
    FP8MOE_ASSERT(p.groups <= 65535, "grouped FP8 GEMM: ", p.groups, " groups to transpose in one launch");
    const dim3 grid(unsigned(p.N / kTransposeTile), unsigned(p.K / kTransposeTile), unsigned(p.groups));
    transpose_b_kernel<<<grid, dim3(kTransposeTile, kTransposeRows), 0, stream>>>(p.B, p.K, p.N, g.transposed_b);
  } else {
    pack_sfb_kernel<<<grid_for(p.groups * (p.N / kBlock) * (p.K / kBlock)), kBlockThreads, 0, stream>>>(p, g.packed_sfb);
  }
  check_launch();
  Gemm gemm;
  const typename Gemm::Arguments args = arguments(p, g, device);
  if (const cutlass::Status s = gemm.can_implement(args); s != cutlass::Status::kSuccess)
    fatal_error(__FILE__, __LINE__, std::string("grouped FP8 GEMM: CUTLASS cannot run it: ") + status_text(s));
  if (const cutlass::Status s = gemm.initialize(args, g.workspace, stream); s != cutlass::Status::kSuccess)
    fatal_error(__FILE__, __LINE__, std::string("grouped FP8 GEMM: initialize: ") + status_text(s));
  if (const cutlass::Status s = gemm.run(stream); s != cutlass::Status::kSuccess)
    fatal_error(__FILE__, __LINE__, std::string("grouped FP8 GEMM: run: ") + status_text(s));
  check_launch();
#else
  (void)scratch, (void)scratch_bytes, (void)device, (void)stream;
  fatal_error(__FILE__, __LINE__, "grouped FP8 GEMM: " + grouped_gemm_unsupported_reason(device));
#endif
}

}  // namespace fp8moe::cuda
