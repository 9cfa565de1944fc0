#include "kernels/adamw.h"

#include <algorithm>
#include <vector>

namespace fp8moe::cpu {

void adamw(const AdamWStep& h, float* w, const float* g, float* m, float* v, uint16_t* m16, uint16_t* v16, int64_t n) {
#pragma omp parallel for schedule(static)
  for (int64_t j = 0; j < n; ++j) {
    float mj = m16 ? bf16_decode(m16[j]) : m[j];
    float vj = v16 ? bf16_decode(v16[j]) : v[j];
    adamw_elem(h, &w[j], &mj, &vj, g[j]);
    if (m16) m16[j] = bf16_encode(mj), v16[j] = bf16_encode(vj);
    else m[j] = mj, v[j] = vj;
  }
}

double sum_squares(const float* g, int64_t n, float unscale) {
  constexpr int64_t kChunk = 1 << 14;
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  std::vector<double> part(static_cast<size_t>(chunks), 0.0);
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < chunks; ++c)
    for (int64_t j = c * kChunk; j < std::min(n, (c + 1) * kChunk); ++j) {
      const float x = g[j] * unscale;
      part[c] += double(x) * x;
    }
  double s = 0;
  for (double x : part) s += x;
  return s;
}

double sum(const double* x, int64_t n) {
  double s = 0;
  for (int64_t i = 0; i < n; ++i) s += x[i];
  return s;
}

}  // namespace fp8moe::cpu
