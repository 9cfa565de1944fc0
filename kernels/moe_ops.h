// The MoE layer's token movement and its gradients (model/moe.h), over a routing (kernels/router.h)
// whose R = offsets[E] permuted rows the host knows. Serial where rows add into one token, so the
// order is fixed (row order) and the bits do not depend on threads or backend.
//
//   permute        rows (R, D) = x[row_token]
//   unpermute_add  out[row_token[i]] += g_i rows[i] in row order; g_i the row's gate, or 1 when
//                  not `gated` (the scatter-add of the experts' input gradients)
//   gate_grad      per row i of token n and slot j: dye[i] = gate[n, j] dout[n] (the expert's
//                  output gradient) and dgate[n, j] = dout[n] . expert_out[i] (double); dgate is
//                  written for every slot, 0 for dropped ones
//   their BF16 forms (train.activations bf16: the rows as they travel): permute_bf16 writes the
//                  rows rounded to nearest even (bf16_encode); unpermute_add_bf16 and
//                  gate_grad_bf16 read BF16 rows, each value widened exactly where it is used, so
//                  they give the FP32 forms' bits on the widened rows without an FP32 copy of them
//   row_gates      gate_rows[i] = gate[n, j] of row i's token n and slot j (train.moe_gates expert:
//                  the gates travel with the rows to the experts)
//   slot_grads     dgate[n, j] = row_grads[i] for row i of token n and slot j, 0 for dropped slots
//                  (the gates' gradients the experts computed, back in slot order)
//   sum_rows       out[u] = sum of rows[index[t]] for t in [offsets[u], offsets[u + 1]), in that
//                  order, FP32 accumulation; BF16 rows summed in FP32 and rounded once (the relay's
//                  reduction of a token's rows from its node's experts, parallel/expert_dispatch.h)
//   router_grad    d loss / d z (N, E) from dgate through the gates (normalised or not, scaled) and
//                  the scores, plus the auxiliary loss's gradient (aux_coef > 0)
//   aux_loss       coef E sum_e f_e P_e (switch style): f_e = load_e / (N k), P_e the mean over
//                  tokens of e's normalised score (softmax as it is, sigmoid over its row's sum)
//   bias_update    bias_e += rate sign(mean load - load_e) (aux-loss-free balancing)
#pragma once

#include <cstdint>

#include "kernels/hd.h"
#include "kernels/router.h"

namespace fp8moe {

struct RouterGradRule {
  bool sigmoid = true, normalise = true;
  double scaling = 1.0;
  double aux_coef = 0.0;         // 0: no auxiliary loss
  double aux_grad_scale = 1.0;   // multiplies the aux loss's gradient (loss scale x its weight)
};

// The aux-loss-free bias update of one expert: bias += rate * sign(mean load - load).
FP8MOE_HD inline float bias_update_elem(float bias, double mean, int64_t load, double rate) {
  const double diff = mean - double(load);
  return bias + float(rate * double((diff > 0) - (diff < 0)));
}

namespace cpu {
void permute(const float* x, const int64_t* row_token, int64_t R, int64_t D, float* rows);
void unpermute_add(const RoutingBuffers& r, int64_t R, const float* rows, int64_t D, bool gated, float* out);
void gate_grad(const RoutingBuffers& r, int64_t R, const float* dout, const float* expert_out, int64_t D, float* dye,
               double* dgate);
void permute_bf16(const float* x, const int64_t* row_token, int64_t R, int64_t D, uint16_t* rows);
void unpermute_add_bf16(const RoutingBuffers& r, int64_t R, const uint16_t* rows, int64_t D, bool gated, float* out);
void gate_grad_bf16(const RoutingBuffers& r, int64_t R, const float* dout, const uint16_t* expert_out, int64_t D,
                    float* dye, double* dgate);
void row_gates(const RoutingBuffers& r, int64_t R, float* gate_rows);
void slot_grads(const RoutingBuffers& r, int64_t R, const double* row_grads, double* dgate);
void sum_rows(const float* rows, const int64_t* offsets, const int64_t* index, int64_t n, int64_t D, float* out);
void sum_rows_bf16(const uint16_t* rows, const int64_t* offsets, const int64_t* index, int64_t n, int64_t D,
                   uint16_t* out);
void router_grad(const RoutingBuffers& r, const double* dgate, const RouterGradRule& rule, float* dz);
double aux_loss(const RoutingBuffers& r, double coef, bool sigmoid);
void bias_update(float* bias, const int64_t* load, int64_t E, double rate);
}  // namespace cpu

}  // namespace fp8moe
