#include "kernels/device.h"

#include "kernels/backend_info.h"

#include <cmath>
#include <cstring>

#ifdef FP8MOE_HAVE_CUDA
#include "kernels/cuda/context.h"
#endif

namespace fp8moe {
namespace {
ComputeDevice g_device = ComputeDevice::cpu;
}

const char* to_string(ComputeDevice d) { return d == ComputeDevice::cuda ? "cuda" : "cpu"; }

bool set_compute_device(ComputeDevice d, int local_rank, std::string* why) {
  if (d == ComputeDevice::cpu) {
    g_device = d;
    return true;
  }
  std::string reason;
  const int n = cuda_device_count(&reason);
  if (n == 0) {
    if (why) *why = reason;
    return false;
  }
#ifdef FP8MOE_HAVE_CUDA
  cuda::context(local_rank % n);
  g_device = d;
  return true;
#else
  (void)local_rank;
  return false;
#endif
}

ComputeDevice compute_device() { return g_device; }

std::string cuda_device_pci_id(int ordinal) {
#ifdef FP8MOE_HAVE_CUDA
  char id[32] = {};
  if (cudaDeviceGetPCIBusId(id, sizeof id, ordinal) == cudaSuccess) return id;
  (void)cudaGetLastError();
#endif
  (void)ordinal;
  return "";
}

DeviceMemoryStats device_memory_stats() {
  DeviceMemoryStats s;
#ifdef FP8MOE_HAVE_CUDA
  if (cuda::has_context()) {
    const cuda::ArenaStats a = cuda::arena_stats();
    s.in_use = a.in_use, s.peak = a.peak, s.reserved = a.reserved, s.device = cuda::context().device;
  }
#endif
  return s;
}

double gpu_dense_peak_flops(bool fp8) {
#ifdef FP8MOE_HAVE_CUDA
  if (cuda::has_context()) {
    cudaDeviceProp prop{};
    // H100 / H200 SXM only: the PCIe H100 has 114 SMs, and the NVL parts have 132 SMs like the SXM
    // ones but a lower clock and peak, which this table does not hold.
    if (cudaGetDeviceProperties(&prop, cuda::context().device) == cudaSuccess && prop.major == 9 && prop.minor == 0 &&
        prop.multiProcessorCount >= 132 && std::strstr(prop.name, "NVL") == nullptr)
      return fp8 ? 1979e12 : 66.9e12;
  }
#endif
  (void)fp8;
  return std::nan("");
}

}  // namespace fp8moe
