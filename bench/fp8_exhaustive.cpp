// Every one of the 2^32 FP32 bit patterns through fp8moe's encoders and CUDA's cuda_fp8.h host
// conversion, for E4M3 and E5M2, saturating and not: the element encoder of kernels/fp8.h and the
// vectorized spans of kernels/cpu/fp8_simd.h at every level this CPU has (scalar, AVX2, AVX-512),
// each against CUDA. The spans' saturation and underflow counts and amax are checked too, against
// their definitions on CUDA's bytes. Prints the mismatch count per mode and form; exit status 1 on
// any mismatch. About 70 s on two cores (OpenMP); ctest runs it as `fp8_exhaustive`.
#include <cuda_fp8.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <vector>

#include "kernels/cpu/fp8_simd.h"
#include "kernels/fp8.h"

namespace {
using fp8moe::Fp8Dtype;
using fp8moe::cpu::SimdLevel;

constexpr int kForms = 4;  // the element encoder, then the span at each SimdLevel
const char* form_name(int f) {
  return f == 0 ? "element" : f == 1 ? "span/scalar" : f == 2 ? "span/avx2" : "span/avx512";
}
}  // namespace

int main() {
  const SimdLevel have = fp8moe::cpu::cpu_simd_level();
  const int forms = 2 + int(have);  // element, span/scalar, and the vector levels this CPU has
  int failed = 0;
  for (Fp8Dtype f : {Fp8Dtype::e4m3, Fp8Dtype::e5m2})
    for (bool sat : {true, false}) {
      const auto t0 = std::chrono::steady_clock::now();
      const __nv_fp8_interpretation_t interp = f == Fp8Dtype::e4m3 ? __NV_E4M3 : __NV_E5M2;
      const __nv_saturation_t mode = sat ? __NV_SATFINITE : __NV_NOSAT;
      const float limit = f == Fp8Dtype::e4m3 ? 464.0f : 61440.0f;
      long long mismatches[kForms] = {}, count_errors[kForms] = {};
      unsigned long long first[kForms] = {~0ull, ~0ull, ~0ull, ~0ull};
#pragma omp parallel
      {
        std::vector<float> x(65536), ones(65536, 1.0f);
        std::vector<uint8_t> want(65536), got(65536);
        long long mis[kForms] = {}, cnt[kForms] = {};
        unsigned long long fst[kForms] = {~0ull, ~0ull, ~0ull, ~0ull};
#pragma omp for schedule(static)
        for (long long hi = 0; hi < 65536; ++hi) {
          int64_t want_sat = 0, want_under = 0;
          uint32_t want_amax = 0;
          for (unsigned lo = 0; lo < 65536; ++lo) {
            const uint32_t u = uint32_t(hi) << 16 | lo;
            x[lo] = fp8moe::bits_float(u);
            want[lo] = __nv_cvt_float_to_fp8(x[lo], mode, interp);
            want_sat += f == Fp8Dtype::e4m3 ? std::fabs(x[lo]) > limit : std::fabs(x[lo]) >= limit;
            want_under += x[lo] != 0.0f && (want[lo] & 0x7F) == 0;
            want_amax = std::max(want_amax, u & 0x7FFFFFFFu);
            if (fp8moe::fp8_encode(x[lo], f, sat) != want[lo]) {
              ++mis[0];
              fst[0] = std::min<unsigned long long>(fst[0], u);
            }
          }
          for (int form = 1; form < forms; ++form) {
            // Odd rows take the per-element scale path (all ones), even ones the single scale.
            fp8moe::cpu::EncodeStats st;
            fp8moe::cpu::encode_span(SimdLevel(form - 1), f, sat, x.data(), got.data(), 65536, ones.data(), hi & 1,
                                     true, &st);
            for (unsigned lo = 0; lo < 65536; ++lo)
              if (got[lo] != want[lo]) {
                ++mis[form];
                fst[form] = std::min<unsigned long long>(fst[form], uint32_t(hi) << 16 | lo);
              }
            cnt[form] += st.saturated != want_sat || st.underflowed != want_under || st.amax_bits != want_amax;
          }
        }
#pragma omp critical
        for (int form = 0; form < kForms; ++form) {
          mismatches[form] += mis[form];
          count_errors[form] += cnt[form];
          first[form] = std::min(first[form], fst[form]);
        }
      }
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      for (int form = 0; form < forms; ++form) {
        const bool bad = mismatches[form] || count_errors[form];
        std::printf("%s %-6s %-12s: 4294967296 inputs, %lld mismatches", fp8moe::to_string(f), sat ? "sat" : "nosat",
                    form_name(form), mismatches[form]);
        if (form) std::printf(", %lld blocks of 65536 with wrong counts or amax", count_errors[form]);
        std::printf("%s\n", bad ? " FAIL" : "");
        if (mismatches[form]) std::printf("  first mismatch: bits 0x%08llx\n", first[form]);
        failed |= bad;
      }
      std::printf("  (%.1f s, %d threads)\n", s, omp_get_max_threads());
      std::fflush(stdout);
    }
  if (have != SimdLevel::avx512)
    std::printf("not checked here: the %s span (this CPU runs %s)\n", have == SimdLevel::avx2 ? "AVX-512" : "AVX2 and AVX-512",
                fp8moe::cpu::to_string(have));
  return failed;
}
