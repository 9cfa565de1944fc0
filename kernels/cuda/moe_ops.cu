// The MoE layer's token movement and gradients on the GPU (kernels/moe_ops.h).
//
// Against kernels/cpu/moe_ops.cpp, given the same routing:
//   bitwise  permute; unpermute_add, gated and not (each output element adds its token's rows in
//            increasing row order, the CPU's serial row order, with the IEEE multiply and add);
//            gate_grad's dye; router_grad (one warp per token: the sums over a token's slots and
//            experts are serial in the CPU's order, the element-wise parts are the CPU's
//            operations, all in double with the IEEE intrinsics); aux_loss (serial sums in the
//            CPU's order); bias_update (the integer load sum is exact; kernels/moe_ops.h's
//            bias_update_elem)
//            row_gates, slot_grads (copies); sum_rows, FP32 and BF16 (each output element adds its
//            rows in the CPU's order from +0, in FP32; BF16 rounded once by kernels/fp8.h's
//            bf16_encode)
//            their BF16 forms likewise (permute_bf16 rounds by kernels/fp8.h's bf16_encode, the
//            CPU's span's bits; unpermute_add_bf16 and gate_grad_bf16 widen each value as it is read)
//   close    gate_grad's dgate (and gate_grad_bf16's): each row's dot product (double) is a warp
//            tree here, serial there
#include "kernels/cuda/block_reduce.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/serial_sum.cuh"
#include "kernels/cuda/moe_ops.h"
#include "kernels/elem.h"
#include "kernels/fp8.h"

