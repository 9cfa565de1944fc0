// What the kernels were built with and what they find at run time (for `fp8moe --version`).
#pragma once

#include <string>

namespace fp8moe {

// Multi-line "name: value" text: oneDNN (version, threading, the instruction set its GEMMs use),
// OpenMP, CUDA runtime, cuBLASLt, visible devices.
std::string kernels_build_info();

// Number of visible CUDA devices; 0 with *why set when there are none or CUDA is not built in.
int cuda_device_count(std::string* why);

// Whether cuDNN's fused attention is built in (kernels/cuda/attention_cudnn.h; needs CUDA, cudnn.h
// and the cuDNN frontend's headers at configure time).
bool cudnn_attention_built();
// Why this process cannot use it before any GPU is asked ("" when libcudnn.so.9 opens; the reason
// when it does not, or when it is not built in).
std::string cudnn_attention_unavailable();

// The PCI bus id of CUDA device `ordinal` ("0000:8a:00.0"); empty without CUDA or that device.
std::string cuda_device_pci_id(int ordinal);

}  // namespace fp8moe
