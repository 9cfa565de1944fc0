#include "kernels/mla.h"

#include <algorithm>

#include "kernels/check.h"

namespace fp8moe::cpu {

namespace {
void check_dims(int64_t N, int64_t H, int64_t nope, int64_t rope, int64_t vd) {
  FP8MOE_ASSERT(N >= 0 && H >= 0 && nope >= 0 && rope >= 0 && vd >= 0, "mla: negative size (N ", N, " H ", H,
                " nope ", nope, " rope ", rope, " vd ", vd, ")");
}
}  // namespace

void mla_expand_kv(const float* kv, const float* kpe, int64_t N, int64_t H, int64_t nope, int64_t rope, int64_t vd,
                   float* k, float* v) {
  check_dims(N, H, nope, rope, vd);
  const int64_t kw = nope + rope, kvw = nope + vd;  // row sizes of k and kv per head
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t n = 0; n < N; ++n)
    for (int64_t h = 0; h < H; ++h) {
      const float* src = kv + (n * H + h) * kvw;
      float* kr = k + (n * H + h) * kw;
      std::copy(src, src + nope, kr);
      std::copy(kpe + n * rope, kpe + (n + 1) * rope, kr + nope);
      std::copy(src + nope, src + kvw, v + (n * H + h) * vd);
    }
}

void mla_expand_kv_backward(const float* dk, const float* dv, int64_t N, int64_t H, int64_t nope, int64_t rope,
                            int64_t vd, float* dkv, float* dkpe) {
  check_dims(N, H, nope, rope, vd);
  const int64_t kw = nope + rope, kvw = nope + vd;
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t h = 0; h < H; ++h) {
      const float* dkr = dk + (n * H + h) * kw;
      const float* dvr = dv + (n * H + h) * vd;
      float* out = dkv + (n * H + h) * kvw;
      std::copy(dkr, dkr + nope, out);
      std::copy(dvr, dvr + vd, out + nope);
    }
    for (int64_t j = 0; j < rope; ++j) dkpe[n * rope + j] = mla_kpe_grad(dk, n, j, H, nope, rope);
  }
}

}  // namespace fp8moe::cpu
