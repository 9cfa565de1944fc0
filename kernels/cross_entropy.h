// Cross-entropy of logits against targets; targets equal to `ignore` do not count (their
// gradient rows are 0). Per-token losses are summed in row order, in double, so the sum has the
// same bits for any thread count.
//
// One rank holding the whole vocabulary (V):
//   loss_sum = sum over counted rows of logsumexp(row) - row[target]
//   dlogits  = grad_scale * (softmax(row) - onehot(target))          (optional)
// Vocabulary-parallel (tensor parallelism: this rank holds the vocabulary rows [v0, v0 + Vl), the
// full logits are never formed), in three steps with an all-reduce after each of the first two:
//   ce_row_max   mx (N) = the row's max over the local vocabulary          -> all-reduce max
//   ce_partials  se (N) = sum_v exp(logit - mx), tl (N) = the target's logit where local, else 0
//                                                                         -> all-reduce sum of both
//   ce_finish    loss_sum and dlogits from mx, se, tl.
// Targets outside the vocabulary cannot reach these ops: the data reader checks every token id
// against model.vocab_size when it opens a data set (io/token_data.h).
#pragma once

#include <cstdint>

namespace fp8moe::cpu {

// Returns the sum and sets *count to the counted tokens.
double cross_entropy(const float* logits, const int32_t* targets, int64_t N, int64_t V, int32_t ignore,
                     float grad_scale, float* dlogits, int64_t* count);
void ce_row_max(const float* logits, int64_t N, int64_t Vl, float* mx);
void ce_partials(const float* logits, const int32_t* targets, int64_t N, int64_t Vl, int64_t v0, int32_t ignore,
                 const float* mx, double* se, double* tl);
double ce_finish(const float* logits, const int32_t* targets, int64_t N, int64_t Vl, int64_t v0, int32_t ignore,
                 const float* mx, const double* se, const double* tl, float grad_scale, float* dlogits);

}  // namespace fp8moe::cpu
