// The MoE router on the GPU (kernels/router.h), everything kernels/cpu/router.cpp does:
//   1. one warp per token: scores (sigmoid or softmax), keys = score + bias, node-limited group
//      routing, top-k and gates; the token's scores and keys live in shared memory
//   2. capacity in token order and the permutation, from per-expert counts of chunks of
//      assignments: chunk histograms, a per-expert exclusive scan over the chunks, the offsets,
//      and each assignment's rank among its expert's assignments (its rank in the chunk plus the
//      chunk's base). An assignment is kept when that rank is below the capacity, and then its
//      permuted row is offsets[e] + rank (all earlier assignments of e are kept too).
// Orders: a stable descending sort (the CPU's std::stable_sort) puts element a at
//   #{b: key_b > key_a} + #{b < a: key_b == key_a},
// which is computed here for each element directly: ties go to the lower group / expert.
//
// Against kernels/cpu/router.cpp:
//   bitwise  the choice (expert, kept, load, offsets, row_token, row_slot, slot_row) wherever the
//            keys the CPU and the GPU compute order the same way (no near-ties at an ulp), and
//            the gates and group scores given the same scores: the CPU's operations in its order
//            (the chosen scores summed serially in double, IEEE intrinsics)
//   close    the scores: the device expf / exp differ from the CPU's (SLEEF, kernels/cpu/vmath.h)
//            by an ulp or two, and the softmax's sum of exponentials is a warp tree here, 16 lanes
//            in a fixed order there
// NOTE: NaN keys (a NaN router logit: a step that is already broken) order as -inf, so every slot
// still gets a distinct expert and no later kernel indexes out of bounds; the CPU's order of NaN
// keys is std::stable_sort's, unspecified.
#include <cmath>

#include "kernels/cuda/block_reduce.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/router.h"
#include "kernels/elem.h"

