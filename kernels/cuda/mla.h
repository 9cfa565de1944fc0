// CUDA launchers for kernels/mla.h (MLA's key/value expansion). Device memory, queued on
// `stream`; any size may be 0.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace fp8moe::cuda {

// kv: (N, H, nope + vd), kpe: (N, rope) -> k: (N, H, nope + rope), v: (N, H, vd), written.
void mla_expand_kv(const float* kv, const float* kpe, int64_t N, int64_t H, int64_t nope, int64_t rope, int64_t vd,
                   float* k, float* v, cudaStream_t stream);
// dk: (N, H, nope + rope), dv: (N, H, vd) -> dkv: (N, H, nope + vd), dkpe: (N, rope) (the heads
// added in ascending order, mla_kpe_grad), written.
void mla_expand_kv_backward(const float* dk, const float* dv, int64_t N, int64_t H, int64_t nope, int64_t rope,
                            int64_t vd, float* dkv, float* dkpe, cudaStream_t stream);

}  // namespace fp8moe::cuda
