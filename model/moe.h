// The MoE feed-forward of a block (DeepSeek-V3 style), on one rank's backend:
//   router   z = x Wr^T (FP32), scores s = sigmoid(z) (or p = softmax(z));
//   choose   top-k experts by score + bias (the bias steers the choice only; ties -> lower index),
//            node-limited to the best topk_group of n_group expert groups (kernels/router.h);
//   gates    sigmoid: s_i / sum of the chosen s; softmax: p_i (top-k of softmax, not renormalised);
//            norm_topk_prob overrides either; times routed_scaling_factor;
//   dispatch tokens grouped per expert in token order (permute); optional capacity drops the
//            assignments beyond ceil(capacity_factor * N * k / E) per expert, in token order;
//   experts  SwiGLU FFNs (FP8 per recipe); combine: out[n] = sum over its slots of gate * expert
//            output (unpermute), plus the shared experts' FFN of x. train.moe_gates expert: each
//            expert scales its SwiGLU output by the row's gate before W2 instead (the gates sent
//            with the rows), combine is the plain sum, and the backward sends dout's rows to the
//            experts, whose gated SwiGLU backward gives the gates' gradient (sent back, FP64);
//            the same function, with other roundings (FP32 products; W2's FP8 input is g a);
//   aux loss coef * E * sum_e f_e P_e (switch style), f_e the fraction of the N * k assignments
//            that expert e received after capacity drops (no gradient), P_e the mean over tokens
//            of the normalised score of e.
// Everything is backend memory. The one host synchronisation of a layer's forward reads its
// expert loads (E counts): the experts' GEMM shapes and the expert-parallel exchange need them.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "model/ffn.h"
#include "parallel/expert_dispatch.h"

