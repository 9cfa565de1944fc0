#include <cfloat>

#include "kernels/check.h"
#include "kernels/cuda/block_reduce.cuh"
#include "kernels/cuda/context.h"
#include "kernels/cuda/ops.h"

namespace fp8moe::cuda {
namespace {

constexpr int kThreads = kBlockThreads;

unsigned grid_for(int64_t n, int threads = kThreads) {
  const int64_t want = (n + threads - 1) / threads;
  return static_cast<unsigned>(want < 65535 ? (want > 0 ? want : 1) : 65535);
}

#define FP8MOE_GRID_STRIDE(i, n) \
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < (n); i += int64_t(gridDim.x) * blockDim.x)

// Block-wide reductions (blockDim.x == kThreads), the same tree every time.
__device__ double block_sum(double v) { return block_reduce(v, SumOp{}, 0.0); }
__device__ float block_max_f(float v) { return block_reduce(v, MaxOp{}, -FLT_MAX); }

__device__ float warp_sum(float v) {
  for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xFFFFFFFFu, v, o);
  return v;
}

// ---- RMSNorm ----------------------------------------------------------------------------------
__global__ void rmsnorm_fwd_kernel(const float* __restrict__ x, const float* __restrict__ w, int64_t D, float eps,
                                   float* __restrict__ y, float* __restrict__ rstd) {
  const int64_t n = blockIdx.x;
  const float* xr = x + n * D;
  double ss = 0;
  for (int64_t d = threadIdx.x; d < D; d += blockDim.x) ss += double(xr[d]) * xr[d];
  ss = block_sum(ss);
  const float r = float(1.0 / sqrt(ss / double(D) + eps));
  if (threadIdx.x == 0) rstd[n] = r;
  for (int64_t d = threadIdx.x; d < D; d += blockDim.x) y[n * D + d] = mul_rn(mul_rn(xr[d], r), w[d]);
}

__global__ void rmsnorm_bwd_dx_kernel(const float* __restrict__ x, const float* __restrict__ w,
                                      const float* __restrict__ rstd, const float* __restrict__ dy, int64_t D,
                                      float* __restrict__ dx) {
  const int64_t n = blockIdx.x;
  const float *xr = x + n * D, *g = dy + n * D;
  const double r = rstd[n];
  double dot = 0;
  for (int64_t d = threadIdx.x; d < D; d += blockDim.x) dot += double(w[d]) * g[d] * xr[d];
  dot = block_sum(dot);
  const double c = dot * r * r * r / double(D);
  for (int64_t d = threadIdx.x; d < D; d += blockDim.x) dx[n * D + d] = float(__dsub_rn(__dmul_rn(__dmul_rn(r, w[d]), g[d]), __dmul_rn(c, xr[d])));
}

// One thread per column, tokens in order: the CPU's operation order exactly.
__global__ void rmsnorm_bwd_dw_kernel(const float* __restrict__ x, const float* __restrict__ rstd,
                                      const float* __restrict__ dy, int64_t N, int64_t D, float* __restrict__ dw) {
  FP8MOE_GRID_STRIDE(d, D) {
    float acc = dw[d];
    for (int64_t n = 0; n < N; ++n) acc = add_rn(acc, mul_rn(mul_rn(dy[n * D + d], x[n * D + d]), rstd[n]));
    dw[d] = acc;
  }
}

// ---- RoPE -------------------------------------------------------------------------------------
__global__ void rope_kernel(float* __restrict__ x, int64_t rows, int64_t T, int64_t heads, int64_t half,
                            const float* __restrict__ cs, const float* __restrict__ sn) {
  FP8MOE_GRID_STRIDE(e, rows * heads * half) {
    const int64_t i = e % half, rh = e / half, row = rh / heads;
    const int64_t t = row % T;
    float* v = x + rh * 2 * half;
    rope_rotate(&v[i], &v[i + half], cs[t * half + i], sn[t * half + i]);
  }
}

// ---- Attention: one warp per query row (forward, dq) or key row (dk, dv) ----------------------
// A head's row of hd values is spread over the warp: lane holds elements lane + 32 c.
constexpr int kMaxPerLane = 8;  // head_dim <= 256
using LaneRow = float[kMaxPerLane];

