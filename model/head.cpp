#include "model/head.h"

namespace fp8moe {

void head_forward(const ModelContext& ctx, const HeadParams& p, const float* x, int64_t N, const HeadLoss* loss,
                  HeadSaved* s, Tensor* logits) {
  Backend& be = ctx.be;
  const int64_t D = ctx.local.d_model, V = ctx.local.vocab_size;  // V: this rank's vocabulary
  s->hf = Tensor(be, DType::f32, {N, D});
  s->rstd = Tensor(be, DType::f32, {N});
  Tensor own;
  Tensor& out = loss ? own : *logits;
  out = Tensor(be, DType::f32, {N, V});
  be.rmsnorm_forward(x, p.norm.w, N, D, float(ctx.local.norm_eps), s->hf.f32(), s->rstd.f32());
  hp_forward(be, ctx.hp_gemm, s->hf.f32(), N, D, p.head.w, V, out.f32());  // FP32 or BF16 head
  if (!loss) return;
  if (loss->backward) s->dlogits = Tensor(be, DType::f32, {N, V});
  Tensor scratch;
  double* sum = loss->loss_sum;
  if (!sum) scratch = Tensor(be, DType::f64, {1}), sum = scratch.data<double>();
  vocab_parallel_cross_entropy(ctx, out.f32(), loss->targets, N, loss->grad_scale,
                               loss->backward ? s->dlogits.f32() : nullptr, sum);
}

void head_backward(const ModelContext& ctx, const HeadParams& p, const float* x, int64_t N, HeadSaved* s, float* dx,
                   const std::function<void(float* dhf)>& more, LaterWork* weights) {
  Backend& be = ctx.be;
  const int64_t D = ctx.local.d_model, V = ctx.local.vocab_size;
  Tensor dh(be, DType::f32, {N, D});
  hp_backward(be, ctx.hp_gemm, s->dlogits.f32(), N, V, s->hf.f32(), D, p.head.w, dh.f32(), 0.0f, p.head.g, weights);
  ctx.tp_sum(dh.f32(), N * D);  // vocabulary-parallel head: each rank's rows' share
  if (more) more(dh.f32());
  be.rmsnorm_backward(x, p.norm.w, s->rstd.f32(), dh.f32(), N, D, dx, p.norm.g);
  s->dlogits.reset(), s->hf.reset();
}

void vocab_parallel_cross_entropy(const ModelContext& ctx, const float* logits, const int32_t* targets, int64_t N,
                                  float grad_scale, float* dlogits, double* loss_sum) {
  Backend& be = ctx.be;
  const int64_t Vl = ctx.local.vocab_size, v0 = ctx.placement.vocab_first();
  const int32_t pad = ctx.model.pad_id;
  if (!ctx.tp) return be.cross_entropy(logits, targets, N, Vl, pad, grad_scale, dlogits, loss_sum);
  // Row max, sum of exponentials and the target's logit over the whole vocabulary: three
  // all-reduces of N values over the tensor group.
  Tensor mx(be, DType::f32, {N}), se(be, DType::f64, {N}), tl(be, DType::f64, {N});
  be.ce_row_max(logits, N, Vl, mx.f32());
  ctx.tp->allreduce_max(mx.f32(), N);
  be.ce_partials(logits, targets, N, Vl, v0, pad, mx.f32(), se.data<double>(), tl.data<double>());
  ctx.tp->allreduce_sum(se.data<double>(), N);
  ctx.tp->allreduce_sum(tl.data<double>(), N);
  be.ce_finish(logits, targets, N, Vl, v0, pad, mx.f32(), se.data<double>(), tl.data<double>(), grad_scale, dlogits,
               loss_sum);
}

}  // namespace fp8moe
