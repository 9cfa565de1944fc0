// CUDA launchers for kernels/moe_ops.h: the MoE layer's token movement and its gradients over a
// routing (kernels/router.h) in device memory. Queued on `stream`; sizes may be 0. R: the
// permuted rows in use (offsets[E], which the host knows).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/moe_ops.h"
#include "kernels/router.h"

namespace fp8moe::cuda {

// x: (N, D), row_token: (R) -> rows: (R, D) = x[row_token].
void permute(const float* x, const int64_t* row_token, int64_t R, int64_t D, float* rows, cudaStream_t stream);
// rows: (R, D) -> out: (N, D) += g_i rows[i] (g_i the row's gate, or 1 when not gated), each token's
// rows added in increasing row order (r.slot_row, r.gate; rows >= R are left out).
void unpermute_add(const RoutingBuffers& r, int64_t R, const float* rows, int64_t D, bool gated, float* out,
                   cudaStream_t stream);
// dout: (N, D), expert_out: (R, D) -> dye: (R, D) = gate dout[token], dgate: (N, k) doubles (0 for
// dropped slots).
void gate_grad(const RoutingBuffers& r, int64_t R, const float* dout, const float* expert_out, int64_t D, float* dye,
               double* dgate, cudaStream_t stream);
// Their BF16 forms (kernels/moe_ops.h): rows rounded to BF16 as they are gathered; BF16 rows
// widened where they are read (the FP32 forms' bits on the widened rows).
void permute_bf16(const float* x, const int64_t* row_token, int64_t R, int64_t D, uint16_t* rows,
                  cudaStream_t stream);
void unpermute_add_bf16(const RoutingBuffers& r, int64_t R, const uint16_t* rows, int64_t D, bool gated, float* out,
                        cudaStream_t stream);
void gate_grad_bf16(const RoutingBuffers& r, int64_t R, const float* dout, const uint16_t* expert_out, int64_t D,
                    float* dye, double* dgate, cudaStream_t stream);
// gate_rows: (R) = gate of each row's token and slot (kernels/moe_ops.h).
void row_gates(const RoutingBuffers& r, int64_t R, float* gate_rows, cudaStream_t stream);
// row_grads: (R) -> dgate: (N, k) at each row's token and slot, 0 for dropped slots.
void slot_grads(const RoutingBuffers& r, int64_t R, const double* row_grads, double* dgate, cudaStream_t stream);
// out: (n, D) = the sums of rows' (FP32, or BF16 summed in FP32 and rounded once) index[offsets[u]
// .. offsets[u + 1]) rows, in that order (kernels/moe_ops.h); offsets (n + 1), index on the device.
void sum_rows(const float* rows, const int64_t* offsets, const int64_t* index, int64_t n, int64_t D, float* out,
              cudaStream_t stream);
void sum_rows_bf16(const uint16_t* rows, const int64_t* offsets, const int64_t* index, int64_t n, int64_t D,
                   uint16_t* out, cudaStream_t stream);
// dgate: (N, k) -> dz: (N, E). E <= kMoeMaxExperts.
void router_grad(const RoutingBuffers& r, const double* dgate, const RouterGradRule& rule, float* dz,
                 cudaStream_t stream);
// *out (1 double) = the auxiliary loss (0 when coef <= 0 or N == 0). row_sum: (N), terms: (E)
// doubles of scratch that the caller provides and keeps until the launches have run.
void aux_loss(const RoutingBuffers& r, double coef, bool sigmoid, double* out, double* row_sum, double* terms,
              cudaStream_t stream);
// bias: (E) += rate sign(mean load - load), load: (E); the mean is computed on the device.
void bias_update(float* bias, const int64_t* load, int64_t E, double rate, cudaStream_t stream);

inline constexpr int64_t kMoeMaxExperts = 1024;

}  // namespace fp8moe::cuda
