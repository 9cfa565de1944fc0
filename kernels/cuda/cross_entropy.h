// CUDA launchers for kernels/cross_entropy.h. Device memory, queued on `stream`; N may be 0 (the
// loss sums are then 0). Scalar results stay in device memory.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace fp8moe::cuda {

// One rank holding the vocabulary. logits: (N, V), targets: (N) -> dlogits: (N, V) (may be null),
// *loss_sum (1 double) = the row-order sum of the counted rows' losses. row_loss: (N) doubles of
// scratch that the caller provides and keeps until the launches have run.
void cross_entropy(const float* logits, const int32_t* targets, int64_t N, int64_t V, int32_t ignore,
                   float grad_scale, float* dlogits, double* loss_sum, double* row_loss, cudaStream_t stream);

// Vocabulary-parallel, this rank holding the vocabulary rows [v0, v0 + Vl). logits: (N, Vl).
// mx: (N) = the row's max over the local vocabulary.
void ce_row_max(const float* logits, int64_t N, int64_t Vl, float* mx, cudaStream_t stream);
// mx: (N) (all-reduced max) -> se: (N) = sum exp(logit - mx), tl: (N) = the target's logit where
// local, else 0.
void ce_partials(const float* logits, const int32_t* targets, int64_t N, int64_t Vl, int64_t v0, int32_t ignore,
                 const float* mx, double* se, double* tl, cudaStream_t stream);
// mx, se, tl: (N) (all-reduced) -> dlogits: (N, Vl) (may be null), *loss_sum as cross_entropy's;
// row_loss: (N) doubles of scratch as there.
void ce_finish(const float* logits, const int32_t* targets, int64_t N, int64_t Vl, int64_t v0, int32_t ignore,
               const float* mx, const double* se, const double* tl, float grad_scale, float* dlogits,
               double* loss_sum, double* row_loss, cudaStream_t stream);

}  // namespace fp8moe::cuda
