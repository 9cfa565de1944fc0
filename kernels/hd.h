// FP8MOE_HD marks a function compiled for both the host and the device, so that an elementwise or
// per-row op is written once: the CPU backend runs it in an OpenMP loop, the CUDA backend in a grid.
#pragma once

#if defined(__CUDACC__)
#define FP8MOE_HD __host__ __device__
#else
#define FP8MOE_HD
#endif
