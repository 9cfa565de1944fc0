// Token embedding, vocabulary-parallel: this rank holds the table rows [v0, v0 + Vl) (all of them
// without tensor parallelism: v0 = 0, Vl = V).
//   forward   out (N, D) = table[id - v0] where the id is local, else 0 (the tensor-parallel
//             all-reduce then gives every rank the whole embedding)
//   backward  dtable (Vl, D) += dout rows of the local ids, tokens in order (repeated ids add
//             into one row: a fixed order, the same bits on every backend)
#pragma once

#include <cstdint>

namespace fp8moe::cpu {

void embedding_forward(const float* table, const int32_t* ids, int64_t N, int64_t D, int64_t v0, int64_t Vl,
                       float* out);
void embedding_backward(const float* dout, const int32_t* ids, int64_t N, int64_t D, int64_t v0, int64_t Vl,
                        float* dtable);

}  // namespace fp8moe::cpu
