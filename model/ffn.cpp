#include "model/ffn.h"

#include "kernels/dispatch.h"
#include "kernels/swiglu.h"

namespace fp8moe {

void ffn_forward(const float* x, int64_t M, int64_t D, int64_t F, const FfnWeights& w, const FfnFp8& fp8, float* y,
                 FfnSaved* saved) {
  FfnSaved local;
  FfnSaved& s = saved ? *saved : local;
  s.h1.resize(size_t(M * F));
  s.h3.resize(size_t(M * F));
  linear_forward(x, M, D, w.w1, F, fp8.w1, s.h1.data(), &s.l1);
  linear_forward(x, M, D, w.w3, F, fp8.w3, s.h3.data(), &s.l3);
  s.a.resize(size_t(M * F));
  dev::swiglu_forward(s.h1.data(), s.h3.data(), s.a.data(), M * F);
  linear_forward(s.a.data(), M, F, w.w2, D, fp8.w2, y, &s.l2);
  if (!s.l2.needs_fp32_input()) s.a = std::vector<float>();  // kept in FP8 by the W2 layer
}

void ffn_backward(const FfnSaved& s, const FfnWeights& w, const float* dy, const FfnFp8& fp8, float* dx,
                  const FfnGrads& g) {
  const int64_t M = s.l1.M, D = s.l1.K, F = s.l1.N;
  std::vector<float> da(size_t(M * F)), dh1(size_t(M * F)), dh3(size_t(M * F));
  linear_backward(s.l2, w.w2, dy, fp8.w2, da.data(), g.w2);
  dev::swiglu_backward(s.h1.data(), s.h3.data(), da.data(), dh1.data(), dh3.data(), M * F);
  std::vector<float> dx3(dx ? size_t(M * D) : 0);
  linear_backward(s.l1, w.w1, dh1.data(), fp8.w1, dx, g.w1);
  linear_backward(s.l3, w.w3, dh3.data(), fp8.w3, dx ? dx3.data() : nullptr, g.w3);
  if (dx)
    for (int64_t i = 0; i < M * D; ++i) dx[i] += dx3[i];
}

}  // namespace fp8moe
