#include "model/linear.h"

#include "kernels/check.h"

namespace fp8moe {
namespace {

ScaleOptions scale_options(const Fp8Config& c) { return {c.margin, c.power_of_two_scales}; }
DelayedScalingCompute compute_of(const Fp8Config& c) {
  return c.amax_compute == AmaxCompute::max ? DelayedScalingCompute::max : DelayedScalingCompute::most_recent;
}

void init_delayed(Backend& be, DelayedState* st, int history_len) {
  *st = delayed_from_host(be, make_delayed_scaling(history_len));
}

// One scale for the whole tensor, by the current or the delayed recipe, into out (per-tensor).
// The order of the delayed recipe is kernels/quantize.h's quantize_delayed: the scale in use
// becomes the last used one, the tensor is quantized with it, then its amax (reduced) enters the
// history and the next scale is computed from it.
void quantize_per_tensor(Backend& be, const float* x, int64_t rows, int64_t cols, Fp8Dtype dt, const LinearFp8& f,
                         DelayedState* st, uint64_t* counts, QTensor* out) {
  const Fp8Config& c = *f.cfg;
  *out = QTensor(be, rows, cols, dt, Tiling::per_tensor, 1);
  if (c.recipe == Fp8Recipe::delayed) {
    FP8MOE_ASSERT(st, "delayed scaling needs the layer's LinearScaling state");
    if (st->empty()) init_delayed(be, st, c.amax_history_len);
    float* scale = st->scale.f32();
    if (!f.record) {  // recomputation: the forward's scale; evaluation: the current one; no history step
      be.quantize_scaled(x, f.reuse_last_scale ? scale + 1 : scale, out->view(), counts);
      return;
    }
    be.copy(scale + 1, scale, sizeof(float));
    Tensor a(be, DType::f32, {1});
    be.quantize_scaled(x, scale, out->view(), counts, a.f32());  // the bytes and this step's amax, one read
    if (f.reduce) f.reduce(a.f32(), 1);
    be.delayed_update(st->history.f32(), st->history.numel(), st->steps, a.f32(), compute_of(c), dt, scale_options(c),
                      scale);
    ++st->steps;
    return;
  }
  Tensor s;
  quantize_current(be, x, c, f.reduce, counts, &s, out);
}

void quantize_tiled(Backend& be, const float* x, int64_t rows, int64_t cols, Tiling tiling, const Fp8Config& c,
                    uint64_t* counts, QTensor* out) {
  *out = QTensor(be, rows, cols, Fp8Dtype::e4m3, tiling, c.tile);
  if (rows * cols > 0) be.quantize_tiled(x, scale_options(c), out->view(), counts);
}

// Blockwise: x's 1 x T copy (counted) and T x 1 copy (not counted) from one read of it.
void quantize_tiled_pair(Backend& be, const float* x, int64_t rows, int64_t cols, const Fp8Config& c,
                         uint64_t* counts, QTensor* rows_out, QTensor* cols_out) {
  *rows_out = QTensor(be, rows, cols, Fp8Dtype::e4m3, Tiling::rows_1xT, c.tile);
  *cols_out = QTensor(be, rows, cols, Fp8Dtype::e4m3, Tiling::cols_Tx1, c.tile);
  be.quantize_tiled_pair(x, scale_options(c), rows_out->view(), counts, cols_out->view(), nullptr);
}

// An operand the caller quantized, (rows, cols): for a blockwise layer E4M3 1 x T tiles of its
// tile; for a per-tensor one a per-tensor tensor of `dt` (E4M3, or a hybrid layer's E5M2 gradient).
void check_prequantized(const QuantView& q, int64_t rows, int64_t cols, const LinearFp8& f, Fp8Dtype dt,
                        const char* what) {
  FP8MOE_ASSERT(f.enabled(), what, " given in FP8 to a layer whose FP8 is off");
  if (f.cfg->recipe == Fp8Recipe::blockwise)
    FP8MOE_ASSERT(q.tiling == Tiling::rows_1xT && q.tile == f.cfg->tile && q.dtype == Fp8Dtype::e4m3, what,
                  " given in FP8 is not in E4M3 1 x ", f.cfg->tile, " tiles");
  else
    FP8MOE_ASSERT(q.tiling == Tiling::per_tensor && q.dtype == dt, what, " given in FP8 is not a per-tensor ",
                  dt == Fp8Dtype::e4m3 ? "E4M3" : "E5M2", " tensor");
  FP8MOE_ASSERT(q.rows == rows && q.cols == cols, what, " given in FP8 is (", q.rows, ", ", q.cols, "), not (", rows,
                ", ", cols, ")");
}

// The T x 1 copy of a 1 x T FP8 tensor, through its FP32 values (the transposed tiling needs other
// scales: DeepSeek-V3's re-tiling of cached activations).
void retile_cols(Backend& be, const QuantView& rows, const Fp8Config& c, QTensor* out) {
  Tensor x(be, DType::f32, {rows.rows, rows.cols});
  if (rows.rows * rows.cols > 0) be.dequantize(rows, x.f32());
  quantize_tiled(be, x.f32(), rows.rows, rows.cols, Tiling::cols_Tx1, c, nullptr, out);
}

// A copy of an FP8 tensor, its bytes and scales, that the copy owns.
QTensor copy_quantized(Backend& be, const QuantView& v) {
  QTensor t(be, v.rows, v.cols, v.dtype, v.tiling, v.tile);
  if (t.data.bytes() > 0) be.copy(t.data.raw(), v.data, t.data.bytes());
  if (t.scale_inv.bytes() > 0) be.copy(t.scale_inv.raw(), v.scale_inv, t.scale_inv.bytes());
  return t;
}

// The weight's FP8 copy for this call: the step's cached one, or quantized now (into the cache
// when there is one). Its counts are added when it is quantized, never on reuse.
const QTensor* quantized_weight(Backend& be, const float* W, int64_t N, int64_t K, const LinearFp8& f,
                                uint64_t* counts, QTensor* own) {
  const Fp8Config& c = *f.cfg;
  if (f.weight && f.weight->step == f.step) return &f.weight->q;
  QTensor* out = f.weight ? &f.weight->q : own;
  if (c.recipe == Fp8Recipe::blockwise)
    quantize_tiled(be, W, N, K, Tiling::blocks_TxT, c, counts, out);
  else
    quantize_per_tensor(be, W, N, K, Fp8Dtype::e4m3, f, f.state ? &f.state->w : nullptr, counts, out);
  if (f.weight) f.weight->step = f.step;
  return out;
}

}  // namespace

LinearSaved& LinearSaved::operator=(LinearSaved&& o) noexcept {
  if (this != &o) {
    const bool own = o.wq == &o.own_wq;
    x = o.x, xq = std::move(o.xq), xt = std::move(o.xt), own_wq = std::move(o.own_wq), M = o.M, K = o.K, N = o.N;
    xq_ext = o.xq_ext, has_xq_ext = o.has_xq_ext;
    wq = own ? &own_wq : o.wq;
    o.wq = nullptr, o.x = nullptr;
  }
  return *this;
}

void linear_forward(Backend& be, const float* x, int64_t M, int64_t K, const float* W, int64_t N, const LinearFp8& fp8,
                    float* y, LinearSaved* saved) {
  linear_forward_grouped(be, K, N, {LinearGroup{x, M, W, &fp8, y, saved}});
}

namespace {
// An FP8 group's input quantized into s: its 1 x T (or per-tensor) copy, and blockwise's T x 1
// copy from the same read of x when a backward will read it (so that the FP32 x is not kept).
void quantize_group_input(Backend& be, const LinearGroup& l, int64_t K, LinearSaved& s) {
  const LinearFp8& fp8 = *l.fp8;
  const Fp8Config& c = *fp8.cfg;
  uint64_t* counts = fp8.reuse_last_scale ? nullptr : fp8.counts;  // a recomputation counted already
  if (c.recipe == Fp8Recipe::blockwise && !c.cache_activations && fp8.backward_follows)
    quantize_tiled_pair(be, l.x, l.M, K, c, counts, &s.xq, &s.xt);
  else if (c.recipe == Fp8Recipe::blockwise)
    quantize_tiled(be, l.x, l.M, K, Tiling::rows_1xT, c, counts, &s.xq);
  else
    quantize_per_tensor(be, l.x, l.M, K, Fp8Dtype::e4m3, fp8, fp8.state ? &fp8.state->x : nullptr, counts, &s.xq);
}
}  // namespace

void linear_quantize_input(Backend& be, int64_t K, const LinearGroup& l) {
  FP8MOE_ASSERT(l.saved && l.fp8->enabled() && !l.xq, "linear_quantize_input: an FP8 layer's own input, with saved");
  LinearSaved& s = *l.saved;
  s.M = l.M, s.K = K, s.x = nullptr, s.xt = QTensor{}, s.has_xq_ext = false;
  quantize_group_input(be, l, K, s);
}

void linear_forward_grouped(Backend& be, int64_t K, int64_t N, const std::vector<LinearGroup>& groups) {
  std::vector<LinearSaved> local(groups.size());  // for the groups without a saved (no backward)
  std::vector<LinearSaved*> saved(groups.size());
  for (size_t g = 0; g < groups.size(); ++g) saved[g] = groups[g].saved ? groups[g].saved : &local[g];
  std::vector<QuantView> A, B;
  std::vector<float*> C;
  for (size_t g = 0; g < groups.size(); ++g) {
    const LinearGroup& l = groups[g];
    const LinearFp8& fp8 = *l.fp8;
    LinearSaved& s = *saved[g];
    if (l.x_quantized) {  // linear_quantize_input made the copies
      FP8MOE_ASSERT(l.saved && fp8.enabled() && s.M == l.M && s.K == K, "a pre-quantized linear group's copies");
      s.N = N;
      s.wq = quantized_weight(be, l.W, N, K, fp8, fp8.reuse_last_scale ? nullptr : fp8.counts, &s.own_wq);
      A.push_back(s.xq.view()), B.push_back(s.wq->view()), C.push_back(l.y);
      continue;
    }
    s.M = l.M, s.K = K, s.N = N;
    s.x = l.x;
    s.xt = QTensor{};
    s.has_xq_ext = false;
    if (l.xq) {  // quantized by the caller: read as it is
      check_prequantized(*l.xq, l.M, K, fp8, Fp8Dtype::e4m3, "a linear layer's input");
      const Fp8Config& c = *fp8.cfg;
      const bool blockwise = c.recipe == Fp8Recipe::blockwise;
      s.xq = QTensor{};
      // The weight gradient reads it as it is (per-tensor; blockwise with cache_activations, re-tiled
      // then), or its T x 1 copy made now (blockwise).
      if (fp8.backward_follows && (!blockwise || c.cache_activations)) s.xq_ext = *l.xq, s.has_xq_ext = true;
      if (fp8.backward_follows && blockwise && !c.cache_activations) retile_cols(be, *l.xq, c, &s.xt);
      s.wq = quantized_weight(be, l.W, N, K, fp8, fp8.reuse_last_scale ? nullptr : fp8.counts, &s.own_wq);
      A.push_back(*l.xq), B.push_back(s.wq->view()), C.push_back(l.y);
      continue;
    }
    if (!fp8.enabled()) {
      be.sgemm(false, true, l.M, N, K, 1.0f, l.x, K, l.W, K, 0.0f, l.y, N);
      continue;
    }
    quantize_group_input(be, l, K, s);
    s.wq = quantized_weight(be, l.W, N, K, fp8, fp8.reuse_last_scale ? nullptr : fp8.counts, &s.own_wq);
    A.push_back(s.xq.view()), B.push_back(s.wq->view()), C.push_back(l.y);
  }
  if (!A.empty()) be.grouped_gemm_fp8_forward(A, B, C, N);  // y_g = x_g W_g^T
  for (size_t g = 0; g < groups.size(); ++g) {
    const LinearFp8& fp8 = *groups[g].fp8;
    if (!fp8.enabled()) continue;
    LinearSaved& s = *saved[g];
    // What backward reads: per-tensor wgrad uses this FP8 input as it is; blockwise wgrad the T x 1
    // copy made above, or (cache_activations) this copy re-tiled. The FP32 input is never needed.
    s.x = nullptr;
    if (fp8.cfg->recipe == Fp8Recipe::blockwise && !fp8.cfg->cache_activations) s.xq = QTensor{};
  }
}

void linear_backward(Backend& be, const LinearSaved& s, const float* W, const float* dy, const LinearFp8& fp8, float* dx,
                     float* dW, LaterWork* wgrad_later) {
  linear_backward_grouped(be, {LinearGradGroup{&s, W, dy, &fp8, dx, dW}}, wgrad_later);
}

void linear_backward_grouped(Backend& be, const std::vector<LinearGradGroup>& groups, LaterWork* wgrad_later) {
  // dgrad: every group's gradient quantized, then one grouped call; wgrad after it, likewise.
  // Blockwise: dy's 1 x T (dgrad) and T x 1 (wgrad) copies from one read of it.
  struct Copies {
    std::vector<QTensor> dyq, dyt;
  };
  auto own = std::make_shared<Copies>();
  own->dyq.resize(groups.size()), own->dyt.resize(groups.size());
  std::vector<QTensor>& dyq = own->dyq;
  std::vector<QTensor>& dyt = own->dyt;
  std::vector<QuantView> A, B;
  std::vector<float*> C;
  int64_t ldc = 0;
  for (size_t g = 0; g < groups.size(); ++g) {
    const LinearGradGroup& l = groups[g];
    const LinearSaved& s = *l.saved;
    const LinearFp8& fp8 = *l.fp8;
    const int64_t M = s.M, K = s.K, N = s.N;
    if (!fp8.enabled()) {
      if (l.dx) be.sgemm(false, false, M, K, N, 1.0f, l.dy, N, l.W, K, 0.0f, l.dx, K);
      continue;
    }
    const Fp8Config& c = *fp8.cfg;
    FP8MOE_ASSERT(s.wq, "linear_backward without its forward's FP8 weight");
    if (l.dyq) {  // quantized by the caller (dispatched): dgrad reads it, wgrad it too (per-tensor) or its re-tiled copy
      check_prequantized(*l.dyq, M, N, fp8, grad_dtype(c), "a linear layer's output gradient");
      if (c.recipe == Fp8Recipe::blockwise) retile_cols(be, *l.dyq, c, &dyt[g]);
      if (!l.dx) continue;
      A.push_back(*l.dyq), B.push_back(s.wq->view()), C.push_back(l.dx), ldc = K;
      continue;
    }
    LinearGradQuant mine;
    if (!l.dy_ahead) quantize_output_grad(be, l, &mine);
    if (l.dy_owned) l.dy_owned->reset();  // (read no more: only its FP8 copies)
    LinearGradQuant& dq = l.dy_ahead ? *l.dy_ahead : mine;
    dyq[g] = std::move(dq.q), dyt[g] = std::move(dq.t);  // (freed here as the ones made here)
    if (!l.dx) continue;
    A.push_back(dyq[g].view()), B.push_back(s.wq->view()), C.push_back(l.dx), ldc = K;
  }
  if (!A.empty()) be.grouped_gemm_fp8_dgrad(A, B, C, ldc);  // dx_g = dy_g W_g
  // Blockwise wgrad reads the T x 1 copies: the 1 x T ones are done with.
  for (size_t g = 0; g < groups.size(); ++g)
    if (groups[g].fp8->enabled() && groups[g].fp8->cfg->recipe == Fp8Recipe::blockwise) dyq[g] = QTensor{};
  // wgrad, dW += dy^T x: per-tensor from the same FP8 gradient and the forward's FP8 input;
  // blockwise from both in T x 1 tiles (the reduction runs over tokens), quantized from FP32 (x
  // with cache_activations from its 1 x T FP8 copy, re-tiled, as DeepSeek-V3 does). FP32 layers:
  // dy^T x in FP32. `operands` picks each group's two; with `copy` (a detached LaterWork) every one
  // the step does not own already is copied into `keep`, so that the step reads nothing of the
  // caller's.
  struct Operands {
    std::vector<QuantView> dy, x;              // FP8 layers (empty views for FP32 ones)
    std::vector<const float*> dy32, x32;        // FP32 layers
    std::vector<QTensor> keep;                  // re-tiled or copied FP8 operands
    std::vector<Tensor> keep32;                 // copied FP32 operands
  };
  auto operands = [&be, groups, own](bool copy) {
    auto o = std::make_shared<Operands>();
    const size_t G = groups.size();
    o->dy.resize(G), o->x.resize(G), o->dy32.assign(G, nullptr), o->x32.assign(G, nullptr);
    o->keep.reserve(2 * G), o->keep32.reserve(2 * G);
    auto q_copy = [&](const QuantView& v) {
      if (!copy) return v;
      o->keep.push_back(copy_quantized(be, v));
      return o->keep.back().view();
    };
    auto f_copy = [&](const float* x, int64_t n) {
      if (!copy) return x;
      o->keep32.emplace_back(be, DType::f32, Shape{n});
      if (n > 0) be.copy(o->keep32.back().raw(), x, size_t(n) * sizeof(float));
      return static_cast<const float*>(o->keep32.back().f32());
    };
    for (size_t g = 0; g < G; ++g) {
      const LinearGradGroup& l = groups[g];
      const LinearSaved& s = *l.saved;
      const LinearFp8& fp8 = *l.fp8;
      const int64_t M = s.M, K = s.K, N = s.N;
      if (!fp8.enabled()) {
        o->dy32[g] = f_copy(l.dy, M * N), o->x32[g] = f_copy(s.x, M * K);
        continue;
      }
      if (fp8.cfg->recipe != Fp8Recipe::blockwise) {
        o->dy[g] = l.dyq ? q_copy(*l.dyq) : own->dyq[g].view();  // (own: the step's already)
        o->x[g] = q_copy(s.has_xq_ext ? s.xq_ext : s.xq.view());
        continue;
      }
      const Fp8Config& c = *fp8.cfg;
      o->dy[g] = own->dyt[g].view();
      if (!c.cache_activations) {
        FP8MOE_ASSERT(s.xt.rows == M && s.xt.cols == K, "linear_backward: its forward kept no T x 1 input (LinearFp8::backward_follows was false)");
        o->x[g] = q_copy(s.xt.view());
      } else {
        o->keep.emplace_back();
        retile_cols(be, s.has_xq_ext ? s.xq_ext : s.xq.view(), c, &o->keep.back());
        o->x[g] = o->keep.back().view();
      }
    }
    return o;
  };
  // The GEMMs themselves (the gradient pointers and shapes: the caller's weights, alive all step).
  struct Target {
    float* dW;
    int64_t M, K, N;
    bool fp8;
  };
  std::vector<Target> targets;
  for (const LinearGradGroup& l : groups) targets.push_back({l.dW, l.saved->M, l.saved->K, l.saved->N, l.fp8->enabled()});
  auto gemms = [&be, targets](const Operands& o) {
    std::vector<QuantView> A, B;
    std::vector<float*> C;
    int64_t ldc = 0;
    for (size_t g = 0; g < targets.size(); ++g) {
      const Target& t = targets[g];
      if (!t.fp8) {
        be.sgemm(true, false, t.N, t.K, t.M, 1.0f, o.dy32[g], t.N, o.x32[g], t.K, 1.0f, t.dW, t.K);
        continue;
      }
      A.push_back(o.dy[g]), B.push_back(o.x[g]), C.push_back(t.dW), ldc = t.K;
    }
    if (!A.empty()) be.grouped_gemm_fp8_wgrad(A, B, C, ldc);  // dW_g += dy_g^T x_g
  };
  if (wgrad_later && wgrad_later->detached) {  // copied now: the caller's state may be gone when it runs
    std::shared_ptr<const Operands> o = operands(true);
    wgrad_later->steps.push_back([gemms, o, own] { gemms(*o); });
  } else if (wgrad_later) {
    wgrad_later->steps.push_back([gemms, operands] { gemms(*operands(false)); });
  } else {
    gemms(*operands(false));
  }
}

void quantize_output_grad(Backend& be, const LinearGradGroup& l, LinearGradQuant* out) {
  const LinearFp8& fp8 = *l.fp8;
  FP8MOE_ASSERT(fp8.enabled() && !l.dyq, "quantize_output_grad: an FP8 layer's gradient not quantized already");
  const Fp8Config& c = *fp8.cfg;
  const int64_t M = l.saved->M, N = l.saved->N;
  if (c.recipe != Fp8Recipe::blockwise) {
    quantize_per_tensor(be, l.dy, M, N, grad_dtype(c), fp8, fp8.state ? &fp8.state->dy : nullptr, fp8.counts, &out->q);
  } else if (!l.dx) {
    quantize_tiled(be, l.dy, M, N, Tiling::cols_Tx1, c, nullptr, &out->t);
  } else {
    quantize_tiled_pair(be, l.dy, M, N, c, fp8.counts, &out->q, &out->t);
  }
}

namespace {
Tensor bf16_copy(Backend& be, const float* x, int64_t n) {
  Tensor t(be, DType::bf16, {n});
  if (n > 0) be.to_bf16(x, t.data<uint16_t>(), n);
  return t;
}
}  // namespace

void hp_forward(Backend& be, GemmDtype t, const float* x, int64_t M, int64_t K, const float* W, int64_t N, float* y) {
  if (t == GemmDtype::fp32) return be.sgemm(false, true, M, N, K, 1.0f, x, K, W, K, 0.0f, y, N);
  const Tensor x16 = bf16_copy(be, x, M * K), w16 = bf16_copy(be, W, N * K);
  be.gemm_bf16(false, true, M, N, K, 1.0f, x16.data<uint16_t>(), K, w16.data<uint16_t>(), K, 0.0f, y, N);
}

void hp_backward(Backend& be, GemmDtype t, const float* dy, int64_t M, int64_t N, const float* x, int64_t K,
                 const float* W, float* dx, float beta_dx, float* dW, LaterWork* wgrad_later) {
  FP8MOE_ASSERT(!wgrad_later || wgrad_later->detached, "hp_backward leaves its weight gradient only to a detached step");
  if (t == GemmDtype::fp32) {
    if (!wgrad_later) {
      be.sgemm(true, false, N, K, M, 1.0f, dy, N, x, K, 1.0f, dW, K);
    } else {  // copies of both operands, the GEMM later
      auto dy32 = std::make_shared<Tensor>(be, DType::f32, Shape{M, N});
      auto x32 = std::make_shared<Tensor>(be, DType::f32, Shape{M, K});
      if (M * N > 0) be.copy(dy32->raw(), dy, size_t(M * N) * sizeof(float));
      if (M * K > 0) be.copy(x32->raw(), x, size_t(M * K) * sizeof(float));
      wgrad_later->steps.push_back([&be, dy32, x32, M, N, K, dW] {
        be.sgemm(true, false, N, K, M, 1.0f, dy32->f32(), N, x32->f32(), K, 1.0f, dW, K);
      });
    }
    if (dx) be.sgemm(false, false, M, K, N, 1.0f, dy, N, W, K, beta_dx, dx, K);
    return;
  }
  auto dy16 = std::make_shared<const Tensor>(bf16_copy(be, dy, M * N));
  {
    auto x16 = std::make_shared<const Tensor>(bf16_copy(be, x, M * K));
    auto wgrad = [&be, dy16, x16, M, N, K, dW] {
      be.gemm_bf16(true, false, N, K, M, 1.0f, dy16->data<uint16_t>(), N, x16->data<uint16_t>(), K, 1.0f, dW, K);
    };
    if (wgrad_later)
      wgrad_later->steps.push_back(std::move(wgrad));  // (the BF16 copies with it)
    else
      wgrad();
  }
  if (!dx) return;
  const Tensor w16 = bf16_copy(be, W, N * K);
  be.gemm_bf16(false, false, M, K, N, 1.0f, dy16->data<uint16_t>(), N, w16.data<uint16_t>(), K, beta_dx, dx, K);
}

Fp8Dtype grad_dtype(const Fp8Config& c) { return c.format == Fp8Format::hybrid ? Fp8Dtype::e5m2 : Fp8Dtype::e4m3; }

void quantize_current(Backend& be, const float* x, const Fp8Config& c, const AmaxReduce& reduce, uint64_t* counts,
                      Tensor* scale, QTensor* out) {
  if (scale->empty()) {
    *scale = Tensor(be, DType::f32, {1});
    Tensor a(be, DType::f32, {1});
    be.amax(x, out->rows * out->cols, a.f32());
    if (reduce) reduce(a.f32(), 1);
    be.scale_from_amax(a.f32(), out->dtype, scale_options(c), scale->f32());
  }
  be.quantize_scaled(x, scale->f32(), out->view(), counts);
}

QTensor quantize_1xT(Backend& be, const float* x, int64_t rows, int64_t cols, const Fp8Config& c, uint64_t* counts) {
  QTensor q;
  quantize_tiled(be, x, rows, cols, Tiling::rows_1xT, c, counts, &q);
  return q;
}

void linear_reinput(Backend& be, const LinearSaved& from, const float* x, const LinearFp8& fp8, LinearSaved* out) {
  *out = LinearSaved{};
  out->M = from.M, out->K = from.K, out->N = from.N;
  out->wq = from.wq;  // (the cache's, or `from`'s own: *out must not outlive `from`)
  if (!fp8.enabled()) {
    out->x = x;
    return;
  }
  const Fp8Config& c = *fp8.cfg;
  if (c.recipe == Fp8Recipe::blockwise) {  // the copy the forward kept: 1 x T cached, or wgrad's T x 1
    quantize_tiled(be, x, from.M, from.K, c.cache_activations ? Tiling::rows_1xT : Tiling::cols_Tx1, c, nullptr,
                   c.cache_activations ? &out->xq : &out->xt);
    return;
  }
  // Per-tensor: the forward's scale (delayed: the last one used; current: the same amax again),
  // advancing and counting nothing.
  LinearFp8 f = fp8;
  f.record = false, f.reuse_last_scale = true, f.counts = nullptr;
  quantize_per_tensor(be, x, from.M, from.K, Fp8Dtype::e4m3, f, f.state ? &f.state->x : nullptr, nullptr, &out->xq);
}

void stash_bf16(Backend& be, Tensor* t) {
  if (t->dtype() != DType::f32 || t->empty()) return;
  Tensor h(be, DType::bf16, t->shape());
  be.to_bf16(t->f32(), h.data<uint16_t>(), t->numel());
  *t = std::move(h);
}

const float* unstash(Backend& be, const Tensor& t, Tensor* tmp) {
  if (t.dtype() == DType::f32) return t.f32();
  *tmp = Tensor(be, DType::f32, t.shape());
  be.from_bf16(t.data<uint16_t>(), tmp->f32(), t.numel());
  return tmp->f32();
}

DelayedScaling delayed_to_host(Backend& be, const DelayedState& s) {
  DelayedScaling d;
  if (s.empty()) return d;
  d.history = to_host(be, s.history.data<float>(), s.history.numel());
  const std::vector<float> sc = to_host(be, s.scale.data<float>(), 2);
  d.scale = sc[0], d.last_used = sc[1], d.steps = s.steps;
  return d;
}

DelayedState delayed_from_host(Backend& be, const DelayedScaling& d) {
  DelayedState s;
  if (d.history.empty()) return s;
  s.history = tensor_from(be, d.history, {int64_t(d.history.size())});
  s.scale = tensor_from(be, std::vector<float>{d.scale, d.last_used}, {2});
  s.steps = d.steps;
  return s;
}

}  // namespace fp8moe
