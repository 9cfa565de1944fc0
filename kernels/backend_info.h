// What the kernels were built with and what they find at run time (for `fp8moe --version`).
#pragma once

#include <string>

namespace fp8moe {

// Multi-line "name: value" text: BLAS, OpenMP, CUDA runtime, cuBLASLt, visible devices.
std::string kernels_build_info();

// Number of visible CUDA devices; 0 with *why set when there are none or CUDA is not built in.
int cuda_device_count(std::string* why);

// The PCI bus id of CUDA device `ordinal` ("0000:8a:00.0"); empty without CUDA or that device.
std::string cuda_device_pci_id(int ordinal);

}  // namespace fp8moe