__device__ void lane_load(LaneRow& r, const float* p, int64_t hd, int lane) {
  for (int c = 0; c < kMaxPerLane; ++c) r[c] = lane + 32 * c < hd ? p[lane + 32 * c] : 0.0f;
}
// This lane's part of r . p (warp_sum completes it).
__device__ float lane_dot(const LaneRow& r, const float* p, int64_t hd, int lane) {
  float s = 0.0f;
  for (int c = 0; c < kMaxPerLane; ++c)
    if (lane + 32 * c < hd) s += r[c] * p[lane + 32 * c];
  return s;
}
// r = r * keep + a * p
__device__ void lane_update(LaneRow& r, float keep, float a, const float* p, int64_t hd, int lane) {
  for (int c = 0; c < kMaxPerLane; ++c)
    if (lane + 32 * c < hd) r[c] = r[c] * keep + a * p[lane + 32 * c];
}
__device__ void lane_store(float* p, const LaneRow& r, float scale, int64_t hd, int lane) {
  for (int c = 0; c < kMaxPerLane; ++c)
    if (lane + 32 * c < hd) p[lane + 32 * c] = r[c] * scale;
}

__global__ void attn_fwd_kernel(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
                                int64_t B, int64_t T, int64_t H, int64_t KVH, int64_t hd, float scale,
                                float* __restrict__ out, float* __restrict__ lse) {
  const int64_t warp = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) / 32;
  const int lane = threadIdx.x & 31;
  if (warp >= B * H * T) return;
  const int64_t i = warp % T, h = (warp / T) % H, b = warp / (T * H);
  const int64_t g = h / (H / KVH), qs = H * hd, ks = KVH * hd;
  LaneRow qr, acc = {};
  lane_load(qr, q + (b * T + i) * qs + h * hd, hd, lane);
  float m = -FLT_MAX, l = 0.0f;  // online softmax: running max and sum
  for (int64_t j = 0; j <= i; ++j) {
    const float* kj = k + (b * T + j) * ks + g * hd;
    const float* vj = v + (b * T + j) * ks + g * hd;
    const float s = warp_sum(lane_dot(qr, kj, hd, lane)) * scale;
    const float m_new = fmaxf(m, s);
    const float corr = expf(m - m_new), p = expf(s - m_new);
    l = l * corr + p;
    lane_update(acc, corr, p, vj, hd, lane);
    m = m_new;
  }
  lane_store(out + (b * T + i) * qs + h * hd, acc, 1.0f / l, hd, lane);
  if (lane == 0) lse[(b * H + h) * T + i] = m + logf(l);
}

// D_i = dO_i . O_i per (b, h, i).
__global__ void attn_delta_kernel(const float* __restrict__ out, const float* __restrict__ dout, int64_t rows,
                                  int64_t T, int64_t H, int64_t hd, float* __restrict__ delta) {
  const int64_t warp = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) / 32;
  const int lane = threadIdx.x & 31;
  if (warp >= rows) return;
  const int64_t i = warp % T, h = (warp / T) % H, b = warp / (T * H);
  LaneRow o;
  lane_load(o, out + (b * T + i) * H * hd + h * hd, hd, lane);
  const float s = warp_sum(lane_dot(o, dout + (b * T + i) * H * hd + h * hd, hd, lane));
  if (lane == 0) delta[(b * H + h) * T + i] = s;
}

