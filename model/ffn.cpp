#include "model/ffn.h"

#include "kernels/check.h"

namespace fp8moe {

void ffn_forward(Backend& be, const float* x, int64_t M, int64_t D, int64_t F, const FfnWeights& w, const FfnFp8& fp8,
                 float* y, FfnSaved* saved, ActivationDtype activations, bool rebuild_a) {
  ffn_forward_grouped(be, D, F, {FfnGroup{x, M, &w, &fp8, y, saved}}, activations, rebuild_a);
}

bool fuses_w13(const FfnWeights& w, const FfnFp8& fp8, int64_t F, int64_t D) {
  if (w.w3 != w.w1 + F * D) return false;
  if (!fp8.w1.enabled()) return !fp8.w3.enabled();
  const Fp8Config& c = *fp8.w1.cfg;
  if (!fp8.w3.enabled() || fp8.w3.cfg != &c) return false;
  return c.recipe != Fp8Recipe::blockwise || F % c.tile == 0;
}

namespace {
// The SwiGLU of the pre-activations a, b (row stride ld), each row scaled by its gate where given.
void swiglu(Backend& be, const float* a, const float* b, int64_t ld, const float* gate, float* y, int64_t M,
            int64_t F) {
  if (gate)
    be.swiglu_gated_forward(a, b, ld, gate, y, M, F);
  else
    be.swiglu_forward(a, b, ld, y, M, F);
}
}  // namespace

void ffn_forward_grouped(Backend& be, int64_t D, int64_t F, const std::vector<FfnGroup>& groups,
                         ActivationDtype activations, bool rebuild_a) {
  const bool bf16 = activations == ActivationDtype::bf16;
  std::vector<FfnSaved> local(groups.size());  // for the groups without a saved (no backward)
  std::vector<FfnSaved*> saved(groups.size());
  for (size_t g = 0; g < groups.size(); ++g) saved[g] = groups[g].saved ? groups[g].saved : &local[g];
  // The fused groups' W13 layers in one grouped call; the others' W1 and W3 in one each.
  std::vector<LinearGroup> l13, l1, l3, l2;
  std::vector<char> kept(groups.size());  // a backward follows and reads what the group keeps
  for (size_t g = 0; g < groups.size(); ++g) {
    const FfnGroup& f = groups[g];
    FfnSaved& s = *saved[g];
    s.fused = fuses_w13(*f.w, *f.fp8, F, D);
    s.h3.reset(), s.l3 = LinearSaved{};
    s.a_rebuilt = false, s.h1q = QTensor{}, s.h3q = QTensor{};
    if (s.fused) {
      s.h1 = Tensor(be, DType::f32, {f.M, 2 * F});
      l13.push_back({f.x, f.M, f.w->w1, &f.fp8->w1, s.h1.f32(), &s.l1, f.xq});
      continue;
    }
    s.h1 = Tensor(be, DType::f32, {f.M, F});
    s.h3 = Tensor(be, DType::f32, {f.M, F});
    l1.push_back({f.x, f.M, f.w->w1, &f.fp8->w1, s.h1.f32(), &s.l1, f.xq});
    l3.push_back({f.x, f.M, f.w->w3, &f.fp8->w3, s.h3.f32(), &s.l3, f.xq});
  }
  if (!l13.empty()) linear_forward_grouped(be, D, 2 * F, l13);
  if (!l1.empty()) linear_forward_grouped(be, D, F, l1);
  if (!l3.empty()) linear_forward_grouped(be, D, F, l3);
  for (size_t g = 0; g < groups.size(); ++g) {
    const FfnGroup& f = groups[g];
    FfnSaved& s = *saved[g];
    if (bf16) {  // the pre-activations: a rounding point
      be.round_bf16(s.h1.f32(), s.h1.f32(), s.h1.numel());
      if (!s.h3.empty()) be.round_bf16(s.h3.f32(), s.h3.f32(), s.h3.numel());
    }
    s.a = Tensor(be, DType::f32, {f.M, F});
    s.gate = f.gate;
    if (s.fused) {
      if (f.M > 0) swiglu(be, s.h1.f32(), s.h1.f32() + F, 2 * F, f.gate, s.a.f32(), f.M, F);  // (no rows: no memory)
    } else
      swiglu(be, s.h1.f32(), s.h3.f32(), F, f.gate, s.a.f32(), f.M, F);
    l2.push_back({s.a.f32(), f.M, f.w->w2, &f.fp8->w2, f.y, &s.l2});
    if (f.fp8->w2.enabled()) {  // W2's FP8 input made now: one expert's FP32 SwiGLU output at a time
      linear_quantize_input(be, F, l2.back());
      l2.back().x_quantized = true, l2.back().x = nullptr;
      s.a.reset();
    }
    // The pre-activations as the backward keeps them, made now: no expert's FP32 copy is held
    // through W2's forward.
    kept[g] = f.saved && f.fp8->w2.backward_follows;
    const LinearFp8& w2 = f.fp8->w2;
    if (!kept[g]) {
      if (!f.saved) s.h1.reset(), s.h3.reset();  // (read no more)
    } else if (rebuild_a && w2.enabled() && w2.cfg->recipe == Fp8Recipe::blockwise && w2.cfg->cache_activations) {
      s.h1q = quantize_1xT(be, s.h1.f32(), s.h1.shape()[0], s.h1.shape()[1], *w2.cfg, nullptr);
      s.h1.reset();
      if (!s.h3.empty()) s.h3q = quantize_1xT(be, s.h3.f32(), f.M, F, *w2.cfg, nullptr), s.h3.reset();
    } else if (bf16) {
      stash_bf16(be, &s.h1), stash_bf16(be, &s.h3);
    }
  }
  linear_forward_grouped(be, F, D, l2);
  for (size_t g = 0; g < groups.size(); ++g) {
    FfnSaved* s = saved[g];
    if (kept[g] && rebuild_a) {  // made again from h1, h3 in backward
      s->a_rebuilt = true;
      s->l2.x = nullptr, s->l2.xq = QTensor{}, s->l2.xt = QTensor{};
      s->a.reset();
    }
    if (!s->l2.needs_fp32_input()) s->a.reset();  // kept in FP8 by the W2 layer
  }
}

namespace {
// The FP32 values of a kept pre-activation: its own, widened from BF16, or dequantized from FP8.
const float* pre_activation(Backend& be, const Tensor& kept, const QTensor& fp8, Tensor* tmp) {
  if (fp8.empty()) return unstash(be, kept, tmp);
  *tmp = Tensor(be, DType::f32, {fp8.rows, fp8.cols});
  if (fp8.rows * fp8.cols > 0) be.dequantize(fp8.view(), tmp->f32());
  return tmp->f32();
}

// The pre-activations are kept in BF16 (train.activations bf16, not in FP8).
bool kept_bf16(const FfnSaved& s) {
  return s.h1q.empty() && s.h1.dtype() == DType::bf16 && (s.fused || s.h3.dtype() == DType::bf16);
}
}  // namespace

void ffn_backward(Backend& be, const FfnSaved& s, const FfnWeights& w, const float* dy, const FfnFp8& fp8, float* dx,
                  const FfnGrads& g, LaterWork* wgrad_later) {
  ffn_backward_grouped(be, {FfnGradGroup{&s, &w, dy, &fp8, dx, &g}}, wgrad_later);
}

void ffn_backward_grouped(Backend& be, const std::vector<FfnGradGroup>& groups, LaterWork* wgrad_later) {
  struct Scratch {
    Tensor da, dh1, dh3, dx3;  // fused: dh1 is (M, 2F), [d gate | d up] per row
    LinearGradQuant q1, q3;    // dh1's and dh3's FP8 copies (FP8 layers)
  };
  // What the wgrad GEMMs read that is made here: alive until they have run (here, or at wgrad_later).
  struct Made {
    std::vector<Scratch> t;
    std::vector<LinearSaved> l2_again;  // train.recompute selective: W2's input made again
    std::vector<Tensor> a_again;        // (the SwiGLU output itself while W2 is FP32)
  };
  // A scoped wgrad_later reads what is made here (kept alive for it); a detached one copies it.
  const bool scoped = wgrad_later && !wgrad_later->detached;
  auto made = std::make_shared<Made>();
  made->t.resize(groups.size()), made->l2_again.resize(groups.size()), made->a_again.resize(groups.size());
  std::vector<Scratch>& t = made->t;
  std::vector<LinearSaved>& l2_again = made->l2_again;
  std::vector<Tensor>& a_again = made->a_again;
  std::vector<LinearGradGroup> l2, l13, l1, l3;
  for (size_t i = 0; i < groups.size(); ++i) {
    const FfnGradGroup& f = groups[i];
    const FfnSaved& s = *f.saved;
    const int64_t M = s.l1.M, F = s.l2.K;
    const LinearSaved* s2 = &s.l2;
    if (s.a_rebuilt) {  // the forward's SwiGLU of the kept h1, h3 (the same bits, unless kept in FP8)
      a_again[i] = Tensor(be, DType::f32, {M, F});
      const int64_t ld = s.fused ? 2 * F : F;
      if (M == 0) {
        // (no rows: no memory, and no pointer into it)
      } else if (kept_bf16(s)) {  // read as kept (the same bits as widened first)
        const uint16_t* h1 = s.h1.data<uint16_t>();
        be.swiglu_forward_bf16(h1, s.fused ? h1 + F : s.h3.data<uint16_t>(), ld, s.gate, a_again[i].f32(), M, F);
      } else {
        Tensor h1_32, h3_32;
        const float *h1 = pre_activation(be, s.h1, s.h1q, &h1_32), *h3 = pre_activation(be, s.h3, s.h3q, &h3_32);
        swiglu(be, h1, s.fused ? h1 + F : h3, ld, s.gate, a_again[i].f32(), M, F);
      }
      linear_reinput(be, s.l2, a_again[i].f32(), f.fp8->w2, &l2_again[i]);
      if (!l2_again[i].needs_fp32_input()) a_again[i].reset();
      s2 = &l2_again[i];
    }
    t[i].da = Tensor(be, DType::f32, {M, F});
    l2.push_back({s2, f.w->w2, f.dy, &f.fp8->w2, t[i].da.f32(), f.g->w2, f.dyq});
  }
  linear_backward_grouped(be, l2, wgrad_later);
  if (!scoped) l2_again.clear(), a_again.clear();
  // The pre-activations' gradients, made here rather than before W2's backward (which does not
  // need them), and handed to W1's and W3's, which free them once quantized (FP8 layers).
  for (size_t i = 0; i < groups.size(); ++i) {
    const FfnGradGroup& f = groups[i];
    const FfnSaved& s = *f.saved;
    const int64_t M = s.l1.M, D = s.l1.K, F = s.l2.K;
    if (s.fused) {
      FP8MOE_ASSERT(f.g->w3 == f.g->w1 + F * D, "ffn_backward: fused W1|W3 needs W3's gradient after W1's");
      t[i].dh1 = Tensor(be, DType::f32, {M, 2 * F});
      l13.push_back({&s.l1, f.w->w1, t[i].dh1.f32(), &f.fp8->w1, f.dx, f.g->w1, nullptr, &t[i].dh1});
    } else {
      t[i].dh1 = Tensor(be, DType::f32, {M, F});
      t[i].dh3 = Tensor(be, DType::f32, {M, F});
      t[i].dx3 = Tensor(be, DType::f32, {f.dx ? M : 0, D});
      l1.push_back({&s.l1, f.w->w1, t[i].dh1.f32(), &f.fp8->w1, f.dx, f.g->w1, nullptr, &t[i].dh1});
      l3.push_back({&s.l3, f.w->w3, t[i].dh3.f32(), &f.fp8->w3, f.dx ? t[i].dx3.f32() : nullptr, f.g->w3, nullptr,
                    &t[i].dh3});
    }
    if (M > 0) {  // (no rows: no memory, and no pointer into it)
      const int64_t ld = s.fused ? 2 * F : F;  // fused: [gate | up] per row
      float *dh_a = t[i].dh1.f32(), *dh_b = s.fused ? t[i].dh1.f32() + F : t[i].dh3.f32();
      FP8MOE_ASSERT(!s.gate || groups[i].dgate, "ffn_backward: a gated FFN needs somewhere for its gates' gradient");
      if (kept_bf16(s)) {
        // Kept in BF16: read as they are (the same bits as widened first).
        const uint16_t* h1 = s.h1.data<uint16_t>();
        const uint16_t* up = s.fused ? h1 + F : s.h3.data<uint16_t>();
        be.swiglu_backward_bf16(h1, up, ld, s.gate, t[i].da.f32(), dh_a, dh_b, s.gate ? groups[i].dgate : nullptr, M, F);
      } else {
        Tensor h1_32, h3_32;  // FP32 copies of pre-activations kept in FP8 (freed before dh's quantization)
        const float *h1 = pre_activation(be, s.h1, s.h1q, &h1_32), *h3 = pre_activation(be, s.h3, s.h3q, &h3_32);
        const float* up = s.fused ? h1 + F : h3;
        if (s.gate)
          be.swiglu_gated_backward(h1, up, ld, s.gate, t[i].da.f32(), dh_a, dh_b, groups[i].dgate, M, F);
        else
          be.swiglu_backward(h1, up, ld, t[i].da.f32(), dh_a, dh_b, M, F);
      }
    }
    t[i].da.reset();  // every expert's temporaries are alive at once: each freed when it is read
    // An FP8 layer's pre-activation gradients quantized now and handed to its backward, their FP32
    // copy (the group's dy_owned) freed before the next expert's exists (the same bits as W1's and
    // W3's backward quantizing them).
    auto ahead = [&](LinearGradGroup& l, LinearGradQuant* q) {
      if (!l.fp8->enabled()) return;
      quantize_output_grad(be, l, q);
      l.dy_ahead = q, l.dy_owned->reset();
    };
    if (s.fused)
      ahead(l13.back(), &t[i].q1);
    else
      ahead(l1.back(), &t[i].q1), ahead(l3.back(), &t[i].q3);
  }
  if (!l13.empty()) linear_backward_grouped(be, l13, wgrad_later);
  if (!l1.empty()) linear_backward_grouped(be, l1, wgrad_later);
  if (!scoped)
    for (Scratch& x : t) x.dh1.reset();
  if (!l3.empty()) linear_backward_grouped(be, l3, wgrad_later);
  for (size_t i = 0; i < groups.size(); ++i) {
    const FfnGradGroup& f = groups[i];
    if (f.dx && !f.saved->fused) be.add(f.dx, t[i].dx3.f32(), f.dx, f.saved->l1.M * f.saved->l1.K);
    if (wgrad_later) t[i].dx3.reset(), t[i].da.reset();
  }
  if (scoped) wgrad_later->steps.push_back([made] {});  // (what the steps read, freed after them)
}

}  // namespace fp8moe
