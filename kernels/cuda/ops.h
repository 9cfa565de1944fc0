// CUDA twins of the CPU ops (kernels/ops.h, model/moe.cpp's routing, model/optimizer.cpp's AdamW),
// same shapes and conventions. All pointers are device pointers; every launch is on `stream`.
// Sizes may be 0. Element math shared with the CPU comes from kernels/elem.h and kernels/swiglu.h.
//
// What is bit-identical to the CPU and what is not (tests/kernels/test_cuda_ops.cpp checks both):
//   bitwise   rope, embedding forward/backward, permute, unpermute_add, AdamW, the bias update,
//             the RMSNorm weight gradient (same operation order, IEEE round-to-nearest intrinsics)
//   close     RMSNorm (double row sums in another order), attention (online softmax in FP32, the
//             CPU softmax in double), cross-entropy and the router's scores (device exp/expf differ
//             from glibc's by an ulp or two), the gradient norm's sum of squares (tree order)
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/elem.h"

namespace fp8moe::cuda {

void rmsnorm_forward(const float* x, const float* w, int64_t N, int64_t D, float eps, float* y, float* rstd,
                     cudaStream_t stream);
// dx written, dw accumulated.
void rmsnorm_backward(const float* x, const float* w, const float* rstd, const float* dy, int64_t N, int64_t D,
                      float* dx, float* dw, cudaStream_t stream);

// In place on x (B*T, heads, hd); cs, sn: (T, hd/2) from cpu::rope_table.
void rope(float* x, int64_t B, int64_t T, int64_t heads, int64_t hd, const float* cs, const float* sn,
          cudaStream_t stream);

// Causal GQA, as cpu::attention_forward / attention_backward (hd <= 256, even).
void attention_forward(const float* q, const float* k, const float* v, int64_t B, int64_t T, int64_t H, int64_t KVH,
                       int64_t hd, float* out, float* lse, cudaStream_t stream);
void attention_backward(const float* q, const float* k, const float* v, const float* out, const float* lse,
                        const float* dout, int64_t B, int64_t T, int64_t H, int64_t KVH, int64_t hd, float* dq,
                        float* dk, float* dv, cudaStream_t stream);

// Per-row losses (N, double; 0 for ignored rows) and counted flags (N, 1 = counted); the caller sums
// them in row order (as the CPU does). dlogits optional. Targets outside [0, V) set *bad (device int) to 1.
void cross_entropy(const float* logits, const int32_t* targets, int64_t N, int64_t V, int32_t ignore,
                   float grad_scale, float* dlogits, double* row_loss, int32_t* counted, int32_t* bad,
                   cudaStream_t stream);

void embedding_forward(const float* table, const int32_t* ids, int64_t N, int64_t D, float* out, cudaStream_t stream);
// dtable accumulated, tokens in order per column (deterministic, bitwise as the CPU).
void embedding_backward(const float* dout, const int32_t* ids, int64_t N, int64_t D, float* dtable,
                        cudaStream_t stream);

// The router of model/moe.cpp: scores (sigmoid or softmax) -> prob (N, E); top-k of prob + bias
// (ties to the lower index) -> expert, gate (N, k); capacity (cap assignments per expert in token
// order; cap >= N k means none) -> kept (N, k), load (E), offsets (E + 1); permutation (rows grouped
// by expert, token order inside) -> row_token, row_slot (N k allocated; offsets[E] used) and
// slot_row (N, k; -1 where dropped). E <= 1024.
void route(const float* z, const float* bias, int64_t N, int64_t E, int64_t k, bool sigmoid, int64_t cap, float* prob,
           int32_t* expert, float* gate, uint8_t* kept, int64_t* load, int64_t* offsets, int64_t* row_token,
           int32_t* row_slot, int32_t* slot_row, cudaStream_t stream);
// rows (R, D) = x[row_token]
void permute(const float* x, const int64_t* row_token, int64_t R, int64_t D, float* rows, cudaStream_t stream);
// out[n] += gate[n, j] * rows[slot_row[n, j]] over the token's kept slots in increasing row order.
void unpermute_add(const float* rows, const int32_t* slot_row, const float* gate, int64_t N, int64_t k, int64_t D,
                   float* out, cudaStream_t stream);

// AdamW over n elements (kernels/elem.h): moments FP32 (m, v) or BF16 (m16, v16; the others null).
void adamw(const AdamWStep& h, float* w, float* g, float* m, float* v, uint16_t* m16, uint16_t* v16, int64_t n,
           cudaStream_t stream);
// bias[e] = bias_update_elem(bias[e], mean load, load[e], rate), E experts.
void update_router_bias(float* bias, const int64_t* load, int64_t E, double rate, cudaStream_t stream);
// *out = sum of g^2 in double (n elements).
void sum_squares(const float* g, int64_t n, double* out, cudaStream_t stream);

}  // namespace fp8moe::cuda