namespace fp8moe::cuda {
namespace {

// Dynamic shared memory of router_grad: the default limit, without an opt-in attribute.
constexpr size_t kRouterGradSharedBytes = size_t(48) << 10;

__global__ void permute_kernel(const float* __restrict__ x, const int64_t* __restrict__ row_token, int64_t R,
                               int64_t D, float* __restrict__ rows) {
  FP8MOE_GRID_STRIDE(e, R * D) rows[e] = x[row_token[e / D] * D + e % D];
}

__global__ void permute_bf16_kernel(const float* __restrict__ x, const int64_t* __restrict__ row_token, int64_t R,
                                    int64_t D, uint16_t* __restrict__ rows) {
  FP8MOE_GRID_STRIDE(e, R * D) rows[e] = bf16_encode(x[row_token[e / D] * D + e % D]);
}

// One thread per output element: the token's kept slots in increasing row order (k passes, each
// taking the smallest row above the last one).
template <class Row>
__global__ void unpermute_kernel(const Row* __restrict__ rows, const int32_t* __restrict__ slot_row,
                                 const float* __restrict__ gate, int64_t N, int64_t k, int64_t R, int64_t D,
                                 bool gated, float* __restrict__ out) {
  FP8MOE_GRID_STRIDE(e, N * D) {
    const int64_t n = e / D, d = e % D;
    float acc = out[e];
    int64_t last = -1;
    for (int64_t step = 0; step < k; ++step) {
      int64_t next = R, slot = -1;
      for (int64_t j = 0; j < k; ++j) {
        const int64_t r = slot_row[n * k + j];  // -1 where dropped
        if (r > last && r < next) next = r, slot = j;
      }
      if (slot < 0) break;
      const float v = kept_value(rows[next * D + d]);
      acc = add_rn(acc, gated ? mul_rn(gate[n * k + slot], v) : v);
      last = next;
    }
    out[e] = acc;
  }
}

// One warp per permuted row.
template <class Row>
__global__ void gate_grad_kernel(const int64_t* __restrict__ row_token, const int32_t* __restrict__ row_slot,
                                 const float* __restrict__ gate, int64_t R, int64_t k, int64_t D,
                                 const float* __restrict__ dout, const Row* __restrict__ expert_out,
                                 float* __restrict__ dye, double* __restrict__ dgate) {
  const int64_t i = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) / kWarpThreads;
  const int lane = threadIdx.x % kWarpThreads;
  if (i >= R) return;
  const int64_t n = row_token[i], slot = n * k + row_slot[i];
  const float g = gate[slot];
  double dg = 0;
  for (int64_t d = lane; d < D; d += kWarpThreads) {
    const float o = dout[n * D + d];
    dye[i * D + d] = mul_rn(g, o);
    dg = __dadd_rn(dg, __dmul_rn(double(o), double(kept_value(expert_out[i * D + d]))));
  }
  dg = warp_reduce(dg, SumOp{});
  if (lane == 0) dgate[slot] = dg;
}

template <class Row>
__global__ void sum_rows_kernel(const Row* __restrict__ rows, const int64_t* __restrict__ offsets,
                                const int64_t* __restrict__ index, int64_t n, int64_t D, Row* __restrict__ out) {
  FP8MOE_GRID_STRIDE(e, n * D) {
    const int64_t u = e / D, d = e % D;
    float acc = 0.0f;
    for (int64_t t = offsets[u]; t < offsets[u + 1]; ++t) {
      if constexpr (sizeof(Row) == 2) acc = __fadd_rn(acc, bf16_decode(rows[index[t] * D + d]));
      else acc = __fadd_rn(acc, rows[index[t] * D + d]);
    }
    if constexpr (sizeof(Row) == 2) out[e] = bf16_encode(acc);
    else out[e] = acc;
  }
}

__global__ void row_gates_kernel(const int64_t* __restrict__ row_token, const int32_t* __restrict__ row_slot,
                                 const float* __restrict__ gate, int64_t R, int64_t k, float* __restrict__ gate_rows) {
  FP8MOE_GRID_STRIDE(i, R) gate_rows[i] = gate[row_token[i] * k + row_slot[i]];
}

__global__ void slot_grads_kernel(const int64_t* __restrict__ row_token, const int32_t* __restrict__ row_slot,
                                  const double* __restrict__ row_grads, int64_t R, int64_t k,
                                  double* __restrict__ dgate) {
  FP8MOE_GRID_STRIDE(i, R) dgate[row_token[i] * k + row_slot[i]] = row_grads[i];
}

struct RouterGradArgs {
  int64_t N;
  int E, k;
  bool sigmoid, normalise;
  double scaling, aux_coef, aux_grad_scale;
};

// d aux / d Pnorm of expert e: ((((aux_grad_scale coef) E) (load / (N k))) / N), the CPU's order.
__device__ double aux_dpn(const RouterGradArgs& a, const int64_t* load, int e) {
  const double t = __dmul_rn(__dmul_rn(a.aux_grad_scale, a.aux_coef), double(a.E));
  const double f = __ddiv_rn(double(load[e]), double(a.N * a.k));
  return __ddiv_rn(__dmul_rn(t, f), double(a.N));
}

// One warp per token; dp (E doubles) in this warp's shared memory. Sums over slots and experts
// are lane 0's, serial in the CPU's order.
__global__ void router_grad_kernel(const float* __restrict__ prob, const int32_t* __restrict__ expert,
                                   const int64_t* __restrict__ load, const double* __restrict__ dgate,
                                   RouterGradArgs a, float* __restrict__ dz) {
  extern __shared__ double rg_smem[];
  const int lane = threadIdx.x % kWarpThreads, w = threadIdx.x / kWarpThreads;
  const int warps = blockDim.x / kWarpThreads;
  const int E = a.E, k = a.k;
  double* dp = rg_smem + int64_t(w) * E;
  for (int64_t n = blockIdx.x * int64_t(warps) + w; n < a.N; n += int64_t(gridDim.x) * warps) {
    const float* p = prob + n * E;
    const int32_t* chosen = expert + n * k;  // dropped slots have dgate 0 but stay in the normalisation
    const double* dg = dgate + n * k;
    for (int e = lane; e < E; e += kWarpThreads) dp[e] = 0.0;
    __syncwarp();
    if (lane == 0) {
      if (a.normalise) {
        // g_i = c s_i / S:  ds_c = c (dg_c - sum_j dg_j s_j / S) / S.
        double S = 0, gsum = 0;
        for (int j = 0; j < k; ++j) S = __dadd_rn(S, double(p[chosen[j]]));
        for (int j = 0; j < k; ++j) gsum = __dadd_rn(gsum, __dmul_rn(dg[j], __ddiv_rn(double(p[chosen[j]]), S)));
        for (int j = 0; j < k; ++j)
          dp[chosen[j]] = __dadd_rn(dp[chosen[j]], __dmul_rn(a.scaling, __ddiv_rn(__dsub_rn(dg[j], gsum), S)));
      } else {
        for (int j = 0; j < k; ++j) dp[chosen[j]] = __dadd_rn(dp[chosen[j]], __dmul_rn(a.scaling, dg[j]));
      }
    }
    __syncwarp();
    if (a.aux_coef > 0) {
      if (!a.sigmoid) {
        for (int e = lane; e < E; e += kWarpThreads) dp[e] = __dadd_rn(dp[e], aux_dpn(a, load, e));
      } else {
        double S = 0, dot = 0;
        if (lane == 0) {
          for (int e = 0; e < E; ++e) S = __dadd_rn(S, double(p[e]));
          for (int e = 0; e < E; ++e) dot = __dadd_rn(dot, __dmul_rn(aux_dpn(a, load, e), double(p[e])));
        }
        S = __shfl_sync(kFullWarp, S, 0), dot = __shfl_sync(kFullWarp, dot, 0);
        for (int e = lane; e < E; e += kWarpThreads)
          dp[e] = __dadd_rn(dp[e], __ddiv_rn(__dsub_rn(aux_dpn(a, load, e), __ddiv_rn(dot, S)), S));
      }
      __syncwarp();
    }
    if (a.sigmoid) {
      for (int e = lane; e < E; e += kWarpThreads) {
        const double pe = p[e];
        dz[n * E + e] = float(__dmul_rn(__dmul_rn(dp[e], pe), __dsub_rn(1.0, pe)));
      }
    } else {
      double dot = 0;
      if (lane == 0)
        for (int e = 0; e < E; ++e) dot = __dadd_rn(dot, __dmul_rn(dp[e], double(p[e])));
      dot = __shfl_sync(kFullWarp, dot, 0);
      for (int e = lane; e < E; e += kWarpThreads) {
        const double pe = p[e];
        dz[n * E + e] = float(__dmul_rn(pe, __dsub_rn(dp[e], dot)));
      }
    }
    __syncwarp();  // the next token overwrites dp
  }
}

// row_sum[n] = sum_e prob[n, e], serial (one thread per token).
__global__ void aux_row_sum_kernel(const float* __restrict__ prob, int64_t N, int64_t E, double* __restrict__ row_sum) {
  FP8MOE_GRID_STRIDE(n, N) {
    double s = 0;
    for (int64_t e = 0; e < E; ++e) s = __dadd_rn(s, double(prob[n * E + e]));
    row_sum[n] = s;
  }
}

// terms[e] = coef E f_e P_e / N, P_e summed over tokens in order (one thread per expert).
__global__ void aux_terms_kernel(const float* __restrict__ prob, const int64_t* __restrict__ load,
                                 const double* __restrict__ row_sum, int64_t N, int64_t E, int64_t k, double coef,
                                 bool sigmoid, double* __restrict__ terms) {
  FP8MOE_GRID_STRIDE(e, E) {
    double pe = 0;
    for (int64_t n = 0; n < N; ++n) {
      const double p = prob[n * E + e];
      pe = __dadd_rn(pe, sigmoid ? __ddiv_rn(p, row_sum[n]) : p);
    }
    const double fe = __ddiv_rn(double(load[e]), double(N * k));
    terms[e] = __ddiv_rn(__dmul_rn(__dmul_rn(__dmul_rn(coef, double(E)), fe), pe), double(N));
  }
}

__global__ void bias_update_kernel(float* __restrict__ bias, const int64_t* __restrict__ load, int64_t E,
                                   double rate) {
  __shared__ double mean;
  if (threadIdx.x == 0) {
    int64_t total = 0;
    for (int64_t e = 0; e < E; ++e) total += load[e];
    mean = double(total) / double(E);
  }
  __syncthreads();
  for (int64_t e = threadIdx.x; e < E; e += blockDim.x) bias[e] = bias_update_elem(bias[e], mean, load[e], rate);
}

}  // namespace

