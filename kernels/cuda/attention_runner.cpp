#include "kernels/cuda/attention_runner.h"

#include <cstdio>

#include "kernels/check.h"
#include "kernels/cuda/attention.h"
#include "kernels/cuda/elementwise.h"

namespace fp8moe::cuda {

AttentionRunner::AttentionRunner(Backend& be, cudaStream_t stream, const BackendOptions& options)
    : be_(be), stream_(stream), options_(options) {}

AttentionRunner::~AttentionRunner() = default;

bool AttentionRunner::fused(const AttnDims& d) {
#if FP8MOE_HAVE_CUDNN
  if (options_.attention == AttentionKernel::reference || d.B * d.T * d.H == 0) return false;
  if (const auto it = fused_.find(d); it != fused_.end()) return it->second;
  std::string why;
  if (!cudnn_ && cudnn_error_.empty()) {
    cudnn_ = CudnnAttention::create(stream_, &why);
    if (!cudnn_) cudnn_error_ = why;
  }
  const bool ok = cudnn_ ? cudnn_->prepare(d, &why) : (why = cudnn_error_, false);
  const std::string shape = to_string(d);
  if (!ok && options_.attention == AttentionKernel::cudnn)
    fatal_error(__FILE__, __LINE__, "runtime.attention cudnn: cuDNN's fused attention cannot run " + shape + ": " + why);
  if (!ok)
    std::fprintf(stderr, "fp8moe: warning: attention of %s runs on the reference kernel: %s\n", shape.c_str(), why.c_str());
  else if (options_.verbose)
    std::printf("attention of %s: %s fused SDPA (BF16 operands, FP32 statistics)\n", shape.c_str(),
                cudnn_->version().c_str());
  fused_.emplace(d, ok);
  return ok;
#else
  (void)d;
  return false;
#endif
}

std::string AttentionRunner::kernels() const {
  std::string s;
#if FP8MOE_HAVE_CUDNN  // (without it no shape is recorded: every one runs the reference kernel)
  for (const auto& [d, on] : fused_)
    s += detail::concat(s.empty() ? "" : "; ", to_string(d), ": ", on ? "cudnn" : "reference");
#endif
  return s;
}

Tensor AttentionRunner::narrowed(const float* x, int64_t n) {
  Tensor t(be_, DType::bf16, {n});
  to_bf16(x, t.data<uint16_t>(), n, stream_);
  return t;
}

Tensor AttentionRunner::widened(const uint16_t* x, int64_t n) {
  Tensor t(be_, DType::f32, {n});
  from_bf16(x, t.f32(), n, stream_);
  return t;
}

void AttentionRunner::forward(const float* q, const float* k, const float* v, int64_t B, int64_t T, int64_t H,
                              int64_t KVH, int64_t hd, int64_t hdv, float* out, float* lse) {
  if (fused({B, T, H, KVH, hd, hdv})) {  // BF16 copies in (kept only for the call): cuDNN's operands
    const Tensor q16 = narrowed(q, B * T * H * hd), k16 = narrowed(k, B * T * KVH * hd),
                 v16 = narrowed(v, B * T * KVH * hdv);
    forward_bf16(q16.data<uint16_t>(), k16.data<uint16_t>(), v16.data<uint16_t>(), B, T, H, KVH, hd, hdv, out, lse);
    return;
  }
  attention_forward(q, k, v, B, T, H, KVH, hd, hdv, out, lse, stream_);
}

void AttentionRunner::backward(const float* q, const float* k, const float* v, const float* out, const float* lse,
                               const float* dout, int64_t B, int64_t T, int64_t H, int64_t KVH, int64_t hd,
                               int64_t hdv, float* dq, float* dk, float* dv) {
  // The forward of this shape ran fused (decided once per shape): so does backward, from the same
  // BF16 operands (out is exactly the BF16 output, widened).
  if (fused({B, T, H, KVH, hd, hdv})) {
    const Tensor q16 = narrowed(q, B * T * H * hd), k16 = narrowed(k, B * T * KVH * hd),
                 v16 = narrowed(v, B * T * KVH * hdv);
    backward_bf16(q16.data<uint16_t>(), k16.data<uint16_t>(), v16.data<uint16_t>(), out, lse, dout, B, T, H, KVH, hd,
                  hdv, dq, dk, dv);
    return;
  }
  Tensor delta(be_, DType::f32, {B * H * T});
  attention_backward(q, k, v, out, lse, dout, B, T, H, KVH, hd, hdv, dq, dk, dv, delta.f32(), stream_);
}

void AttentionRunner::forward_bf16(const uint16_t* q, const uint16_t* k, const uint16_t* v, int64_t B, int64_t T,
                                   int64_t H, int64_t KVH, int64_t hd, int64_t hdv, float* out, float* lse) {
  const int64_t nq = B * T * H * hd, nk = B * T * KVH * hd, nv = B * T * KVH * hdv;
#if FP8MOE_HAVE_CUDNN
  if (const AttnDims d{B, T, H, KVH, hd, hdv}; fused(d)) {
    const int64_t no = B * T * H * hdv;
    Tensor o16(be_, DType::bf16, {no}), ws(be_, DType::u8, {cudnn_->forward_workspace(d)});
    cudnn_->forward(d, q, k, v, o16.raw(), lse, ws.raw());
    from_bf16(o16.data<uint16_t>(), out, no, stream_);
    return;
  }
#endif
  const Tensor q32 = widened(q, nq), k32 = widened(k, nk), v32 = widened(v, nv);
  attention_forward(q32.f32(), k32.f32(), v32.f32(), B, T, H, KVH, hd, hdv, out, lse, stream_);
}

void AttentionRunner::backward_bf16(const uint16_t* q, const uint16_t* k, const uint16_t* v, const float* out,
                                    const float* lse, const float* dout, int64_t B, int64_t T, int64_t H, int64_t KVH,
                                    int64_t hd, int64_t hdv, float* dq, float* dk, float* dv) {
  const int64_t nq = B * T * H * hd, nk = B * T * KVH * hd, nv = B * T * KVH * hdv;
#if FP8MOE_HAVE_CUDNN
  if (const AttnDims d{B, T, H, KVH, hd, hdv}; fused(d)) {
    const int64_t no = B * T * H * hdv;
    Tensor o16(be_, DType::bf16, {no}), do16(be_, DType::bf16, {no});
    to_bf16(out, o16.data<uint16_t>(), no, stream_);
    to_bf16(dout, do16.data<uint16_t>(), no, stream_);
    Tensor dq16(be_, DType::bf16, {nq}), dk16(be_, DType::bf16, {nk}), dv16(be_, DType::bf16, {nv});
    Tensor ws(be_, DType::u8, {cudnn_->backward_workspace(d)});
    cudnn_->backward(d, q, k, v, o16.raw(), do16.raw(), lse, dq16.raw(), dk16.raw(), dv16.raw(), ws.raw());
    from_bf16(dq16.data<uint16_t>(), dq, nq, stream_);
    from_bf16(dk16.data<uint16_t>(), dk, nk, stream_);
    from_bf16(dv16.data<uint16_t>(), dv, nv, stream_);
    return;
  }
#endif
  const Tensor q32 = widened(q, nq), k32 = widened(k, nk), v32 = widened(v, nv);
  Tensor delta(be_, DType::f32, {B * H * T});
  attention_backward(q32.f32(), k32.f32(), v32.f32(), out, lse, dout, B, T, H, KVH, hd, hdv, dq, dk, dv, delta.f32(),
                     stream_);
}

}  // namespace fp8moe::cuda