namespace fp8moe {

// Expert parallelism: with a dispatcher, `experts` (weights, gradients, FP8 contexts) lists only
// this rank's local experts (Placement::first_expert, local_experts); without, all E.
struct MoeWeights {
  const float* router;       // (E, D)
  const float* router_bias;  // (E)
  FfnWeights shared;         // width n_shared x d_expert; w1 == nullptr when there are none
  std::vector<FfnWeights> experts;  // (E), or the local experts
  GemmDtype router_gemm = GemmDtype::fp32;  // train.hp_gemm
  GateSite gates = GateSite::combine;       // train.moe_gates
};
struct MoeGrads {
  float* router;  // (E, D), accumulated
  FfnGrads shared;
  std::vector<FfnGrads> experts;
};
struct MoeFp8 {
  FfnFp8 shared;
  std::vector<FfnFp8> experts;
};

// One forward's routing (kernels/router.h's buffers) and what the host read of it.
struct MoeRouting {
  int64_t N = 0, E = 0, k = 0;
  Tensor prob, expert, gate, kept, load, offsets, row_token, row_slot, slot_row;
  std::vector<int64_t> load_host;  // (E) tokens each expert received: the layer's synchronisation
  int64_t rows = 0;                // R = sum of load_host: the permuted rows
  DispatchPlan plan;               // expert parallelism: the exchange of this forward
  // train.activations bf16 with a per-tensor recipe: the one scale of this forward's FP8 rows
  // (their amax over the expert group), kept for a recomputation to quantize them the same way.
  Tensor wire_scale;
  std::vector<int64_t> local_rows; // rows of each local expert (all experts without a dispatcher)
  bool empty() const { return prob.backend() == nullptr; }
  RoutingBuffers buffers() const;
  int64_t dropped() const { return N * k - rows; }
  int64_t bytes() const;
};

struct MoeSaved {
  const float* x = nullptr;  // (N, D) the caller's input (the FP32 router's weight gradient needs it)
  // Kept when the block is recomputed: the recomputation reuses the forward's routing (its loads
  // and exchange plan included), so it needs no synchronisation of its own.
  MoeRouting routing;
  Tensor xr;          // (R, D) permuted inputs of the experts (freed when cached in FP8)
  Tensor xl;          // expert parallelism: the local experts' input rows (freed when cached in FP8)
  Tensor expert_out;  // (R, D) in permuted order: expert e's rows at offsets[e] (FP32 wire; gates at combine)
  // train.activations bf16: the experts' input rows as they arrived in FP8 (1 x T tiles), kept while
  // their layers read them (fp8.cache_activations); and expert_out in BF16, as combine brought it.
  QTensor xq;
  Tensor expert_out16;
  // train.moe_gates expert: the gate of each row the local experts received (plan.received, or R
  // without expert parallelism), which their SwiGLU outputs were scaled by; no expert_out kept.
  Tensor gate_rows;
  std::vector<FfnSaved> experts;
  FfnSaved shared;
  int64_t bytes() const {
    int64_t b = int64_t(xr.bytes() + xl.bytes() + expert_out.bytes() + expert_out16.bytes() + gate_rows.bytes()) +
                routing.bytes() +
                shared.bytes() + (xq.empty() ? 0 : xq.bytes());
    for (const FfnSaved& e : experts) b += e.bytes();
    return b;
  }
};

// The router's rule of a config for N tokens (capacity resolved).
RouterRule router_rule(const MoeConfig& cfg, int64_t N);

// How the routed experts' rows travel (the expert all-to-all's payload) and are kept, by
// train.activations: fp32: every row FP32. bf16 (DeepSeek-V3): the experts' inputs quantized ONCE
// before dispatch, in the blockwise recipe's 1 x T tiles (its scale options: power-of-two scales by
// default), rows and scales sent together, and read as they are by the experts' first GEMM; the
// gradient of the experts' outputs likewise before the down-projection's backward; combine, both
// ways, in BF16. Where the experts' layers are per-tensor FP8 (delayed or current), the rows travel
// in FP8 with ONE scale for the whole exchange: from the amax of every rank's rows (reduced over
// the expert group, so that each expert's GEMM reads one scale and the layouts agree), current
// scaling under either recipe (a delayed history lives with each expert's layer on its own rank,
// which the senders do not hold); the scale itself is not sent. Where the experts' layers are not
// FP8 (recipe off, fp8.layers.experts false), their inputs and output gradients travel in BF16.
// The rounding happens with or without expert parallelism, so that the layouts compute the same.
struct MoeWire {
  bool fp8_in = false;    // the experts' inputs in FP8 (quantize_wire: 1 x T tiles, or one scale)
  bool fp8_grad = false;  // the gradients of their outputs in FP8
  bool bf16 = false;      // BF16 where not FP8, and combine in BF16
};
MoeWire moe_wire(const MoeFp8& fp8, ActivationDtype activations);

// Top-k routing of router logits z (N, E) with the selection bias (E) on the host, for tests and
// tools (the CPU kernel of kernels/router.h; the model runs the backend's).
struct Routing {
  int64_t N = 0, E = 0, k = 0;
  std::vector<int32_t> expert;       // (N, k) chosen experts
  std::vector<float> gate;           // (N, k) their gates (0 where the assignment was dropped)
  std::vector<uint8_t> kept;         // (N, k) 0 where capacity dropped the assignment
  std::vector<int64_t> offsets;      // (E + 1) start of each expert's rows in the permuted order
  std::vector<int64_t> row_token;    // (rows) token of each permuted row
  std::vector<int32_t> row_slot;     // (rows) slot of each permuted row
  std::vector<int64_t> load;         // (E) tokens each expert received
  int64_t dropped = 0;
};
Routing route(const float* z, const float* bias, int64_t N, int64_t E, const MoeConfig& cfg, std::vector<float>* prob);
// Permute: rows (R, D), R = offsets[E], row i = x[row_token[i]] (grouped by expert, token order).
void permute(const Routing& r, const float* x, int64_t D, float* rows);
// Unpermute: out[row_token[i]] += gate of (token, row_slot[i]) * rows[i], for every row i.
void unpermute_add(const Routing& r, const float* rows, int64_t D, float* out);

// out (N, D) written; *aux (device, may be nullptr) the auxiliary loss (0 when aux_loss_coef is 0).
// With `ep`, the routed rows go to their experts' ranks and back (collective over the expert
// group). When saved->routing is filled (a recomputation), it is used instead of routing again.
// load_staging: pinned host memory of at least n_experts counts for the loads' download (nullptr:
// allocated here). rebuild_a: the experts' SwiGLU outputs are made again in backward (ffn_forward).
void moe_forward(Backend& be, const float* x, int64_t N, int64_t D, const MoeConfig& cfg, const MoeWeights& w,
                 const MoeFp8& fp8, float* out, MoeSaved* saved, ExpertDispatcher* ep = nullptr,
                 double* aux = nullptr, HostBuffer<int64_t>* load_staging = nullptr,
                 ActivationDtype activations = ActivationDtype::fp32, bool rebuild_a = false);
// dx (N, D) written; weight gradients accumulated. aux_grad_scale multiplies the aux loss's gradient.
// router_input: makes the forward's input in FP32 (into its argument, where it must be made) where
// the caller no longer keeps it at s.x (kept in BF16, or dropped by recomputation); called for the
// router's weight gradient, the last op, so that it is not held through the experts' backward.
// Empty: s.x.
// With `tp` (tensor parallelism: expert and shared widths split, w1/w3 column- and w2 row-parallel;
// router replicated), the gates' gradients and the experts' input gradients are summed over it
// here (collective); the caller sums the forward output over it. weights (detached; may be
// nullptr): the shared and routed experts' weight gradients left to it (the zero-bubble split)
// where the exchanges run in line; posted (runtime.overlap_expert_comm with expert parallelism),
// they stay here, the compute behind the exchanges. The router's stays here.
void moe_backward(Backend& be, const MoeSaved& s, int64_t D, const MoeConfig& cfg, const MoeWeights& w, const float* dout,
                  float aux_grad_scale, const MoeFp8& fp8, float* dx, const MoeGrads& g, ExpertDispatcher* ep = nullptr,
                  Communicator* tp = nullptr, ActivationDtype activations = ActivationDtype::fp32,
                  const std::function<const float*(Tensor*)>& router_input = {}, LaterWork* weights = nullptr);

// Aux-loss-free balancing after a step on the host: bias_e += rate * sign(mean load - load_e).
void update_router_bias(float* bias, const std::vector<int64_t>& load, double rate);

}  // namespace fp8moe
