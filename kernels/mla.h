// DeepSeek-V3's multi-head latent attention (MLA): the keys and values of every head are expanded
// from the compressed kv projection and the one rotary key shared by all heads of a token.
//   kv:  (N, H, nope + vd)   the up-projection of the compressed kv latent, per head: the key's
//                            position-free part (nope elements) then the value (vd elements)
//   kpe: (N, rope)           the rotary part of the key, one per token (RoPE already applied),
//                            the same for every head
//   k:   (N, H, nope + rope) k[n, h] = [kv[n, h, 0:nope] | kpe[n, :]]
//   v:   (N, H, vd)          v[n, h] = kv[n, h, nope:nope + vd]
// so that attention (kernels/attention.h) runs on k with hd = nope + rope and on v with hdv = vd.
//
// Backward, from dk: (N, H, nope + rope) and dv: (N, H, vd):
//   dkv[n, h] = [dk[n, h, 0:nope] | dv[n, h, :]]                       written
//   dkpe[n, j] = sum over h = 0, 1, ..., H-1 of dk[n, h, nope + j]      written (from +0)
// NOTE: dkpe adds the heads in ascending order in FP32 with add_rn (mla_kpe_grad below, shared by
// the CPU loop and the CUDA kernel, one thread per (n, j)): CPU, emulated device and GPU give the
// same bits. N, H, nope, rope or vd may be 0 (H = 0: dkpe is zeros).
#pragma once

#include <cstdint>

#include "kernels/elem.h"

namespace fp8moe {

// dkpe[n, j]: dk[n, h, nope + j] for h = 0, 1, ..., H-1 added in order to +0.
FP8MOE_HD inline float mla_kpe_grad(const float* dk, int64_t n, int64_t j, int64_t H, int64_t nope, int64_t rope) {
  float s = 0.0f;
  for (int64_t h = 0; h < H; ++h) s = add_rn(s, dk[(n * H + h) * (nope + rope) + nope + j]);
  return s;
}

namespace cpu {
void mla_expand_kv(const float* kv, const float* kpe, int64_t N, int64_t H, int64_t nope, int64_t rope, int64_t vd,
                   float* k, float* v);
void mla_expand_kv_backward(const float* dk, const float* dv, int64_t N, int64_t H, int64_t nope, int64_t rope,
                            int64_t vd, float* dkv, float* dkpe);
}  // namespace cpu

}  // namespace fp8moe