namespace fp8moe::cuda {
namespace {

// Assignments per chunk of the capacity kernels: one per thread of a block.
constexpr int kRouteChunk = kBlockThreads;
// Dynamic shared memory of the token kernel: the default limit, without an opt-in attribute.
constexpr size_t kRouteSharedBytes = size_t(48) << 10;

struct TokenArgs {
  int64_t N;
  int E, k, G, topk_group;
  bool sigmoid, normalise;
  double scaling;
  int warp_words;  // shared-memory words (4 bytes) of one warp
};

__device__ float order_key(float x) { return isnan(x) ? -INFINITY : x; }
// Whether (ka, a) comes before (kb, b) in a stable descending sort.
__device__ bool comes_before(float ka, int a, float kb, int b) { return ka > kb || (ka == kb && a < b); }

__global__ void route_tokens_kernel(const float* __restrict__ z, const float* __restrict__ bias, TokenArgs a,
                                    float* __restrict__ prob, int32_t* __restrict__ expert,
                                    float* __restrict__ gate) {
  extern __shared__ float route_smem[];
  const int lane = threadIdx.x % kWarpThreads, w = threadIdx.x / kWarpThreads;
  const int warps = blockDim.x / kWarpThreads;
  const int E = a.E, k = a.k, G = a.G, per_group = E / G;
  float* p_s = route_smem + int64_t(w) * a.warp_words;  // (E) scores
  float* key_s = p_s + E;                               // (E) selection keys
  float* gs = key_s + E;                                // (G) group scores
  int32_t* sel = reinterpret_cast<int32_t*>(gs + G);    // (k) chosen experts, best first
  for (int64_t n = blockIdx.x * int64_t(warps) + w; n < a.N; n += int64_t(gridDim.x) * warps) {
    const float* zr = z + n * E;
    if (a.sigmoid) {
      for (int e = lane; e < E; e += kWarpThreads) p_s[e] = div_rn(1.0f, add_rn(1.0f, expf(-zr[e])));
    } else {
      float m = -INFINITY;
      for (int e = lane; e < E; e += kWarpThreads) m = fmaxf(m, zr[e]);
      m = warp_reduce(m, MaxOp{});
      double s = 0;
      for (int e = lane; e < E; e += kWarpThreads) s = __dadd_rn(s, exp(__dsub_rn(double(zr[e]), double(m))));
      s = warp_reduce(s, SumOp{});
      for (int e = lane; e < E; e += kWarpThreads) p_s[e] = float(exp(__dsub_rn(double(zr[e]), double(m))) / s);
    }
    for (int e = lane; e < E; e += kWarpThreads) {
      prob[n * E + e] = p_s[e];
      key_s[e] = add_rn(p_s[e], bias ? bias[e] : 0.0f);
    }
    __syncwarp();
    if (G > 1) {
      // Group score: the sum of its two best keys (the CPU's scan, so the same two).
      for (int g = lane; g < G; g += kWarpThreads) {
        const float* kg = key_s + g * per_group;
        float best = -INFINITY, second = -INFINITY;
        for (int e = 0; e < per_group; ++e) {
          if (kg[e] > best) second = best, best = kg[e];
          else if (kg[e] > second) second = kg[e];
        }
        gs[g] = add_rn(best, second);
      }
      __syncwarp();
      // Groups placed at topk_group or later are taken out of the choice.
      for (int g = lane; g < G; g += kWarpThreads) {
        const float sg = order_key(gs[g]);
        int place = 0;
        for (int h = 0; h < G && place < a.topk_group; ++h) place += comes_before(order_key(gs[h]), h, sg, g);
        if (place >= a.topk_group)
          for (int e = 0; e < per_group; ++e) key_s[g * per_group + e] = -INFINITY;
      }
      __syncwarp();
    }
    // Top-k by key: expert e goes to slot `place` when that is below k.
    for (int e = lane; e < E; e += kWarpThreads) {
      const float ke = order_key(key_s[e]);
      int place = 0;
      for (int f = 0; f < E && place < k; ++f) place += comes_before(order_key(key_s[f]), f, ke, e);
      if (place < k) sel[place] = e;
    }
    __syncwarp();
    double chosen = 0;  // in slot order, as the CPU
    if (lane == 0)
      for (int j = 0; j < k; ++j) chosen = __dadd_rn(chosen, double(p_s[sel[j]]));
    chosen = __shfl_sync(kFullWarp, chosen, 0);
    for (int j = lane; j < k; j += kWarpThreads) {
      const int32_t e = sel[j];
      expert[n * k + j] = e;
      const double g = a.normalise ? double(p_s[e]) / chosen : double(p_s[e]);  // IEEE division
      gate[n * k + j] = float(__dmul_rn(g, a.scaling));
    }
    __syncwarp();  // the next token overwrites this warp's shared memory
  }
}

// counts[c E + e] = the assignments of chunk c to expert e.
__global__ void route_chunk_counts_kernel(const int32_t* __restrict__ expert, int64_t NK, int E,
                                          int32_t* __restrict__ counts) {
  extern __shared__ int32_t hist[];  // (E)
  const int64_t c = blockIdx.x;
  for (int e = threadIdx.x; e < E; e += blockDim.x) hist[e] = 0;
  __syncthreads();
  const int64_t i = c * kRouteChunk + threadIdx.x;
  if (i < NK) atomicAdd(&hist[expert[i]], 1);  // integer counts: the same in any order
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x) counts[c * E + e] = hist[e];
}

// Per expert, chunks in order: counts become exclusive prefix sums (the assignments of e before
// chunk c), and load[e] = min(total, capacity), at least 0.
__global__ void route_chunk_scan_kernel(int32_t* __restrict__ counts, int64_t chunks, int E, int64_t capacity,
                                        int64_t* __restrict__ load) {
  FP8MOE_GRID_STRIDE(e, E) {
    int64_t run = 0;
    for (int64_t c = 0; c < chunks; ++c) {
      const int32_t x = counts[c * E + e];
      counts[c * E + e] = int32_t(run);
      run += x;
    }
    const int64_t cap = capacity > 0 ? capacity : 0;
    load[e] = run < cap ? run : cap;
  }
}

__global__ void route_offsets_kernel(const int64_t* __restrict__ load, int E, int64_t* __restrict__ offsets) {
  int64_t run = 0;
  offsets[0] = 0;
  for (int e = 0; e < E; ++e) offsets[e + 1] = run += load[e];
}

__global__ void route_rows_kernel(const int32_t* __restrict__ expert, int64_t NK, int k, int E, int64_t capacity,
                                  const int32_t* __restrict__ base, const int64_t* __restrict__ offsets,
                                  uint8_t* __restrict__ kept, float* __restrict__ gate,
                                  int64_t* __restrict__ row_token, int32_t* __restrict__ row_slot,
                                  int32_t* __restrict__ slot_row) {
  __shared__ int32_t chunk[kRouteChunk];
  const int64_t c = blockIdx.x, i = c * kRouteChunk + threadIdx.x;
  chunk[threadIdx.x] = i < NK ? expert[i] : -1;
  __syncthreads();
  if (i >= NK) return;
  const int32_t e = chunk[threadIdx.x];
  int64_t rank = base[c * E + e];
  for (int t = 0; t < int(threadIdx.x); ++t) rank += chunk[t] == e;
  if (rank >= capacity) {
    kept[i] = 0, gate[i] = 0.0f, slot_row[i] = -1;
    return;
  }
  const int64_t row = offsets[e] + rank;
  kept[i] = 1;
  row_token[row] = i / k;
  row_slot[row] = int32_t(i % k);
  slot_row[i] = int32_t(row);
}

}  // namespace

