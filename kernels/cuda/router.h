// CUDA launcher for kernels/router.h: the MoE router's choice, capacity and permutation, on the
// device. Device memory, queued on `stream`.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/router.h"

namespace fp8moe::cuda {

// The most experts route() takes (a token's scores and keys are kept in shared memory).
inline constexpr int64_t kRouteMaxExperts = 1024;

// int32 entries of the scratch route() needs for N tokens, E experts, k slots.
int64_t route_scratch_count(int64_t N, int64_t E, int64_t k);

// z: (N, E) router logits, bias: (E) (null: zeros) -> every buffer of `out` (kernels/router.h),
// as cpu::route. scratch: route_scratch_count(N, E, k) int32 entries that the caller provides and
// keeps until the launches have run.
void route(const float* z, const float* bias, const RouterRule& rule, const RoutingBuffers& out, int32_t* scratch,
           cudaStream_t stream);

}  // namespace fp8moe::cuda
