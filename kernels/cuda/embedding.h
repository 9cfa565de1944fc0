// CUDA launchers for kernels/embedding.h (vocabulary-parallel: this rank holds the table rows
// [v0, v0 + Vl)). Device memory, queued on `stream`; N or D may be 0.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace fp8moe::cuda {

// table: (Vl, D), ids: (N) -> out: (N, D), zero rows for ids outside [v0, v0 + Vl).
void embedding_forward(const float* table, const int32_t* ids, int64_t N, int64_t D, int64_t v0, int64_t Vl,
                       float* out, cudaStream_t stream);
// Bytes of scratch embedding_backward needs for N tokens.
size_t embedding_backward_scratch_bytes(int64_t N);
// dout: (N, D), ids: (N) -> dtable: (Vl, D) ACCUMULATED: the local ids' rows, per column in token
// order. scratch: embedding_backward_scratch_bytes(N) bytes of device memory.
void embedding_backward(const float* dout, const int32_t* ids, int64_t N, int64_t D, int64_t v0, int64_t Vl,
                        float* dtable, void* scratch, cudaStream_t stream);

}  // namespace fp8moe::cuda
