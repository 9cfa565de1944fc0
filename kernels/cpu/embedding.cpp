#include "kernels/embedding.h"

#include <algorithm>

namespace fp8moe::cpu {

void embedding_forward(const float* table, const int32_t* ids, int64_t N, int64_t D, int64_t v0, int64_t Vl,
                       float* out) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const int64_t t = int64_t(ids[n]) - v0;
    if (t >= 0 && t < Vl) std::copy_n(table + t * D, D, out + n * D);
    else std::fill_n(out + n * D, D, 0.0f);
  }
}

void embedding_backward(const float* dout, const int32_t* ids, int64_t N, int64_t D, int64_t v0, int64_t Vl,
                        float* dtable) {
  // Serial over tokens: repeated ids add into the same row (deterministic order).
  for (int64_t n = 0; n < N; ++n) {
    const int64_t t = int64_t(ids[n]) - v0;
    if (t >= 0 && t < Vl)
      for (int64_t d = 0; d < D; ++d) dtable[t * D + d] += dout[n * D + d];
  }
}

}  // namespace fp8moe::cpu
