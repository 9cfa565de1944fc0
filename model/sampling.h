// Choosing the next token from a model's logits (fp8moe generate).
#pragma once

#include <cstdint>

namespace fp8moe {

// temperature 0: the most likely token (the lowest id among equals). Otherwise the token drawn by
// inverse transform at u in [0, 1) from softmax(logits / temperature) restricted to the top_k most
// likely tokens (top_k 0 or >= V: all), ordered by falling logit (lowest id first among equals):
// token order[j] is chosen for u in [P_j-1, P_j), P_j the cumulative probability of the first j+1.
int32_t sample_token(const float* logits, int64_t V, double temperature, int64_t top_k, double u);

}  // namespace fp8moe