void permute(const float* x, const int64_t* row_token, int64_t R, int64_t D, float* rows, cudaStream_t stream) {
  if (R * D == 0) return;
  permute_kernel<<<grid_for(R * D), kBlockThreads, 0, stream>>>(x, row_token, R, D, rows);
  check_launch();
}

namespace {

template <class Row>
void unpermute_rows(const RoutingBuffers& r, int64_t R, const Row* rows, int64_t D, bool gated, float* out,
                    cudaStream_t stream) {
  if (r.N * D == 0 || R == 0) return;
  unpermute_kernel<<<grid_for(r.N * D), kBlockThreads, 0, stream>>>(rows, r.slot_row, r.gate, r.N, r.k, R, D, gated,
                                                                    out);
  check_launch();
}

template <class Row>
void gate_grad_rows(const RoutingBuffers& r, int64_t R, const float* dout, const Row* expert_out, int64_t D,
                    float* dye, double* dgate, cudaStream_t stream) {
  if (r.N * r.k == 0) return;
  CUDA_CHECK(cudaMemsetAsync(dgate, 0, size_t(r.N * r.k) * sizeof(double), stream));  // +0.0 for every slot
  if (R == 0) return;
  gate_grad_kernel<<<warps_grid(R, "gate_grad"), kBlockThreads, 0, stream>>>(r.row_token, r.row_slot, r.gate, R, r.k,
                                                                            D, dout, expert_out, dye, dgate);
  check_launch();
}

}  // namespace

void unpermute_add(const RoutingBuffers& r, int64_t R, const float* rows, int64_t D, bool gated, float* out,
                   cudaStream_t stream) {
  unpermute_rows(r, R, rows, D, gated, out, stream);
}

void unpermute_add_bf16(const RoutingBuffers& r, int64_t R, const uint16_t* rows, int64_t D, bool gated, float* out,
                        cudaStream_t stream) {
  unpermute_rows(r, R, rows, D, gated, out, stream);
}

