#include "model/mtp.h"

#include "kernels/check.h"
#include "model/param_table.h"

namespace fp8moe {

std::vector<int64_t> mtp_batch(const int32_t* tokens, const int32_t* targets, int64_t B, int64_t T, int depth,
                               int32_t pad_id, int32_t* tokens_out, int32_t* targets_out) {
  std::vector<int64_t> counted(size_t(depth), 0);
  for (int k = 0; k < depth; ++k)
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = 0; t < T; ++t) {
        const bool inside = t + k + 1 < T;
        const int64_t at = (k * B + b) * T + t;
        tokens_out[at] = inside ? tokens[b * T + t + k + 1] : 0;
        targets_out[at] = inside ? targets[b * T + t + k + 1] : pad_id;
        counted[size_t(k)] += targets_out[at] != pad_id;
      }
  return counted;
}

MtpInputs mtp_inputs(Backend& be, const int32_t* tokens, const int32_t* targets, int64_t B, int64_t T, int depth,
                     int32_t pad_id) {
  const int64_t n = depth * B * T;
  std::vector<int32_t> in(static_cast<size_t>(n)), out(static_cast<size_t>(n));
  MtpInputs r;
  r.batch.mean_over = mtp_batch(tokens, targets, B, T, depth, pad_id, in.data(), out.data());
  r.tokens = tensor_from(be, in, {n}), r.targets = tensor_from(be, out, {n});
  r.batch.tokens = r.tokens.data<int32_t>(), r.batch.targets = r.targets.data<int32_t>();
  return r;
}

Mtp::Mtp(const ModelContext& ctx, std::vector<Block*> blocks, Weight head, Weight embed) : ctx_(ctx), embed_(embed) {
  for (size_t k = 0; k < blocks.size(); ++k) {
    const std::string p = "mtp." + std::to_string(k) + ".";
    modules_.push_back({blocks[k], ctx.fp8.weight(p + "enorm.weight"), ctx.fp8.weight(p + "hnorm.weight"),
                        ctx.fp8.weight(p + "eh_proj"), {ctx.fp8.weight(p + "norm.weight"), head}});
  }
}

void Mtp::module_forward(const Module& mod, const float* emb, const float* h, int64_t B, int64_t T, MtpSaved* s,
                         const Pass& pass, double* aux) {
  Backend& be = ctx_.be;
  const int64_t N = B * T, D = ctx_.model.d_model;
  const float eps = float(ctx_.model.norm_eps);
  // x = eh_proj [enorm(embedding of the token k + 1 ahead) | hnorm(h)] (DeepSeek-V3's order).
  Tensor en(be, DType::f32, {N, D}), hn(be, DType::f32, {N, D});
  s->rstd_e = Tensor(be, DType::f32, {N}), s->rstd_h = Tensor(be, DType::f32, {N});
  be.rmsnorm_forward(emb, mod.enorm.w, N, D, eps, en.f32(), s->rstd_e.f32());
  be.rmsnorm_forward(h, mod.hnorm.w, N, D, eps, hn.f32(), s->rstd_h.f32());
  s->cat = Tensor(be, DType::f32, {N, 2 * D});
  be.copy_2d(s->cat.f32(), 2 * D, en.f32(), D, N, D);
  be.copy_2d(s->cat.f32() + D, 2 * D, hn.f32(), D, N, D);
  s->x = Tensor(be, DType::f32, {N, D});
  hp_forward(be, ctx_.hp_gemm, s->cat.f32(), N, 2 * D, mod.eh_proj.w, D, s->x.f32());
  s->out = Tensor(be, DType::f32, {N, D});
  mod.block->forward(s->x.f32(), B, T, s->out.f32(), &s->block, pass, aux);
}

void Mtp::forward(const float* emb, const float* h, int64_t B, int64_t T, const MtpBatch& batch, float loss_scale,
                  double* mtp_ce, double* aux, std::vector<MtpSaved>* saved,
                  const std::function<void(const Block&, BlockSaved*)>& finished) {
  const int depth = this->depth();
  const int64_t N = B * T, D = ctx_.model.d_model;
  FP8MOE_ASSERT(int64_t(batch.mean_over.size()) == depth && batch.targets, "MtpBatch of ", batch.mean_over.size(),
                " modules for ", depth);
  saved->resize(size_t(depth));
  for (int k = 0; k < depth; ++k) {
    MtpSaved& s = (*saved)[size_t(k)];
    const Module& mod = modules_[size_t(k)];
    module_forward(mod, emb + k * N * D, h, B, T, &s, mod.block->training(), aux ? aux + k : nullptr);
    finished(*mod.block, &s.block);
    // The shared head, and the module's cross-entropy on the targets k + 1 ahead, weighted by
    // mtp_loss_weight / depth over its counted targets.
    const int64_t denom = batch.mean_over[size_t(k)];
    HeadLoss loss;
    loss.targets = batch.targets + k * N;
    loss.grad_scale =
        denom > 0 ? float(double(loss_scale) * ctx_.model.mtp_loss_weight / depth / double(denom)) : 0.0f;
    loss.loss_sum = mtp_ce ? mtp_ce + k : nullptr;
    loss.backward = true;
    head_forward(ctx_, mod.head, s.out.f32(), N, &loss, &s.head);
    h = s.head.hf.f32();
  }
}

