// Every one of the 2^32 FP32 bit patterns through fp8moe's encoder and CUDA's cuda_fp8.h host
// conversion, for E4M3 and E5M2, saturating and not: prints the mismatch count per mode.
// About 50 s on two cores (OpenMP); ctest runs it as `fp8_exhaustive`. Exit status 1 on any mismatch.
#include <cuda_fp8.h>
#include <omp.h>

#include <chrono>
#include <cstdio>

#include "kernels/fp8.h"

int main() {
  using fp8moe::Fp8Dtype;
  int failed = 0;
  for (Fp8Dtype f : {Fp8Dtype::e4m3, Fp8Dtype::e5m2})
    for (bool sat : {true, false}) {
      const auto t0 = std::chrono::steady_clock::now();
      const __nv_fp8_interpretation_t interp = f == Fp8Dtype::e4m3 ? __NV_E4M3 : __NV_E5M2;
      const __nv_saturation_t mode = sat ? __NV_SATFINITE : __NV_NOSAT;
      long long mismatches = 0;
      unsigned long long first = ~0ull;
#pragma omp parallel for schedule(static) reduction(+ : mismatches) reduction(min : first)
      for (long long hi = 0; hi < 65536; ++hi)
        for (unsigned lo = 0; lo < 65536; ++lo) {
          const uint32_t u = uint32_t(hi) << 16 | lo;
          const float x = fp8moe::bits_float(u);
          if (fp8moe::fp8_encode(x, f, sat) != __nv_cvt_float_to_fp8(x, mode, interp)) {
            ++mismatches;
            if (u < first) first = u;
          }
        }
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      std::printf("%s %-6s: 4294967296 inputs, %lld mismatches%s (%.1f s, %d threads)\n", fp8moe::to_string(f),
                  sat ? "sat" : "nosat", mismatches, mismatches ? " FAIL" : "", s, omp_get_max_threads());
      if (mismatches) {
        std::printf("  first mismatch: bits 0x%08llx\n", first);
        failed = 1;
      }
      std::fflush(stdout);
    }
  return failed;
}
