// Which device the kernels run on (runtime.device), chosen once per process before any op runs.
// Host-only header: no CUDA types, so model/ and app/ can read it in CPU-only builds.
#pragma once

#include <cstdint>
#include <string>

namespace fp8moe {

enum class ComputeDevice { cpu, cuda };
const char* to_string(ComputeDevice d);

// The process-wide choice (default cpu). set_compute_device(cuda) selects `gpu` (the node-local
// rank modulo the visible devices, see app/) and creates the streams and the cuBLASLt handle; it
// fails with a clear message (returned false, *why set) when CUDA is not built in or no device is
// visible.
bool set_compute_device(ComputeDevice d, int local_rank, std::string* why);
ComputeDevice compute_device();

// The PCI bus id of CUDA device `ordinal` ("0000:8a:00.0"); empty without CUDA or that device.
std::string cuda_device_pci_id(int ordinal);

// Device memory of the caching arena (0 on the CPU backend): bytes handed out now, the most ever
// handed out at once, and what the arena holds from cudaMalloc (handed out + cached).
struct DeviceMemoryStats {
  int64_t in_use = 0, peak = 0, reserved = 0;
  int device = -1;  // the CUDA ordinal this process uses
};
DeviceMemoryStats device_memory_stats();

// The dense peak of this process's GPU in FLOP/s for the GEMMs fp8moe runs there: FP8 tensor cores
// (fp8 true), or FP32 without TF32 (the `off` recipe's cuBLASLt COMPUTE_32F), for the GPUs whose
// datasheet figures we know (H100 / H200 SXM: 1979 / 67 TFLOP/s); NaN otherwise.
double gpu_dense_peak_flops(bool fp8);

}  // namespace fp8moe
