// The ops the model calls, on the device chosen by runtime.device (kernels/device.h): the CPU ops
// (kernels/ops.h, kernels/swiglu.h, kernels/gemm_fp8.h) or their CUDA twins (kernels/cuda/).
// Same signatures as the CPU ops: host pointers in and out.
//
// NOTE: this is the CUDA backend's first form. Tensors stay in host memory between ops; each CUDA
// op uploads its inputs to device memory from the arena, runs on the compute stream and downloads
// its outputs, so a step pays PCIe transfers for every op. Quantization and the router stay on
// the CPU here (their CUDA kernels exist and are tested against the CPU, bitwise for quantization).
// Device-resident weights and activations are the next step (README "CUDA backend").
#pragma once

#include <cstdint>

#include "kernels/elem.h"
#include "kernels/gemm_fp8.h"

namespace fp8moe::dev {

// Which of a linear layer's three GEMMs: the CUDA backend uses fast accumulation for fprop only.
enum class GemmRole { fprop, dgrad, wgrad };
void gemm_fp8(GemmRole role, const QuantTensor& A, bool trans_a, const QuantTensor& B, bool trans_b, float alpha,
              float beta, float* C, int64_t ldc);
void sgemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
           const float* B, int64_t ldb, float beta, float* C, int64_t ldc);

void rmsnorm_forward(const float* x, const float* w, int64_t N, int64_t D, float eps, float* y, float* rstd);
void rmsnorm_backward(const float* x, const float* w, const float* rstd, const float* dy, int64_t N, int64_t D,
                      float* dx, float* dw);
void rope(float* x, int64_t B, int64_t T, int64_t heads, int64_t hd, double theta, bool inverse);
void attention_forward(const float* q, const float* k, const float* v, int64_t B, int64_t T, int64_t H, int64_t KVH,
                       int64_t hd, float* out, float* lse);
void attention_backward(const float* q, const float* k, const float* v, const float* out, const float* lse,
                        const float* dout, int64_t B, int64_t T, int64_t H, int64_t KVH, int64_t hd, float* dq,
                        float* dk, float* dv);
double cross_entropy(const float* logits, const int32_t* targets, int64_t N, int64_t V, int32_t ignore,
                     float grad_scale, float* dlogits, int64_t* count);
void embedding_forward(const float* table, const int32_t* ids, int64_t N, int64_t D, float* out);
void embedding_backward(const float* dout, const int32_t* ids, int64_t N, int64_t D, float* dtable);
void swiglu_forward(const float* a, const float* b, float* y, int64_t n);
void swiglu_backward(const float* a, const float* b, const float* dy, float* da, float* db, int64_t n);
// AdamW over n elements (moments FP32 m, v or BF16 m16, v16), kernels/elem.h's adamw_elem.
void adamw(const AdamWStep& h, float* w, float* g, float* m, float* v, uint16_t* m16, uint16_t* v16, int64_t n);

}  // namespace fp8moe::dev