__global__ void attn_dq_kernel(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
                               const float* __restrict__ lse, const float* __restrict__ dout,
                               const float* __restrict__ delta, int64_t B, int64_t T, int64_t H, int64_t KVH,
                               int64_t hd, float scale, float* __restrict__ dq) {
  const int64_t warp = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) / 32;
  const int lane = threadIdx.x & 31;
  if (warp >= B * H * T) return;
  const int64_t i = warp % T, h = (warp / T) % H, b = warp / (T * H);
  const int64_t g = h / (H / KVH), qs = H * hd, ks = KVH * hd;
  LaneRow qr, gr, acc = {};
  lane_load(qr, q + (b * T + i) * qs + h * hd, hd, lane);
  lane_load(gr, dout + (b * T + i) * qs + h * hd, hd, lane);
  const float li = lse[(b * H + h) * T + i], di = delta[(b * H + h) * T + i];
  for (int64_t j = 0; j <= i; ++j) {
    const float* kj = k + (b * T + j) * ks + g * hd;
    const float s = warp_sum(lane_dot(qr, kj, hd, lane)) * scale;
    const float dp = warp_sum(lane_dot(gr, v + (b * T + j) * ks + g * hd, hd, lane));
    lane_update(acc, 1.0f, expf(s - li) * (dp - di), kj, hd, lane);  // dS = P (dP - D)
  }
  lane_store(dq + (b * T + i) * qs + h * hd, acc, scale, hd, lane);
}

__global__ void attn_dkdv_kernel(const float* __restrict__ q, const float* __restrict__ k,
                                 const float* __restrict__ v, const float* __restrict__ lse,
                                 const float* __restrict__ dout, const float* __restrict__ delta, int64_t B,
                                 int64_t T, int64_t H, int64_t KVH, int64_t hd, float scale, float* __restrict__ dk,
                                 float* __restrict__ dv) {
  const int64_t warp = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) / 32;
  const int lane = threadIdx.x & 31;
  if (warp >= B * KVH * T) return;
  const int64_t j = warp % T, g = (warp / T) % KVH, b = warp / (T * KVH);
  const int64_t group = H / KVH, qs = H * hd, ks = KVH * hd;
  LaneRow kr, vr, ak = {}, av = {};
  lane_load(kr, k + (b * T + j) * ks + g * hd, hd, lane);
  lane_load(vr, v + (b * T + j) * ks + g * hd, hd, lane);
  for (int64_t h = g * group; h < (g + 1) * group; ++h)  // the query heads of this kv head
    for (int64_t i = j; i < T; ++i) {
      const float* qi = q + (b * T + i) * qs + h * hd;
      const float* gi = dout + (b * T + i) * qs + h * hd;
      const float s = warp_sum(lane_dot(kr, qi, hd, lane)) * scale;
      const float dp = warp_sum(lane_dot(vr, gi, hd, lane));
      const float p = expf(s - lse[(b * H + h) * T + i]);
      lane_update(av, 1.0f, p, gi, hd, lane);                                       // dV += P^T dO
      lane_update(ak, 1.0f, p * (dp - delta[(b * H + h) * T + i]), qi, hd, lane);  // dK += dS^T Q
    }
  lane_store(dk + (b * T + j) * ks + g * hd, ak, scale, hd, lane);
  lane_store(dv + (b * T + j) * ks + g * hd, av, 1.0f, hd, lane);
}

// ---- Cross-entropy: one block per row ---------------------------------------------------------
__global__ void ce_kernel(const float* __restrict__ logits, const int32_t* __restrict__ targets, int64_t V,
                          int32_t ignore, float grad_scale, float* __restrict__ dlogits, double* __restrict__ row_loss,
                          int32_t* __restrict__ counted, int32_t* bad) {
  const int64_t n = blockIdx.x;
  const float* row = logits + n * V;
  const int32_t t = targets[n];
  if (t == ignore || t < 0 || t >= V) {
    if (threadIdx.x == 0) {
      row_loss[n] = 0.0, counted[n] = 0;
      if (t != ignore) *bad = 1;
    }
    if (dlogits)
      for (int64_t c = threadIdx.x; c < V; c += blockDim.x) dlogits[n * V + c] = 0.0f;
    return;
  }
  float m = -FLT_MAX;
  for (int64_t c = threadIdx.x; c < V; c += blockDim.x) m = fmaxf(m, row[c]);
  m = block_max_f(m);
  double sum = 0;
  for (int64_t c = threadIdx.x; c < V; c += blockDim.x) sum += exp(double(row[c]) - m);
  sum = block_sum(sum);
  const double lse = m + log(sum);
  if (threadIdx.x == 0) row_loss[n] = lse - row[t], counted[n] = 1;
  if (dlogits)
    for (int64_t c = threadIdx.x; c < V; c += blockDim.x)
      dlogits[n * V + c] = float(grad_scale * (exp(double(row[c]) - lse) - (c == t ? 1.0 : 0.0)));
}

