// MLA's key/value expansion on the GPU (kernels/mla.h): grid-stride copies, and the rotary key's
// gradient one thread per (n, j), each a serial loop over the heads.
//
// Against kernels/cpu/mla.cpp: bitwise. The copies move bits; dkpe is kernels/mla.h's
// mla_kpe_grad on both sides (FP32 additions in ascending head order, __fadd_rn on the device).
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/mla.h"
#include "kernels/mla.h"

namespace fp8moe::cuda {
namespace {

// Element e of (N, H, nope + rope + vd): column c < nope is k's and kv's, the next rope columns
// k's from kpe, the last vd columns v's from kv.
__global__ void mla_expand_kernel(const float* __restrict__ kv, const float* __restrict__ kpe, int64_t n_elems,
                                  int64_t H, int64_t nope, int64_t rope, int64_t vd, float* __restrict__ k,
                                  float* __restrict__ v) {
  const int64_t w = nope + rope + vd;
  FP8MOE_GRID_STRIDE(e, n_elems) {
    const int64_t c = e % w, nh = e / w, n = nh / H;
    if (c < nope) k[nh * (nope + rope) + c] = kv[nh * (nope + vd) + c];
    else if (c < nope + rope) k[nh * (nope + rope) + c] = kpe[n * rope + (c - nope)];
    else v[nh * vd + (c - nope - rope)] = kv[nh * (nope + vd) + nope + (c - nope - rope)];
  }
}

// dkv[n, h] = [dk[n, h, 0:nope] | dv[n, h, :]], element e of (N, H, nope + vd).
__global__ void mla_dkv_kernel(const float* __restrict__ dk, const float* __restrict__ dv, int64_t n_elems,
                               int64_t nope, int64_t rope, int64_t vd, float* __restrict__ dkv) {
  const int64_t w = nope + vd;
  FP8MOE_GRID_STRIDE(e, n_elems) {
    const int64_t c = e % w, nh = e / w;
    dkv[e] = c < nope ? dk[nh * (nope + rope) + c] : dv[nh * vd + (c - nope)];
  }
}

// dkpe[n, j], element e = n rope + j of (N, rope).
__global__ void mla_dkpe_kernel(const float* __restrict__ dk, int64_t n_elems, int64_t H, int64_t nope, int64_t rope,
                                float* __restrict__ dkpe) {
  FP8MOE_GRID_STRIDE(e, n_elems) dkpe[e] = mla_kpe_grad(dk, e / rope, e % rope, H, nope, rope);
}

void check_dims(int64_t N, int64_t H, int64_t nope, int64_t rope, int64_t vd) {
  FP8MOE_ASSERT(N >= 0 && H >= 0 && nope >= 0 && rope >= 0 && vd >= 0, "mla: negative size (N ", N, " H ", H,
                " nope ", nope, " rope ", rope, " vd ", vd, ")");
}

}  // namespace

void mla_expand_kv(const float* kv, const float* kpe, int64_t N, int64_t H, int64_t nope, int64_t rope, int64_t vd,
                   float* k, float* v, cudaStream_t stream) {
  check_dims(N, H, nope, rope, vd);
  const int64_t n = N * H * (nope + rope + vd);
  if (n == 0) return;
  mla_expand_kernel<<<grid_for(n), kBlockThreads, 0, stream>>>(kv, kpe, n, H, nope, rope, vd, k, v);
  check_launch();
}

void mla_expand_kv_backward(const float* dk, const float* dv, int64_t N, int64_t H, int64_t nope, int64_t rope,
                            int64_t vd, float* dkv, float* dkpe, cudaStream_t stream) {
  check_dims(N, H, nope, rope, vd);
  if (const int64_t n = N * H * (nope + vd); n > 0) {
    mla_dkv_kernel<<<grid_for(n), kBlockThreads, 0, stream>>>(dk, dv, n, nope, rope, vd, dkv);
    check_launch();
  }
  if (const int64_t n = N * rope; n > 0) {  // H = 0 writes zeros
    mla_dkpe_kernel<<<grid_for(n), kBlockThreads, 0, stream>>>(dk, n, H, nope, rope, dkpe);
    check_launch();
  }
}

}  // namespace fp8moe::cuda