void permute_bf16(const float* x, const int64_t* row_token, int64_t R, int64_t D, uint16_t* rows,
                  cudaStream_t stream) {
  if (R * D == 0) return;
  permute_bf16_kernel<<<grid_for(R * D), kBlockThreads, 0, stream>>>(x, row_token, R, D, rows);
  check_launch();
}

void row_gates(const RoutingBuffers& r, int64_t R, float* gate_rows, cudaStream_t stream) {
  if (R == 0) return;
  row_gates_kernel<<<grid_for(R), kBlockThreads, 0, stream>>>(r.row_token, r.row_slot, r.gate, R, r.k, gate_rows);
  check_launch();
}

void sum_rows(const float* rows, const int64_t* offsets, const int64_t* index, int64_t n, int64_t D, float* out,
              cudaStream_t stream) {
  if (n * D == 0) return;
  sum_rows_kernel<<<grid_for(n * D), kBlockThreads, 0, stream>>>(rows, offsets, index, n, D, out);
  check_launch();
}

void sum_rows_bf16(const uint16_t* rows, const int64_t* offsets, const int64_t* index, int64_t n, int64_t D,
                   uint16_t* out, cudaStream_t stream) {
  if (n * D == 0) return;
  sum_rows_kernel<<<grid_for(n * D), kBlockThreads, 0, stream>>>(rows, offsets, index, n, D, out);
  check_launch();
}

void slot_grads(const RoutingBuffers& r, int64_t R, const double* row_grads, double* dgate, cudaStream_t stream) {
  if (r.N * r.k == 0) return;
  CUDA_CHECK(cudaMemsetAsync(dgate, 0, size_t(r.N * r.k) * sizeof(double), stream));  // +0.0 for every slot
  if (R == 0) return;
  slot_grads_kernel<<<grid_for(R), kBlockThreads, 0, stream>>>(r.row_token, r.row_slot, row_grads, R, r.k, dgate);
  check_launch();
}

void gate_grad(const RoutingBuffers& r, int64_t R, const float* dout, const float* expert_out, int64_t D, float* dye,
               double* dgate, cudaStream_t stream) {
  gate_grad_rows(r, R, dout, expert_out, D, dye, dgate, stream);
}

void gate_grad_bf16(const RoutingBuffers& r, int64_t R, const float* dout, const uint16_t* expert_out, int64_t D,
                    float* dye, double* dgate, cudaStream_t stream) {
  gate_grad_rows(r, R, dout, expert_out, D, dye, dgate, stream);
}

void router_grad(const RoutingBuffers& r, const double* dgate, const RouterGradRule& rule, float* dz,
                 cudaStream_t stream) {
  FP8MOE_ASSERT(r.E >= 1 && r.E <= kMoeMaxExperts, "the CUDA router gradient takes 1 to ", kMoeMaxExperts,
                " experts, got ", r.E);
  if (r.N == 0) return;
  const RouterGradArgs a{r.N, int(r.E), int(r.k), rule.sigmoid, rule.normalise, rule.scaling, rule.aux_coef,
                         rule.aux_grad_scale};
  const size_t warp_bytes = size_t(r.E) * sizeof(double);
  int warps = int(kRouterGradSharedBytes / warp_bytes);
  warps = warps < kWarpsPerBlock ? (warps > 0 ? warps : 1) : kWarpsPerBlock;
  router_grad_kernel<<<grid_for(r.N, warps), unsigned(warps * kWarpThreads), size_t(warps) * warp_bytes, stream>>>(
      r.prob, r.expert, r.load, dgate, a, dz);
  check_launch();
}

void aux_loss(const RoutingBuffers& r, double coef, bool sigmoid, double* out, double* row_sum, double* terms,
              cudaStream_t stream) {
  if (!(coef > 0) || r.N == 0 || r.E == 0) {
    CUDA_CHECK(cudaMemsetAsync(out, 0, sizeof(double), stream));  // +0.0, as the CPU's 0.0
    return;
  }
  if (sigmoid) {
    aux_row_sum_kernel<<<grid_for(r.N), kBlockThreads, 0, stream>>>(r.prob, r.N, r.E, row_sum);
    check_launch();
  }
  aux_terms_kernel<<<grid_for(r.E), kBlockThreads, 0, stream>>>(r.prob, r.load, row_sum, r.N, r.E, r.k, coef, sigmoid,
                                                                terms);
  check_launch();
  serial_sum_kernel<<<1, 1, 0, stream>>>(terms, r.E, out);
  check_launch();
}

void bias_update(float* bias, const int64_t* load, int64_t E, double rate, cudaStream_t stream) {
  if (E == 0) return;
  bias_update_kernel<<<1, kBlockThreads, 0, stream>>>(bias, load, E, rate);
  check_launch();
}

}  // namespace fp8moe::cuda
