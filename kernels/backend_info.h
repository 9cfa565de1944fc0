// What the kernels were built with and what they find at run time (for `fp8moe --version`).
#pragma once

#include <string>

namespace fp8moe {

// Multi-line "name: value" text: BLAS, OpenMP, CUDA runtime, cuBLASLt, visible devices.
std::string kernels_build_info();

// Number of visible CUDA devices; 0 with *why set when there are none or CUDA is not built in.
int cuda_device_count(std::string* why);

}  // namespace fp8moe
