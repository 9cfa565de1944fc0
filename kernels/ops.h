// The transformer's non-GEMM ops on the CPU, forward and backward, FP32 throughout.
// Shapes use N = tokens (B sequences x T positions, row n = b * T + t), D = d_model,
// H / KVH = query / key-value heads, hd = head_dim, V = vocabulary. Backward functions that take
// a parameter gradient ACCUMULATE into it (micro-batches add up); activation gradients are written.
#pragma once

#include <cstdint>

namespace fp8moe::cpu {

// RMSNorm: y = x / sqrt(mean(x^2) + eps) * w.  x, y: (N, D); w: (D); rstd: (N) saved for backward.
void rmsnorm_forward(const float* x, const float* w, int64_t N, int64_t D, float eps, float* y, float* rstd);
// dx: (N, D) written; dw: (D) accumulated.
void rmsnorm_backward(const float* x, const float* w, const float* rstd, const float* dy, int64_t N, int64_t D,
                      float* dx, float* dw);

// Rotary position embedding, in place, on x: (B*T, heads, hd), position t = row % T. The two halves
// of each head are rotated against each other (GPT-NeoX / Llama layout): for i < hd/2,
//   (x_i, x_{i+hd/2}) <- (x_i cos a - x_{i+hd/2} sin a, x_i sin a + x_{i+hd/2} cos a),
//   a = t * theta^(-2i/hd).  `inverse` rotates by -a: the backward of the forward rotation.
void rope(float* x, int64_t B, int64_t T, int64_t heads, int64_t hd, double theta, bool inverse);
// The cosines and sines rope() uses, (T, hd/2) each, computed in double and rounded once (the CUDA
// kernel reads this same table, so both rotate bit-identically).
void rope_table(int64_t T, int64_t hd, double theta, bool inverse, float* cs, float* sn);

// Causal grouped-query attention with softmax in FP32: query head h reads kv head h / (H / KVH).
//   q, out: (B*T, H, hd); k, v: (B*T, KVH, hd); lse: (B, H, T) log-sum-exp of each score row,
//   saved so that backward recomputes the probabilities instead of storing (T, T) per head.
void attention_forward(const float* q, const float* k, const float* v, int64_t B, int64_t T, int64_t H, int64_t KVH,
                       int64_t hd, float* out, float* lse);
// dq: (B*T, H, hd), dk, dv: (B*T, KVH, hd), all written.
void attention_backward(const float* q, const float* k, const float* v, const float* out, const float* lse,
                        const float* dout, int64_t B, int64_t T, int64_t H, int64_t KVH, int64_t hd, float* dq,
                        float* dk, float* dv);

// Cross-entropy of logits (N, V) against targets (N); targets equal to `ignore` do not count.
// Returns the SUM of the per-token losses (numerically stable, in double) and sets *count to the
// tokens counted. With dlogits != nullptr, writes dlogits = grad_scale * (softmax - onehot)
// (rows of ignored tokens are 0).
double cross_entropy(const float* logits, const int32_t* targets, int64_t N, int64_t V, int32_t ignore,
                     float grad_scale, float* dlogits, int64_t* count);

// Embedding: out (N, D) = table[ids]; backward accumulates dout rows into dtable (V, D).
void embedding_forward(const float* table, const int32_t* ids, int64_t N, int64_t D, float* out);
void embedding_backward(const float* dout, const int32_t* ids, int64_t N, int64_t D, float* dtable);

}  // namespace fp8moe::cpu
