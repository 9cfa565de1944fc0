#include "kernels/backend_info.h"

#include "kernels/gemm_fp8.h"

#include <omp.h>

#include <oneapi/dnnl/dnnl.h>

#include <cstdlib>
#include <string>

#if FP8MOE_HAVE_CUDNN
#include "kernels/cuda/attention_cudnn.h"
#endif
#ifdef FP8MOE_HAVE_CUDA
#include <cublasLt.h>
#include <cuda_runtime_api.h>
#endif

namespace fp8moe {

int cuda_device_count(std::string* why) {
#ifdef FP8MOE_HAVE_CUDA
  int n = 0;
  const cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess) {
    if (why) *why = std::string("cudaGetDeviceCount: ") + cudaGetErrorName(err) + ": " + cudaGetErrorString(err);
    return 0;
  }
  if (n == 0 && why) *why = "cudaGetDeviceCount returned 0 devices";
  return n;
#else
  if (why) *why = "this build has no CUDA backend (FP8MOE_CUDA=OFF or no nvcc at configure time)";
  return 0;
#endif
}

bool cudnn_attention_built() {
#if FP8MOE_HAVE_CUDNN
  return true;
#else
  return false;
#endif
}

std::string cudnn_attention_unavailable() {
#if FP8MOE_HAVE_CUDNN
  return cuda::cudnn_library_error();
#else
  return "cuDNN's fused attention is not built in (no cuDNN frontend at configure time)";
#endif
}

std::string cuda_device_pci_id(int ordinal) {
#ifdef FP8MOE_HAVE_CUDA
  char id[32] = {};
  if (cudaDeviceGetPCIBusId(id, sizeof id, ordinal) == cudaSuccess) return id;
  (void)cudaGetLastError();
#endif
  (void)ordinal;
  return "";
}

namespace {
std::string cudnn_version_text() {
#if FP8MOE_HAVE_CUDNN
  const int64_t v = cuda::cudnn_library_version();  // 91900 = 9.19.0
  return std::to_string(v / 10000) + "." + std::to_string(v / 100 % 100) + "." + std::to_string(v % 100);
#else
  return "";
#endif
}
}  // namespace

std::string kernels_build_info() {
  std::string s;
  const dnnl_version_t* v = dnnl_version();
  s += "  oneDNN:     " + std::to_string(v->major) + "." + std::to_string(v->minor) + "." + std::to_string(v->patch) +
       " (" + (v->cpu_runtime == DNNL_RUNTIME_OMP ? "OpenMP" : "non-OpenMP") +
       " threading), every CPU GEMM (FP32 sgemm, the FP8 GEMM's BF16 matmul); ISA " + cpu_isa_name() +
       (cpu_has_bf16_gemm() ? " (BF16 in hardware)" : " (no BF16 hardware)") + "\n";
  s += "  OpenMP:     " + std::to_string(_OPENMP) + ", max threads " + std::to_string(omp_get_max_threads()) + "\n";
#ifdef FP8MOE_HAVE_CUDA
  int rt = 0;
  cudaRuntimeGetVersion(&rt);
  const size_t lt = cublasLtGetVersion();
  s += "  CUDA:       runtime " + std::to_string(rt / 1000) + "." + std::to_string(rt % 1000 / 10) +
       ", cuBLASLt " + std::to_string(lt) + "\n";
  std::string why;
  const int n = cuda_device_count(&why);
  s += "  GPUs:       " + (n > 0 ? std::to_string(n) + " visible" : "none visible (" + why + ")") + "\n";
  s += std::string("  cuDNN:      ") +
       (!cudnn_attention_built() ? "fused attention not built (no cuDNN frontend at configure time)"
        : cudnn_attention_unavailable().empty()
            ? "fused attention built (cuDNN frontend 1.32.0), library " + cudnn_version_text()
            : "fused attention built (cuDNN frontend 1.32.0), library not found: " + cudnn_attention_unavailable()) +
       "\n";
#else
  s += "  CUDA:       not built (CPU backend only)\n";
#endif
  return s;
}

}  // namespace fp8moe
