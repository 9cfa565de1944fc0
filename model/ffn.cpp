#include "model/ffn.h"

namespace fp8moe {

void ffn_forward(Backend& be, const float* x, int64_t M, int64_t D, int64_t F, const FfnWeights& w, const FfnFp8& fp8,
                 float* y, FfnSaved* saved) {
  ffn_forward_grouped(be, D, F, {FfnGroup{x, M, &w, &fp8, y, saved}});
}

void ffn_forward_grouped(Backend& be, int64_t D, int64_t F, const std::vector<FfnGroup>& groups) {
  std::vector<FfnSaved> local(groups.size());  // for the groups without a saved (no backward)
  std::vector<FfnSaved*> saved(groups.size());
  for (size_t g = 0; g < groups.size(); ++g) saved[g] = groups[g].saved ? groups[g].saved : &local[g];
  std::vector<LinearGroup> l1, l3, l2;
  for (size_t g = 0; g < groups.size(); ++g) {
    const FfnGroup& f = groups[g];
    FfnSaved& s = *saved[g];
    s.h1 = Tensor(be, DType::f32, {f.M, F});
    s.h3 = Tensor(be, DType::f32, {f.M, F});
    l1.push_back({f.x, f.M, f.w->w1, &f.fp8->w1, s.h1.f32(), &s.l1});
    l3.push_back({f.x, f.M, f.w->w3, &f.fp8->w3, s.h3.f32(), &s.l3});
  }
  linear_forward_grouped(be, D, F, l1);
  linear_forward_grouped(be, D, F, l3);
  for (size_t g = 0; g < groups.size(); ++g) {
    const FfnGroup& f = groups[g];
    FfnSaved& s = *saved[g];
    s.a = Tensor(be, DType::f32, {f.M, F});
    be.swiglu_forward(s.h1.f32(), s.h3.f32(), s.a.f32(), f.M * F);
    l2.push_back({s.a.f32(), f.M, f.w->w2, &f.fp8->w2, f.y, &s.l2});
  }
  linear_forward_grouped(be, F, D, l2);
  for (FfnSaved* s : saved)
    if (!s->l2.needs_fp32_input()) s->a.reset();  // kept in FP8 by the W2 layer
}

void ffn_backward(Backend& be, const FfnSaved& s, const FfnWeights& w, const float* dy, const FfnFp8& fp8, float* dx,
                  const FfnGrads& g) {
  ffn_backward_grouped(be, {FfnGradGroup{&s, &w, dy, &fp8, dx, &g}});
}

void ffn_backward_grouped(Backend& be, const std::vector<FfnGradGroup>& groups) {
  struct Scratch {
    Tensor da, dh1, dh3, dx3;
  };
  std::vector<Scratch> t(groups.size());
  std::vector<LinearGradGroup> l2, l1, l3;
  for (size_t i = 0; i < groups.size(); ++i) {
    const FfnGradGroup& f = groups[i];
    const FfnSaved& s = *f.saved;
    const int64_t M = s.l1.M, D = s.l1.K, F = s.l1.N;
    t[i].da = Tensor(be, DType::f32, {M, F});
    t[i].dh1 = Tensor(be, DType::f32, {M, F});
    t[i].dh3 = Tensor(be, DType::f32, {M, F});
    t[i].dx3 = Tensor(be, DType::f32, {f.dx ? M : 0, D});
    l2.push_back({&s.l2, f.w->w2, f.dy, &f.fp8->w2, t[i].da.f32(), f.g->w2});
    l1.push_back({&s.l1, f.w->w1, t[i].dh1.f32(), &f.fp8->w1, f.dx, f.g->w1});
    l3.push_back({&s.l3, f.w->w3, t[i].dh3.f32(), &f.fp8->w3, f.dx ? t[i].dx3.f32() : nullptr, f.g->w3});
  }
  linear_backward_grouped(be, l2);
  for (size_t i = 0; i < groups.size(); ++i) {
    const FfnSaved& s = *groups[i].saved;
    be.swiglu_backward(s.h1.f32(), s.h3.f32(), t[i].da.f32(), t[i].dh1.f32(), t[i].dh3.f32(), s.l1.M * s.l1.N);
    t[i].da.reset();  // every expert's temporaries are alive at once: each freed when it is read
  }
  linear_backward_grouped(be, l1);
  for (Scratch& x : t) x.dh1.reset();
  linear_backward_grouped(be, l3);
  for (size_t i = 0; i < groups.size(); ++i) {
    const FfnGradGroup& f = groups[i];
    if (f.dx) be.add(f.dx, t[i].dx3.f32(), f.dx, f.saved->l1.M * f.saved->l1.K);
  }
}

}  // namespace fp8moe
