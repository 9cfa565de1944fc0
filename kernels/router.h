// The MoE router's choice (model/moe.h describes the layer): from the router's logits z (N, E),
//   scores   p = sigmoid(z), or softmax(z) over the experts;
//   keys     p + bias (the bias steers the choice only, never the gates);
//   groups   node-limited routing (DeepSeek-V3): the E experts form n_group groups of E / n_group
//            consecutive ones; a token keeps the topk_group groups whose two best keys sum highest
//            (ties to the lower group) and the others' keys become -inf;
//   top-k    the k largest keys, ties to the lower expert index;
//   gates    p of the chosen experts, divided by their sum when `normalise`, times `scaling`;
//   capacity the first `capacity` assignments of each expert in token order are kept, the rest
//            dropped (gate 0);
//   rows     the kept assignments grouped by expert, token order inside a group (the permutation
//            the experts' GEMMs read).
// CPU here; CUDA in kernels/cuda/router.cu; the backend op in kernels/backend.h.
#pragma once

#include <cstdint>

namespace fp8moe {

struct RouterRule {
  int64_t top_k = 1;
  bool sigmoid = true;  // false: softmax
  int64_t n_group = 1, topk_group = 1;
  bool normalise = true;   // gates divided by the sum of the chosen scores
  double scaling = 1.0;    // routed_scaling_factor, on the gates
  int64_t capacity = 0;    // assignments each expert keeps, in token order (N k or more: no limit)
};

// One routing of N tokens over E experts with k slots each, in a backend's memory.
struct RoutingBuffers {
  int64_t N = 0, E = 0, k = 0;
  float* prob = nullptr;         // (N, E) the scores
  int32_t* expert = nullptr;     // (N, k) chosen experts, best first
  float* gate = nullptr;         // (N, k) their gates (0 where dropped)
  uint8_t* kept = nullptr;       // (N, k) 0 where capacity dropped the assignment
  int64_t* load = nullptr;       // (E) assignments each expert kept
  int64_t* offsets = nullptr;    // (E + 1) start of each expert's rows in the permuted order
  int64_t* row_token = nullptr;  // (N k) token of each permuted row; rows [0, offsets[E]) used
  int32_t* row_slot = nullptr;   // (N k) slot (0..k-1) of each permuted row
  int32_t* slot_row = nullptr;   // (N, k) permuted row of each slot, -1 where dropped
};

namespace cpu {
// Writes every buffer of `out` from z (N, E) and bias (E).
void route(const float* z, const float* bias, const RouterRule& rule, const RoutingBuffers& out);
}  // namespace cpu

}  // namespace fp8moe
