#include "kernels/rmsnorm.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "kernels/cpu/fp8_simd.h"
#include "kernels/cpu/vmath.h"

namespace fp8moe::cpu {

namespace {

// One row: rstd from the sum of squares in double (vmath.h's 16-lane order), y = x r w in FP32.
FP8MOE_SIMD_CLONES void forward_row(const float* x, const float* w, int64_t D, float eps, float* y, float* rstd) {
  const double ss = vm::lane_sum(D, [&](int64_t d) { return double(x[d]) * x[d]; });
  const float r = float(1.0 / std::sqrt(ss / double(D) + eps));
  *rstd = r;
  for (int64_t d = 0; d < D; ++d) y[d] = x[d] * r * w[d];
}

// One row of dx = r (w dy) - x r^3 / D * sum(w dy x), in double (the sum in vmath.h's order).
FP8MOE_SIMD_CLONES void backward_row(const float* x, const float* w, float rstd, const float* g, int64_t D, float* dx) {
  const double r = rstd;
  const double dot = vm::lane_sum(D, [&](int64_t d) { return double(w[d]) * g[d] * x[d]; });
  const double c = dot * r * r * r / double(D);
  for (int64_t d = 0; d < D; ++d) dx[d] = float(r * w[d] * g[d] - c * x[d]);
}

// p[d] += dy[d] x[d] r: one token's term of the weight gradient, element by element.
FP8MOE_SIMD_CLONES void add_dw_term(float* __restrict p, const float* __restrict dy, const float* __restrict x, float r,
                                    int64_t D) {
  for (int64_t d = 0; d < D; ++d) p[d] += dy[d] * x[d] * r;
}

}  // namespace

void rmsnorm_forward(const float* x, const float* w, int64_t N, int64_t D, float eps, float* y, float* rstd) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) forward_row(x + n * D, w, D, eps, y + n * D, rstd + n);
}

void rmsnorm_forward_bf16(const uint16_t* x, const float* w, int64_t N, int64_t D, float eps, float* y, float* rstd) {
  const SimdLevel level = cpu_simd_level();
#pragma omp parallel
  {
    std::vector<float> buf(static_cast<size_t>(D));  // the thread's row, widened
#pragma omp for schedule(static)
    for (int64_t n = 0; n < N; ++n) {
      bf16_to_f32_span(level, x + n * D, buf.data(), D);
      forward_row(buf.data(), w, D, eps, y + n * D, rstd + n);
    }
  }
}

namespace {
// rmsnorm_backward over rows that row_x(n, buffer) gives in FP32 (x itself, or a row widened into
// the thread's buffer).
template <class RowX>
void backward_rows(RowX row_x, const float* w, const float* rstd, const float* dy, int64_t N, int64_t D, float* dx,
                   float* dw) {
  // y = x r w with r = (mean(x^2) + eps)^-1/2:  dx = r (w dy) - x r^3 / D * sum(w dy x).
#pragma omp parallel
  {
    std::vector<float> buf;
#pragma omp for schedule(static)
    for (int64_t n = 0; n < N; ++n) backward_row(row_x(n, buf), w, rstd[n], dy + n * D, D, dx + n * D);
  }
  // dw in kRmsNormDwChunk-token chunks (kernels/rmsnorm.h), the CUDA kernels' order.
  const int64_t chunks = rmsnorm_dw_chunks(N);
  std::vector<float> part(size_t(chunks * D));
#pragma omp parallel
  {
    std::vector<float> buf;
#pragma omp for schedule(static)
    for (int64_t c = 0; c < chunks; ++c) {
      float* p = part.data() + c * D;
      for (int64_t d = 0; d < D; ++d) p[d] = 0.0f;
      for (int64_t n = c * kRmsNormDwChunk; n < std::min(N, (c + 1) * kRmsNormDwChunk); ++n)
        add_dw_term(p, dy + n * D, row_x(n, buf), rstd[n], D);
    }
  }
  for (int64_t c = 0; c < chunks; ++c)
    for (int64_t d = 0; d < D; ++d) dw[d] += part[size_t(c * D + d)];
}
}  // namespace

void rmsnorm_backward(const float* x, const float* w, const float* rstd, const float* dy, int64_t N, int64_t D,
                      float* dx, float* dw) {
  backward_rows([&](int64_t n, std::vector<float>&) { return x + n * D; }, w, rstd, dy, N, D, dx, dw);
}

void rmsnorm_backward_bf16(const uint16_t* x, const float* w, const float* rstd, const float* dy, int64_t N, int64_t D,
                           float* dx, float* dw) {
  const SimdLevel level = cpu_simd_level();
  backward_rows(
      [&](int64_t n, std::vector<float>& buf) {
        buf.resize(size_t(D));
        bf16_to_f32_span(level, x + n * D, buf.data(), D);
        return static_cast<const float*>(buf.data());
      },
      w, rstd, dy, N, D, dx, dw);
}

}  // namespace fp8moe::cpu