void Mtp::backward(std::vector<MtpSaved>* saved, const float* emb, const float* h, int64_t N, float aux_grad_scale,
                   float* demb, float* dh, LaterWork* weights) {
  Backend& be = ctx_.be;
  const int64_t D = ctx_.model.d_model;
  Tensor dnext;  // the gradient of module k's normed output from module k + 1 (its hnorm's input)
  for (int k = depth() - 1; k >= 0; --k) {
    MtpSaved& s = (*saved)[size_t(k)];
    const Module& mod = modules_[size_t(k)];
    Tensor dout(be, DType::f32, {N, D});
    // Module k + 1, which read this module's normed output, is done: head_backward frees it.
    head_backward(ctx_, mod.head, s.out.f32(), N, &s.head, dout.f32(), [&](float* dhf) {
      if (!dnext.empty()) be.add(dhf, dnext.f32(), dhf, N * D);
    }, weights);
    mod.block->recompute_if_dropped(s.x.f32(), &s.block);
    Tensor dxk(be, DType::f32, {N, D}), dcat(be, DType::f32, {N, 2 * D});
    mod.block->backward(s.block, dout.f32(), dxk.f32(), aux_grad_scale, weights);
    s.block = BlockSaved{};
    hp_backward(be, ctx_.hp_gemm, dxk.f32(), N, D, s.cat.f32(), 2 * D, mod.eh_proj.w, dcat.f32(), 0.0f, mod.eh_proj.g,
                weights);
    Tensor den(be, DType::f32, {N, D}), dhn(be, DType::f32, {N, D});
    be.copy_2d(den.f32(), D, dcat.f32(), 2 * D, N, D);
    be.copy_2d(dhn.f32(), D, dcat.f32() + D, 2 * D, N, D);
    be.rmsnorm_backward(emb + k * N * D, mod.enorm.w, s.rstd_e.f32(), den.f32(), N, D, demb + k * N * D, mod.enorm.g);
    const float* hk = k == 0 ? h : (*saved)[size_t(k - 1)].head.hf.f32();
    dnext = Tensor(be, DType::f32, {N, D});
    be.rmsnorm_backward(hk, mod.hnorm.w, s.rstd_h.f32(), dhn.f32(), N, D, dnext.f32(), mod.hnorm.g);
  }
  be.add(dh, dnext.f32(), dh, N * D);  // into the gradient of the main model's normed output
  saved->clear();
}

std::vector<std::vector<float>> Mtp::logits(const int32_t* tokens, int64_t T, const float* h) {
  Backend& be = ctx_.be;
  const int64_t D = ctx_.model.d_model, V = ctx_.model.vocab_size;
  const int depth = this->depth();
  // Module k reads the tokens k + 1 ahead; the last k + 1 positions read token 0 and predict
  // nothing.
  std::vector<int32_t> ahead(static_cast<size_t>(depth * T)), unused(ahead.size());
  mtp_batch(tokens, tokens, 1, T, depth, 0, ahead.data(), unused.data());
  std::vector<MtpSaved> saved(static_cast<size_t>(depth));
  std::vector<std::vector<float>> out;
  for (int k = 0; k < depth; ++k) {
    const Tensor ids = tensor_from(be, std::vector<int32_t>(ahead.begin() + k * T, ahead.begin() + (k + 1) * T), {T});
    Tensor emb(be, DType::f32, {T, D}), logits;
    be.embedding_forward(embed_.w, ids.data<int32_t>(), T, D, 0, V, emb.f32());
    MtpSaved& s = saved[size_t(k)];
    module_forward(modules_[size_t(k)], emb.f32(), h, 1, T, &s, Pass::evaluation(), nullptr);
    head_forward(ctx_, modules_[size_t(k)].head, s.out.f32(), T, nullptr, &s.head, &logits);
    out.push_back(to_host<float>(logits));
    h = s.head.hf.f32();
  }
  return out;
}

}  // namespace fp8moe