// ---- Embedding --------------------------------------------------------------------------------
__global__ void embed_fwd_kernel(const float* __restrict__ table, const int32_t* __restrict__ ids, int64_t N,
                                 int64_t D, float* __restrict__ out) {
  FP8MOE_GRID_STRIDE(e, N * D) out[e] = table[int64_t(ids[e / D]) * D + e % D];
}

__global__ void embed_bwd_kernel(const float* __restrict__ dout, const int32_t* __restrict__ ids, int64_t N,
                                 int64_t D, float* __restrict__ dtable) {
  FP8MOE_GRID_STRIDE(d, D)
    for (int64_t n = 0; n < N; ++n) {
      float* t = &dtable[int64_t(ids[n]) * D + d];
      *t = add_rn(*t, dout[n * D + d]);
    }
}

// ---- Router -----------------------------------------------------------------------------------
__global__ void route_scores_kernel(const float* __restrict__ z, const float* __restrict__ bias, int64_t N, int64_t E,
                                    int64_t k, bool sigmoid, float* __restrict__ prob, int32_t* __restrict__ expert,
                                    float* __restrict__ gate) {
  FP8MOE_GRID_STRIDE(n, N) {
    const float* zr = z + n * E;
    float* p = prob + n * E;
    if (sigmoid) {
      for (int64_t e = 0; e < E; ++e) p[e] = 1.0f / (1.0f + expf(-zr[e]));
    } else {
      float m = zr[0];
      for (int64_t e = 1; e < E; ++e) m = fmaxf(m, zr[e]);
      double sum = 0;
      for (int64_t e = 0; e < E; ++e) sum += exp(double(zr[e]) - m);
      for (int64_t e = 0; e < E; ++e) p[e] = float(exp(double(zr[e]) - m) / sum);
    }
    // Top-k by p + bias, ties to the lower index: k passes of a strict-greater scan (as a stable sort).
    double chosen = 0;
    for (int64_t j = 0; j < k; ++j) {
      int32_t best = -1;
      float best_score = 0.0f;
      for (int64_t e = 0; e < E; ++e) {
        bool taken = false;
        for (int64_t q = 0; q < j; ++q) taken |= expert[n * k + q] == e;
        if (taken) continue;
        const float sc = p[e] + bias[e];
        if (best < 0 || sc > best_score) best = int32_t(e), best_score = sc;
      }
      expert[n * k + j] = best;
      chosen += p[best];
    }
    for (int64_t j = 0; j < k; ++j) {
      const float pe = p[expert[n * k + j]];
      gate[n * k + j] = sigmoid ? float(pe / chosen) : pe;
    }
  }
}

// One thread per expert, assignments in token order: capacity and loads.
__global__ void route_capacity_kernel(const int32_t* __restrict__ expert, int64_t NK, int64_t E, int64_t cap,
                                      uint8_t* __restrict__ kept, float* __restrict__ gate, int64_t* __restrict__ load) {
  FP8MOE_GRID_STRIDE(e, E) {
    int64_t count = 0;
    for (int64_t i = 0; i < NK; ++i) {
      if (expert[i] != e) continue;
      if (count >= cap) {
        kept[i] = 0, gate[i] = 0.0f;
      } else {
        kept[i] = 1, ++count;
      }
    }
    load[e] = count;
  }
}

__global__ void route_offsets_kernel(const int64_t* __restrict__ load, int64_t E, int64_t* __restrict__ offsets) {
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    offsets[0] = 0;
    for (int64_t e = 0; e < E; ++e) offsets[e + 1] = offsets[e] + load[e];
  }
}

