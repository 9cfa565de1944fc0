#include "kernels/rmsnorm.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace fp8moe::cpu {

void rmsnorm_forward(const float* x, const float* w, int64_t N, int64_t D, float eps, float* y, float* rstd) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const float* xr = x + n * D;
    double ss = 0;
    for (int64_t d = 0; d < D; ++d) ss += double(xr[d]) * xr[d];
    const float r = float(1.0 / std::sqrt(ss / double(D) + eps));
    rstd[n] = r;
    for (int64_t d = 0; d < D; ++d) y[n * D + d] = xr[d] * r * w[d];
  }
}

void rmsnorm_backward(const float* x, const float* w, const float* rstd, const float* dy, int64_t N, int64_t D,
                      float* dx, float* dw) {
  // y = x r w with r = (mean(x^2) + eps)^-1/2:  dx = r (w dy) - x r^3 / D * sum(w dy x).
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const float *xr = x + n * D, *g = dy + n * D;
    const double r = rstd[n];
    double dot = 0;
    for (int64_t d = 0; d < D; ++d) dot += double(w[d]) * g[d] * xr[d];
    const double c = dot * r * r * r / double(D);
    for (int64_t d = 0; d < D; ++d) dx[n * D + d] = float(r * w[d] * g[d] - c * xr[d]);
  }
  // dw in kRmsNormDwChunk-token chunks (kernels/rmsnorm.h), the CUDA kernels' order.
  const int64_t chunks = rmsnorm_dw_chunks(N);
  std::vector<float> part(size_t(chunks * D));
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < chunks; ++c) {
    float* p = part.data() + c * D;
    for (int64_t d = 0; d < D; ++d) p[d] = 0.0f;
    for (int64_t n = c * kRmsNormDwChunk; n < std::min(N, (c + 1) * kRmsNormDwChunk); ++n)
      for (int64_t d = 0; d < D; ++d) p[d] += dy[n * D + d] * x[n * D + d] * rstd[n];
  }
  for (int64_t c = 0; c < chunks; ++c)
    for (int64_t d = 0; d < D; ++d) dw[d] += part[size_t(c * D + d)];
}

}  // namespace fp8moe::cpu
