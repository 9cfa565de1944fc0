#include "model/ffn.h"

namespace fp8moe {

void ffn_forward(Backend& be, const float* x, int64_t M, int64_t D, int64_t F, const FfnWeights& w, const FfnFp8& fp8,
                 float* y, FfnSaved* saved) {
  ffn_forward_grouped(be, D, F, {FfnGroup{x, M, &w, &fp8, y, saved}});
}

void ffn_forward_grouped(Backend& be, int64_t D, int64_t F, const std::vector<FfnGroup>& groups) {
  std::vector<FfnSaved> local(groups.size());
  std::vector<LinearGroup> l1, l3, l2;
  for (size_t g = 0; g < groups.size(); ++g) {
    const FfnGroup& f = groups[g];
    FfnSaved& s = f.saved ? *f.saved : local[g];
    s.h1 = Tensor(be, DType::f32, {f.M, F});
    s.h3 = Tensor(be, DType::f32, {f.M, F});
    l1.push_back({f.x, f.M, f.w->w1, &f.fp8->w1, s.h1.f32(), &s.l1});
    l3.push_back({f.x, f.M, f.w->w3, &f.fp8->w3, s.h3.f32(), &s.l3});
  }
  linear_forward_grouped(be, D, F, l1);
  linear_forward_grouped(be, D, F, l3);
  for (size_t g = 0; g < groups.size(); ++g) {
    const FfnGroup& f = groups[g];
    FfnSaved& s = f.saved ? *f.saved : local[g];
    s.a = Tensor(be, DType::f32, {f.M, F});
    be.swiglu_forward(s.h1.f32(), s.h3.f32(), s.a.f32(), f.M * F);
    l2.push_back({s.a.f32(), f.M, f.w->w2, &f.fp8->w2, f.y, &s.l2});
  }
  linear_forward_grouped(be, F, D, l2);
  for (size_t g = 0; g < groups.size(); ++g) {
    FfnSaved& s = groups[g].saved ? *groups[g].saved : local[g];
    if (!s.l2.needs_fp32_input()) s.a.reset();  // kept in FP8 by the W2 layer
  }
}

void ffn_backward(Backend& be, const FfnSaved& s, const FfnWeights& w, const float* dy, const FfnFp8& fp8, float* dx,
                  const FfnGrads& g) {
  const int64_t M = s.l1.M, D = s.l1.K, F = s.l1.N;
  Tensor da(be, DType::f32, {M, F}), dh1(be, DType::f32, {M, F}), dh3(be, DType::f32, {M, F});
  linear_backward(be, s.l2, w.w2, dy, fp8.w2, da.f32(), g.w2);
  be.swiglu_backward(s.h1.f32(), s.h3.f32(), da.f32(), dh1.f32(), dh3.f32(), M * F);
  Tensor dx3(be, DType::f32, {dx ? M : 0, D});
  linear_backward(be, s.l1, w.w1, dh1.f32(), fp8.w1, dx, g.w1);
  linear_backward(be, s.l3, w.w3, dh3.f32(), fp8.w3, dx ? dx3.f32() : nullptr, g.w3);
  if (dx) be.add(dx, dx3.f32(), dx, M * D);
}

}  // namespace fp8moe