__global__ void route_rows_kernel(const int32_t* __restrict__ expert, const uint8_t* __restrict__ kept, int64_t NK,
                                  int64_t k, int64_t E, const int64_t* __restrict__ offsets,
                                  int64_t* __restrict__ row_token, int32_t* __restrict__ row_slot,
                                  int32_t* __restrict__ slot_row) {
  FP8MOE_GRID_STRIDE(e, E) {
    int64_t fill = offsets[e];
    for (int64_t i = 0; i < NK; ++i) {
      if (expert[i] != e) continue;
      if (!kept[i]) {
        slot_row[i] = -1;
        continue;
      }
      row_token[fill] = i / k, row_slot[fill] = int32_t(i % k), slot_row[i] = int32_t(fill);
      ++fill;
    }
  }
}

__global__ void permute_kernel(const float* __restrict__ x, const int64_t* __restrict__ row_token, int64_t R,
                               int64_t D, float* __restrict__ rows) {
  FP8MOE_GRID_STRIDE(e, R * D) rows[e] = x[row_token[e / D] * D + e % D];
}

__global__ void unpermute_kernel(const float* __restrict__ rows, const int32_t* __restrict__ slot_row,
                                 const float* __restrict__ gate, int64_t N, int64_t k, int64_t D,
                                 float* __restrict__ out) {
  FP8MOE_GRID_STRIDE(e, N * D) {
    const int64_t n = e / D, d = e % D;
    float acc = out[e];
    int32_t last = -1;
    for (int64_t step = 0; step < k; ++step) {  // the kept slots in increasing row order
      int32_t next = INT32_MAX;
      int64_t slot = -1;
      for (int64_t j = 0; j < k; ++j) {
        const int32_t r = slot_row[n * k + j];
        if (r > last && r < next) next = r, slot = j;
      }
      if (slot < 0) break;
      acc = add_rn(acc, mul_rn(gate[n * k + slot], rows[int64_t(next) * D + d]));
      last = next;
    }
    out[e] = acc;
  }
}

// ---- Optimizer --------------------------------------------------------------------------------
__global__ void adamw_kernel(AdamWStep h, float* __restrict__ w, float* __restrict__ g, float* __restrict__ m,
                             float* __restrict__ v, uint16_t* __restrict__ m16, uint16_t* __restrict__ v16, int64_t n) {
  FP8MOE_GRID_STRIDE(j, n) {
    float mj = m16 ? bf16_decode(m16[j]) : m[j];
    float vj = v16 ? bf16_decode(v16[j]) : v[j];
    adamw_elem(h, &w[j], &mj, &vj, &g[j]);
    if (m16) {
      m16[j] = bf16_encode(mj), v16[j] = bf16_encode(vj);
    } else {
      m[j] = mj, v[j] = vj;
    }
  }
}

__global__ void bias_update_kernel(float* __restrict__ bias, const int64_t* __restrict__ load, int64_t E, double rate) {
  __shared__ double mean;
  if (threadIdx.x == 0) {
    int64_t total = 0;
    for (int64_t e = 0; e < E; ++e) total += load[e];
    mean = double(total) / double(E);
  }
  __syncthreads();
  for (int64_t e = threadIdx.x; e < E; e += blockDim.x) bias[e] = bias_update_elem(bias[e], mean, load[e], rate);
}

__global__ void sum_squares_kernel(const float* __restrict__ g, int64_t n, double* __restrict__ partial) {
  double s = 0;
  FP8MOE_GRID_STRIDE(j, n) s += double(g[j]) * g[j];
  s = block_sum(s);
  if (threadIdx.x == 0) partial[blockIdx.x] = s;
}

__global__ void sum_partials_kernel(const double* __restrict__ partial, int64_t n, double* out) {
  double s = 0;
  for (int64_t j = threadIdx.x; j < n; j += blockDim.x) s += partial[j];
  s = block_sum(s);
  if (threadIdx.x == 0) *out = s;
}

void check_launch() { CUDA_CHECK(cudaGetLastError()); }

// The arena's blocks are stream-ordered on the compute stream only. Scratch for a kernel on another
// stream: before it is taken (it may be a block that compute-stream work still uses), the compute
// stream's work is finished; before it goes back, the stream's own.
void before_scratch_alloc(cudaStream_t stream) {
  if (has_context() && stream != context().compute) CUDA_CHECK(cudaStreamSynchronize(context().compute));
}
void before_scratch_free(cudaStream_t stream) {
  if (!has_context() || stream != context().compute) CUDA_CHECK(cudaStreamSynchronize(stream));
}

