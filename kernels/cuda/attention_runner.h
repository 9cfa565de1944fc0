// The CUDA backend's attention (kernels/cuda/backend.cpp delegates its four attention ops here):
// per shape, cuDNN's fused SDPA (kernels/cuda/attention_cudnn.h) or the reference kernel
// (kernels/cuda/attention.h), decided at the shape's first call and kept, so that forward and
// backward of a shape always run the same kernel (runtime.attention: automatic, cudnn, reference).
//   FP32 forms: through cuDNN, q, k and v rounded to BF16 for the call and the BF16 forms run on
//     them (the same calls in the same order); else the reference kernel on them as they are.
//   BF16 forms (train.activations bf16): q, k and v as kept, cuDNN's operands without a copy; the
//     reference kernel on them widened, with its FP32 softmax and products (not the fused kernel's
//     BF16 roundings inside).
// Scratch (BF16 copies, cuDNN's workspace, the reference backward's delta) is arena memory of the
// backend, released as each call returns (ordered on the compute stream: kernels/cuda/arena.h).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "kernels/backend.h"
#include "kernels/cuda/attention_cudnn.h"  // (declarations only: defined where cuDNN is built in)

namespace fp8moe::cuda {

class AttentionRunner {
 public:
  AttentionRunner(Backend& be, cudaStream_t stream, const BackendOptions& options);
  ~AttentionRunner();
  AttentionRunner(const AttentionRunner&) = delete;
  AttentionRunner& operator=(const AttentionRunner&) = delete;

  // kernels/attention.h's layouts and contracts (Backend::attention_forward ... _bf16).
  void forward(const float* q, const float* k, const float* v, int64_t B, int64_t T, int64_t H, int64_t KVH,
               int64_t hd, int64_t hdv, float* out, float* lse);
  void backward(const float* q, const float* k, const float* v, const float* out, const float* lse,
                const float* dout, int64_t B, int64_t T, int64_t H, int64_t KVH, int64_t hd, int64_t hdv, float* dq,
                float* dk, float* dv);
  void forward_bf16(const uint16_t* q, const uint16_t* k, const uint16_t* v, int64_t B, int64_t T, int64_t H,
                    int64_t KVH, int64_t hd, int64_t hdv, float* out, float* lse);
  void backward_bf16(const uint16_t* q, const uint16_t* k, const uint16_t* v, const float* out, const float* lse,
                     const float* dout, int64_t B, int64_t T, int64_t H, int64_t KVH, int64_t hd, int64_t hdv,
                     float* dq, float* dk, float* dv);
  // "B .. T .. : cudnn; ...", each shape seen so far and its kernel; "" before the first.
  std::string kernels() const;

 private:
  // Whether attention of this shape runs fused (decided at its first call, then kept).
  bool fused(const AttnDims& d);
  Tensor narrowed(const float* x, int64_t n);     // n FP32 values rounded to BF16 on the stream
  Tensor widened(const uint16_t* x, int64_t n);   // n BF16 values widened to FP32 on the stream

  Backend& be_;
  cudaStream_t stream_;
  BackendOptions options_;
#if FP8MOE_HAVE_CUDNN
  std::unique_ptr<CudnnAttention> cudnn_;
  std::string cudnn_error_;                // why cuDNN could not be opened (then it is not tried again)
#endif
  std::map<AttnDims, bool> fused_;         // per shape: cuDNN (true) or the reference kernel
};

}  // namespace fp8moe::cuda
