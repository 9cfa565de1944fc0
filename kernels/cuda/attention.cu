// Causal GQA attention on the GPU (kernels/attention.h): one warp per query row (forward, dq) or
// key row (dk, dv), online softmax in FP32; the query/key rows hold hd elements, the value rows
// hdv. The reference the fused kernel (kernels/cuda/attention_cudnn.h) is checked against.
//
// Against kernels/cpu/attention.cpp: close. The CPU forms the scores with SGEMM and the softmax with
// FP32 exponentials (SLEEF's, kernels/cpu/vmath.h) summed in double; here the dot products are warp trees in FP32 (with fused multiply-adds), the softmax is
// online in FP32 and exp is the device expf. tests/kernels/test_attention.cpp bounds the difference
// relative to the largest element (1e-5 forward, 1e-4 backward, with an absolute floor for dq and
// dk at T = 1, where they cancel to rounding noise).
#include <cfloat>
#include <cmath>

#include "kernels/cuda/attention.h"
#include "kernels/cuda/block_reduce.cuh"
#include "kernels/cuda/launch.cuh"

namespace fp8moe::cuda {
namespace {

// A head's row of hd (or hdv) values is spread over the warp: lane holds elements lane + 32 c.
constexpr int kMaxPerLane = int(kAttentionMaxHeadDim / kWarpThreads);
using LaneRow = float[kMaxPerLane];

__device__ float warp_sum(float v) {
  for (int o = kWarpThreads / 2; o > 0; o /= 2) v += __shfl_xor_sync(kFullWarp, v, o);
  return v;
}

__device__ void lane_load(LaneRow& r, const float* p, int64_t n, int lane) {
  for (int c = 0; c < kMaxPerLane; ++c) r[c] = lane + kWarpThreads * c < n ? p[lane + kWarpThreads * c] : 0.0f;
}
// This lane's part of r . p (warp_sum completes it).
__device__ float lane_dot(const LaneRow& r, const float* p, int64_t n, int lane) {
  float s = 0.0f;
  for (int c = 0; c < kMaxPerLane; ++c)
    if (lane + kWarpThreads * c < n) s += r[c] * p[lane + kWarpThreads * c];
  return s;
}
// r = r * keep + a * p
__device__ void lane_update(LaneRow& r, float keep, float a, const float* p, int64_t n, int lane) {
  for (int c = 0; c < kMaxPerLane; ++c)
    if (lane + kWarpThreads * c < n) r[c] = r[c] * keep + a * p[lane + kWarpThreads * c];
}
__device__ void lane_store(float* p, const LaneRow& r, float scale, int64_t n, int lane) {
  for (int c = 0; c < kMaxPerLane; ++c)
    if (lane + kWarpThreads * c < n) p[lane + kWarpThreads * c] = r[c] * scale;
}

__device__ int64_t warp_index() { return (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) / kWarpThreads; }

// Row strides: q (H hd), k (KVH hd), v (KVH hdv), out and dout (H hdv).
__global__ void attn_fwd_kernel(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
                                int64_t B, int64_t T, int64_t H, int64_t KVH, int64_t hd, int64_t hdv, float scale,
                                float* __restrict__ out, float* __restrict__ lse) {
  const int64_t warp = warp_index();
  const int lane = threadIdx.x % kWarpThreads;
  if (warp >= B * H * T) return;
  const int64_t i = warp % T, h = (warp / T) % H, b = warp / (T * H);
  const int64_t g = h / (H / KVH), qs = H * hd, ks = KVH * hd, vs = KVH * hdv, os = H * hdv;
  LaneRow qr, acc = {};
  lane_load(qr, q + (b * T + i) * qs + h * hd, hd, lane);
  float m = -FLT_MAX, l = 0.0f;  // online softmax: running max and sum
  for (int64_t j = 0; j <= i; ++j) {
    const float* kj = k + (b * T + j) * ks + g * hd;
    const float* vj = v + (b * T + j) * vs + g * hdv;
    const float s = warp_sum(lane_dot(qr, kj, hd, lane)) * scale;
    const float m_new = fmaxf(m, s);
    const float corr = expf(m - m_new), p = expf(s - m_new);
    l = l * corr + p;
    lane_update(acc, corr, p, vj, hdv, lane);
    m = m_new;
  }
  lane_store(out + (b * T + i) * os + h * hdv, acc, 1.0f / l, hdv, lane);
  if (lane == 0) lse[(b * H + h) * T + i] = m + logf(l);
}

// delta_i = dO_i . O_i per (b, h, i), over the hdv elements of a value head.
__global__ void attn_delta_kernel(const float* __restrict__ out, const float* __restrict__ dout, int64_t rows,
                                  int64_t T, int64_t H, int64_t hdv, float* __restrict__ delta) {
  const int64_t warp = warp_index();
  const int lane = threadIdx.x % kWarpThreads;
  if (warp >= rows) return;
  const int64_t i = warp % T, h = (warp / T) % H, b = warp / (T * H);
  LaneRow o;
  lane_load(o, out + (b * T + i) * H * hdv + h * hdv, hdv, lane);
  const float s = warp_sum(lane_dot(o, dout + (b * T + i) * H * hdv + h * hdv, hdv, lane));
  if (lane == 0) delta[(b * H + h) * T + i] = s;
}

__global__ void attn_dq_kernel(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
                               const float* __restrict__ lse, const float* __restrict__ dout,
                               const float* __restrict__ delta, int64_t B, int64_t T, int64_t H, int64_t KVH,
                               int64_t hd, int64_t hdv, float scale, float* __restrict__ dq) {
  const int64_t warp = warp_index();
  const int lane = threadIdx.x % kWarpThreads;
  if (warp >= B * H * T) return;
  const int64_t i = warp % T, h = (warp / T) % H, b = warp / (T * H);
  const int64_t g = h / (H / KVH), qs = H * hd, ks = KVH * hd, vs = KVH * hdv, os = H * hdv;
  LaneRow qr, gr, acc = {};
  lane_load(qr, q + (b * T + i) * qs + h * hd, hd, lane);
  lane_load(gr, dout + (b * T + i) * os + h * hdv, hdv, lane);
  const float li = lse[(b * H + h) * T + i], di = delta[(b * H + h) * T + i];
  for (int64_t j = 0; j <= i; ++j) {
    const float* kj = k + (b * T + j) * ks + g * hd;
    const float s = warp_sum(lane_dot(qr, kj, hd, lane)) * scale;
    const float dp = warp_sum(lane_dot(gr, v + (b * T + j) * vs + g * hdv, hdv, lane));
    lane_update(acc, 1.0f, expf(s - li) * (dp - di), kj, hd, lane);  // dS = P (dP - delta)
  }
  lane_store(dq + (b * T + i) * qs + h * hd, acc, scale, hd, lane);
}

__global__ void attn_dkdv_kernel(const float* __restrict__ q, const float* __restrict__ k,
                                 const float* __restrict__ v, const float* __restrict__ lse,
                                 const float* __restrict__ dout, const float* __restrict__ delta, int64_t B,
                                 int64_t T, int64_t H, int64_t KVH, int64_t hd, int64_t hdv, float scale,
                                 float* __restrict__ dk, float* __restrict__ dv) {
  const int64_t warp = warp_index();
  const int lane = threadIdx.x % kWarpThreads;
  if (warp >= B * KVH * T) return;
  const int64_t j = warp % T, g = (warp / T) % KVH, b = warp / (T * KVH);
  const int64_t group = H / KVH, qs = H * hd, ks = KVH * hd, vs = KVH * hdv, os = H * hdv;
  LaneRow kr, vr, ak = {}, av = {};
  lane_load(kr, k + (b * T + j) * ks + g * hd, hd, lane);
  lane_load(vr, v + (b * T + j) * vs + g * hdv, hdv, lane);
  for (int64_t h = g * group; h < (g + 1) * group; ++h)  // the query heads of this kv head
    for (int64_t i = j; i < T; ++i) {
      const float* qi = q + (b * T + i) * qs + h * hd;
      const float* gi = dout + (b * T + i) * os + h * hdv;
      const float s = warp_sum(lane_dot(kr, qi, hd, lane)) * scale;
      const float dp = warp_sum(lane_dot(vr, gi, hdv, lane));
      const float p = expf(s - lse[(b * H + h) * T + i]);
      lane_update(av, 1.0f, p, gi, hdv, lane);                                      // dV += P^T dO
      lane_update(ak, 1.0f, p * (dp - delta[(b * H + h) * T + i]), qi, hd, lane);  // dK += dS^T Q
    }
  lane_store(dk + (b * T + j) * ks + g * hd, ak, scale, hd, lane);
  lane_store(dv + (b * T + j) * vs + g * hdv, av, 1.0f, hdv, lane);
}

void check_shape(int64_t H, int64_t KVH, int64_t hd, int64_t hdv) {
  FP8MOE_ASSERT(KVH > 0 && H % KVH == 0, "attention: ", H, " heads over ", KVH, " kv heads");
  FP8MOE_ASSERT(hd >= 1 && hd <= kAttentionMaxHeadDim && hdv >= 1 && hdv <= kAttentionMaxHeadDim,
                "cuda attention supports head sizes 1 to ", kAttentionMaxHeadDim, ", got ", hd, " (query/key) and ",
                hdv, " (value)");
}

}  // namespace

void attention_forward(const float* q, const float* k, const float* v, int64_t B, int64_t T, int64_t H, int64_t KVH,
                       int64_t hd, int64_t hdv, float* out, float* lse, cudaStream_t stream) {
  check_shape(H, KVH, hd, hdv);
  if (B * T * H == 0) return;
  const float scale = float(1.0 / std::sqrt(double(hd)));  // as the CPU
  attn_fwd_kernel<<<warps_grid(B * H * T, "attention_forward"), kBlockThreads, 0, stream>>>(q, k, v, B, T, H, KVH, hd,
                                                                                          hdv, scale, out, lse);
  check_launch();
}

void attention_backward(const float* q, const float* k, const float* v, const float* out, const float* lse,
                        const float* dout, int64_t B, int64_t T, int64_t H, int64_t KVH, int64_t hd, int64_t hdv,
                        float* dq, float* dk, float* dv, float* delta, cudaStream_t stream) {
  check_shape(H, KVH, hd, hdv);
  if (B * T * H == 0) return;
  const float scale = float(1.0 / std::sqrt(double(hd)));
  const int64_t rows = B * H * T;
  attn_delta_kernel<<<warps_grid(rows, "attention_backward"), kBlockThreads, 0, stream>>>(out, dout, rows, T, H, hdv,
                                                                                        delta);
  check_launch();
  attn_dq_kernel<<<warps_grid(rows, "attention_backward"), kBlockThreads, 0, stream>>>(q, k, v, lse, dout, delta, B, T,
                                                                                     H, KVH, hd, hdv, scale, dq);
  check_launch();
  attn_dkdv_kernel<<<warps_grid(B * KVH * T, "attention_backward"), kBlockThreads, 0, stream>>>(
      q, k, v, lse, dout, delta, B, T, H, KVH, hd, hdv, scale, dk, dv);
  check_launch();
}

}  // namespace fp8moe::cuda