unsigned warps_grid(int64_t warps) {
  const int64_t blocks = (warps * 32 + kThreads - 1) / kThreads;
  FP8MOE_ASSERT(blocks < (int64_t(1) << 31), "too many rows for one launch: ", warps);
  return unsigned(blocks > 0 ? blocks : 1);
}

}  // namespace

void rmsnorm_forward(const float* x, const float* w, int64_t N, int64_t D, float eps, float* y, float* rstd,
                     cudaStream_t stream) {
  if (N == 0) return;
  rmsnorm_fwd_kernel<<<unsigned(N), kThreads, 0, stream>>>(x, w, D, eps, y, rstd);
  check_launch();
}

void rmsnorm_backward(const float* x, const float* w, const float* rstd, const float* dy, int64_t N, int64_t D,
                      float* dx, float* dw, cudaStream_t stream) {
  if (N == 0) return;
  rmsnorm_bwd_dx_kernel<<<unsigned(N), kThreads, 0, stream>>>(x, w, rstd, dy, D, dx);
  rmsnorm_bwd_dw_kernel<<<grid_for(D), kThreads, 0, stream>>>(x, rstd, dy, N, D, dw);
  check_launch();
}

void rope(float* x, int64_t B, int64_t T, int64_t heads, int64_t hd, const float* cs, const float* sn,
          cudaStream_t stream) {
  FP8MOE_ASSERT(hd % 2 == 0, "rope needs an even head_dim, got ", hd);
  const int64_t n = B * T * heads * (hd / 2);
  if (n == 0) return;
  rope_kernel<<<grid_for(n), kThreads, 0, stream>>>(x, B * T, T, heads, hd / 2, cs, sn);
  check_launch();
}

void attention_forward(const float* q, const float* k, const float* v, int64_t B, int64_t T, int64_t H, int64_t KVH,
                       int64_t hd, float* out, float* lse, cudaStream_t stream) {
  FP8MOE_ASSERT(KVH > 0 && H % KVH == 0, "attention: ", H, " heads over ", KVH, " kv heads");
  FP8MOE_ASSERT(hd <= 32 * kMaxPerLane, "cuda attention supports head_dim <= ", 32 * kMaxPerLane, ", got ", hd);
  if (B * T * H == 0) return;
  attn_fwd_kernel<<<warps_grid(B * H * T), kThreads, 0, stream>>>(q, k, v, B, T, H, KVH, hd,
                                                                 float(1.0 / std::sqrt(double(hd))), out, lse);
  check_launch();
}

void attention_backward(const float* q, const float* k, const float* v, const float* out, const float* lse,
                        const float* dout, int64_t B, int64_t T, int64_t H, int64_t KVH, int64_t hd, float* dq,
                        float* dk, float* dv, cudaStream_t stream) {
  FP8MOE_ASSERT(KVH > 0 && H % KVH == 0, "attention: ", H, " heads over ", KVH, " kv heads");
  FP8MOE_ASSERT(hd <= 32 * kMaxPerLane, "cuda attention supports head_dim <= ", 32 * kMaxPerLane, ", got ", hd);
  if (B * T * H == 0) return;
  const float scale = float(1.0 / std::sqrt(double(hd)));
  before_scratch_alloc(stream);
  Buffer<float> delta(B * H * T);
  attn_delta_kernel<<<warps_grid(B * H * T), kThreads, 0, stream>>>(out, dout, B * H * T, T, H, hd, delta.get());
  attn_dq_kernel<<<warps_grid(B * H * T), kThreads, 0, stream>>>(q, k, v, lse, dout, delta.get(), B, T, H, KVH, hd,
                                                                scale, dq);
  attn_dkdv_kernel<<<warps_grid(B * KVH * T), kThreads, 0, stream>>>(q, k, v, lse, dout, delta.get(), B, T, H, KVH,
                                                                    hd, scale, dk, dv);
  check_launch();
  before_scratch_free(stream);
}

