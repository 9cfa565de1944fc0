// Element-wise ops of the step: the residual adds and the sums of partial input gradients.
#pragma once

#include <cstdint>

namespace fp8moe::cpu {

// out = a + b over n elements (out may be a or b).
void add(const float* a, const float* b, float* out, int64_t n);

}  // namespace fp8moe::cpu
