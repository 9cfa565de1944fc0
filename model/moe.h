// The MoE feed-forward of a block (DeepSeek-V3 style), on one rank:
//   router   z = x Wr^T (FP32), scores s = sigmoid(z) (or p = softmax(z));
//   choose   top-k experts by score + bias (the bias steers the choice only; ties -> lower index);
//   gates    sigmoid: s_i / sum of the chosen s; softmax: p_i (top-k of softmax, not renormalised);
//   dispatch tokens grouped per expert in token order (permute); optional capacity drops the
//            assignments beyond ceil(capacity_factor * N * k / E) per expert, in token order;
//   experts  SwiGLU FFNs (FP8 per recipe); combine: out[n] = sum over its slots of gate * expert
//            output (unpermute), plus the shared experts' FFN of x;
//   aux loss coef * E * sum_e f_e P_e (switch style), f_e the fraction of the N * k assignments
//            that expert e received after capacity drops (no gradient), P_e the mean over tokens
//            of the normalised score of e.
#pragma once

#include <cstdint>
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

// The routing of one forward pass (what the permute/unpermute and the tests see).
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

struct MoeSaved {
  MoeSaved() = default;
  MoeSaved(const MoeSaved&) = delete;  // the experts point into xr
  MoeSaved& operator=(const MoeSaved&) = delete;
  MoeSaved(MoeSaved&&) = default;
  MoeSaved& operator=(MoeSaved&&) = default;
  const float* x = nullptr;   // (N, D) the caller's input (the FP32 router's weight gradient needs it)
  std::vector<float> xr;      // (R, D) permuted inputs of the experts (freed when cached in FP8)
  std::vector<float> z;       // (N, E) router logits
  std::vector<float> prob;    // (N, E) sigmoid or softmax of z
  Routing routing;
  std::vector<float> expert_out;  // (rows, D) in permuted order: expert e's rows at offsets[e]
  DispatchPlan plan;              // expert parallelism: the exchange of this forward
  std::vector<float> xl;          // expert parallelism: the local experts' input rows (freed when cached in FP8)
  std::vector<int64_t> local_rows;  // rows of each local expert (all experts without a dispatcher)
  std::vector<FfnSaved> experts;
  FfnSaved shared;
  double aux_loss = 0;
  int64_t bytes() const {
    int64_t b = int64_t((xr.size() + xl.size() + z.size() + prob.size() + expert_out.size()) * sizeof(float)) + shared.bytes();
    for (const FfnSaved& e : experts) b += e.bytes();
    return b;
  }
};

// Top-k routing of router logits z (N, E) with the selection bias (E). Pure: tested directly.
Routing route(const float* z, const float* bias, int64_t N, int64_t E, const MoeConfig& cfg, std::vector<float>* prob);

// Permute: rows (R, D), R = offsets[E], row i = x[row_token[i]] (grouped by expert, token order).
void permute(const Routing& r, const float* x, int64_t D, float* rows);
// Unpermute: out[row_token[i]] += gate of (token, row_slot[i]) * rows[i], for every row i.
void unpermute_add(const Routing& r, const float* rows, int64_t D, float* out);

// out (N, D) written. Returns the auxiliary loss (0 when aux_loss_coef is 0). With `ep`, the
// routed rows go to their experts' ranks and back (collective over the expert group).
double moe_forward(const float* x, int64_t N, int64_t D, const MoeConfig& cfg, const MoeWeights& w, const MoeFp8& fp8,
                   float* out, MoeSaved* saved, ExpertDispatcher* ep = nullptr);
// dx (N, D) written; weight gradients accumulated. aux_grad_scale multiplies the aux loss's gradient.
// With `tp` (tensor parallelism: expert and shared widths split, w1/w3 column- and w2 row-parallel;
// router replicated), the gates' gradients and the experts' input gradients are summed over it
// here (collective); the caller sums the forward output over it.
void moe_backward(const MoeSaved& s, int64_t D, const MoeConfig& cfg, const MoeWeights& w, const float* dout,
                  float aux_grad_scale, const MoeFp8& fp8, float* dx, const MoeGrads& g, ExpertDispatcher* ep = nullptr,
                  Communicator* tp = nullptr);

// Aux-loss-free balancing after a step: bias_e += rate * sign(mean load - load_e).
void update_router_bias(float* bias, const std::vector<int64_t>& load, double rate);

}  // namespace fp8moe