void cross_entropy(const float* logits, const int32_t* targets, int64_t N, int64_t V, int32_t ignore,
                   float grad_scale, float* dlogits, double* row_loss, int32_t* counted, int32_t* bad,
                   cudaStream_t stream) {
  if (N == 0) return;
  ce_kernel<<<unsigned(N), kThreads, 0, stream>>>(logits, targets, V, ignore, grad_scale, dlogits, row_loss, counted,
                                                  bad);
  check_launch();
}

void embedding_forward(const float* table, const int32_t* ids, int64_t N, int64_t D, float* out, cudaStream_t stream) {
  if (N * D == 0) return;
  embed_fwd_kernel<<<grid_for(N * D), kThreads, 0, stream>>>(table, ids, N, D, out);
  check_launch();
}

void embedding_backward(const float* dout, const int32_t* ids, int64_t N, int64_t D, float* dtable,
                        cudaStream_t stream) {
  if (N * D == 0) return;
  embed_bwd_kernel<<<grid_for(D), kThreads, 0, stream>>>(dout, ids, N, D, dtable);
  check_launch();
}

void route(const float* z, const float* bias, int64_t N, int64_t E, int64_t k, bool sigmoid, int64_t cap, float* prob,
           int32_t* expert, float* gate, uint8_t* kept, int64_t* load, int64_t* offsets, int64_t* row_token,
           int32_t* row_slot, int32_t* slot_row, cudaStream_t stream) {
  FP8MOE_ASSERT(k >= 1 && k <= E && E <= 1024, "cuda::route: top_k ", k, " of ", E, " experts");
  if (N > 0) {
    route_scores_kernel<<<grid_for(N, 128), 128, 0, stream>>>(z, bias, N, E, k, sigmoid, prob, expert, gate);
    route_capacity_kernel<<<grid_for(E, 128), 128, 0, stream>>>(expert, N * k, E, cap, kept, gate, load);
  } else {
    CUDA_CHECK(cudaMemsetAsync(load, 0, size_t(E) * sizeof(int64_t), stream));
  }
  route_offsets_kernel<<<1, 1, 0, stream>>>(load, E, offsets);
  if (N > 0) route_rows_kernel<<<grid_for(E, 128), 128, 0, stream>>>(expert, kept, N * k, k, E, offsets, row_token,
                                                                     row_slot, slot_row);
  check_launch();
}

void permute(const float* x, const int64_t* row_token, int64_t R, int64_t D, float* rows, cudaStream_t stream) {
  if (R * D == 0) return;
  permute_kernel<<<grid_for(R * D), kThreads, 0, stream>>>(x, row_token, R, D, rows);
  check_launch();
}

void unpermute_add(const float* rows, const int32_t* slot_row, const float* gate, int64_t N, int64_t k, int64_t D,
                   float* out, cudaStream_t stream) {
  if (N * D == 0) return;
  unpermute_kernel<<<grid_for(N * D), kThreads, 0, stream>>>(rows, slot_row, gate, N, k, D, out);
  check_launch();
}

void adamw(const AdamWStep& h, float* w, float* g, float* m, float* v, uint16_t* m16, uint16_t* v16, int64_t n,
           cudaStream_t stream) {
  if (n == 0) return;
  adamw_kernel<<<grid_for(n), kThreads, 0, stream>>>(h, w, g, m, v, m16, v16, n);
  check_launch();
}

void update_router_bias(float* bias, const int64_t* load, int64_t E, double rate, cudaStream_t stream) {
  if (E == 0) return;
  bias_update_kernel<<<1, kThreads, 0, stream>>>(bias, load, E, rate);
  check_launch();
}

void sum_squares(const float* g, int64_t n, double* out, cudaStream_t stream) {
  const unsigned blocks = grid_for(n) < 1024 ? grid_for(n) : 1024;
  before_scratch_alloc(stream);
  Buffer<double> partial(blocks);
  sum_squares_kernel<<<blocks, kThreads, 0, stream>>>(g, n, partial.get());
  sum_partials_kernel<<<1, kThreads, 0, stream>>>(partial.get(), blocks, out);
  check_launch();
  before_scratch_free(stream);
}

}  // namespace fp8moe::cuda