int64_t route_scratch_count(int64_t N, int64_t E, int64_t k) { return (N * k + kRouteChunk - 1) / kRouteChunk * E; }

void route(const float* z, const float* bias, const RouterRule& rule, const RoutingBuffers& r, int32_t* scratch,
           cudaStream_t stream) {
  const int64_t N = r.N, E = r.E, k = r.k, G = rule.n_group;
  FP8MOE_ASSERT(k == rule.top_k && k >= 1 && k <= E, "top_k ", k, " of ", E, " experts");
  FP8MOE_ASSERT(E <= kRouteMaxExperts, "the CUDA router takes at most ", kRouteMaxExperts, " experts, got ", E);
  FP8MOE_ASSERT(G >= 1 && E % G == 0 && rule.topk_group >= 1 && rule.topk_group <= G &&
                    k <= rule.topk_group * (E / G),
                "node-limited routing: ", E, " experts in ", G, " groups, ", rule.topk_group, " of them, top ", k);
  const int64_t NK = N * k;
  FP8MOE_ASSERT(NK < (int64_t(1) << 31), "route: ", NK, " assignments (rows are int32)");
  if (N == 0) {
    CUDA_CHECK(cudaMemsetAsync(r.load, 0, size_t(E) * sizeof(int64_t), stream));
    route_offsets_kernel<<<1, 1, 0, stream>>>(r.load, int(E), r.offsets);
    check_launch();
    return;
  }

  TokenArgs a{N, int(E), int(k), int(G), int(rule.topk_group), rule.sigmoid, rule.normalise, rule.scaling, 0};
  a.warp_words = int(2 * E + G + k);
  const size_t warp_bytes = size_t(a.warp_words) * sizeof(float);
  int warps = int(kRouteSharedBytes / warp_bytes);
  warps = warps < kWarpsPerBlock ? (warps > 0 ? warps : 1) : kWarpsPerBlock;
  route_tokens_kernel<<<grid_for(N, warps), unsigned(warps * kWarpThreads), size_t(warps) * warp_bytes, stream>>>(
      z, bias, a, r.prob, r.expert, r.gate);
  check_launch();

  const int64_t chunks = (NK + kRouteChunk - 1) / kRouteChunk;
  route_chunk_counts_kernel<<<grid_of(chunks, "route"), kRouteChunk, size_t(E) * sizeof(int32_t), stream>>>(
      r.expert, NK, int(E), scratch);
  check_launch();
  route_chunk_scan_kernel<<<grid_for(E), kBlockThreads, 0, stream>>>(scratch, chunks, int(E), rule.capacity, r.load);
  check_launch();
  route_offsets_kernel<<<1, 1, 0, stream>>>(r.load, int(E), r.offsets);
  check_launch();
  route_rows_kernel<<<grid_of(chunks, "route"), kRouteChunk, 0, stream>>>(r.expert, NK, int(k), int(E), rule.capacity,
                                                                          scratch, r.offsets, r.kept, r.gate,
                                                                          r.row_token, r.row_slot, r.slot_row);
  check_launch();
}

}  // namespace fp8moe::cuda
