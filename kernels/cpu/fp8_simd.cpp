// The vectorized FP8 loops of kernels/cpu/fp8_simd.h. Each vector form is the scalar encoder of
// kernels/fp8.h (fp8_encode) written lane-wise: the same integer steps in the same order, so the
// bytes are the same by construction, and bench/fp8_exhaustive shows it for all 2^32 inputs.
#include "kernels/cpu/fp8_simd.h"

#include <algorithm>
#include <cmath>

#if defined(__x86_64__) && defined(__GNUC__)
// NOTE: GCC 12's AVX-512 headers start many intrinsics from _mm512_undefined_*(), which
// -Wmaybe-uninitialized and -Wuninitialized report wherever they are inlined (GCC bug 105593); nothing here is.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>
#define FP8MOE_X86_SIMD 1
#else
#define FP8MOE_X86_SIMD 0
#endif

namespace fp8moe::cpu {

const char* to_string(SimdLevel l) {
  switch (l) {
    case SimdLevel::avx512: return "avx512";
    case SimdLevel::avx2: return "avx2";
    default: return "scalar";
  }
}

SimdLevel cpu_simd_level() {
#if FP8MOE_X86_SIMD
  // NOTE: libgcc's __builtin_cpu_supports also checks that the OS saves the registers (XGETBV).
  static const SimdLevel level = [] {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
      return SimdLevel::avx512;
    if (__builtin_cpu_supports("avx2")) return SimdLevel::avx2;
    return SimdLevel::scalar;
  }();
  return level;
#else
  return SimdLevel::scalar;
#endif
}

namespace {

// Saturated: beyond the value that still rounds to max finite (E4M3: > 464, the tie at 464 rounds
// down to even 448; E5M2: >= 61440, whose tie rounds up to infinity).
template <Fp8Dtype F>
constexpr float kSaturateFrom = F == Fp8Dtype::e4m3 ? 464.0f : 61440.0f;
template <Fp8Dtype F>
bool saturates(float v) {
  return F == Fp8Dtype::e4m3 ? std::abs(v) > kSaturateFrom<F> : std::abs(v) >= kSaturateFrom<F>;
}

template <Fp8Dtype F, bool kSat, bool kPerElement>
void encode_scalar(const float* x, uint8_t* q, int64_t n, const float* scale, bool want_amax, EncodeStats* st) {
  int64_t sat = 0, under = 0;
  uint32_t m = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float v = x[i] * scale[kPerElement ? i : 0];
    const uint8_t b = fp8_encode<F, kSat>(v);
    q[i] = b;
    sat += saturates<F>(v);
    under += (v != 0.0f) & ((b & 0x7F) == 0);
    if (want_amax) m = std::max(m, float_bits(x[i]) & 0x7FFFFFFFu);
  }
  st->saturated += sat;
  st->underflowed += under;
  st->amax_bits = std::max(st->amax_bits, m);
}

uint32_t abs_bits_max_scalar(const float* x, int64_t n) {
  uint32_t m = 0;
  for (int64_t i = 0; i < n; ++i) m = std::max(m, float_bits(x[i]) & 0x7FFFFFFFu);
  return m;
}

void abs_bits_max_into_scalar(uint32_t* m, const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) m[i] = std::max(m[i], float_bits(x[i]) & 0x7FFFFFFFu);
}

// BF16 bits of decode(b), for the 128 magnitudes (the sign is bit 7 -> bit 15).
template <Fp8Dtype F>
struct Bf16Table {
  alignas(64) uint16_t mag[128];
  alignas(64) uint32_t all[256];
  Bf16Table() {
    for (int b = 0; b < 256; ++b) {
      const uint16_t t = uint16_t(float_bits(fp8_decode<F>(uint8_t(b))) >> 16);
      if (b < 128) mag[b] = t;
      all[b] = t;
    }
  }
};
template <Fp8Dtype F>
const Bf16Table<F>& bf16_table() {
  static const Bf16Table<F> t;
  return t;
}

// Zeros, infinities and NaN keep their bits; every other value moves by add / 128 binades.
inline uint16_t shift_bf16(uint16_t t, int16_t add) {
  const uint16_t e = t & 0x7F80u;
  return e == 0 || e == 0x7F80u ? t : uint16_t(t + uint16_t(add));
}

// kPerElement: the exponent step is add[i], else add[0] for the whole span.
template <Fp8Dtype F, bool kPerElement>
void to_bf16_scalar(const uint8_t* src, uint16_t* out, int64_t n, const int16_t* add) {
  const uint32_t* t = bf16_table<F>().all;
  for (int64_t i = 0; i < n; ++i) out[i] = shift_bf16(uint16_t(t[src[i]]), add[kPerElement ? i : 0]);
}

#if FP8MOE_X86_SIMD
#define FP8MOE_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))
#define FP8MOE_AVX2 __attribute__((target("avx2")))

// ---- AVX-512: 16 lanes ----------------------------------------------------------------------

// fp8_encode<F, kSat> of 16 floats, as 32-bit codes: kernels/fp8.h's steps, lane-wise. The
// FP8-subnormal result is computed only for vectors that have a lane in that range (rare after
// scaling: below 2^-15 of the tile's amax for E4M3); zeros take the subnormal path's 0 either way.
template <Fp8Dtype F, bool kSat>
FP8MOE_AVX512 inline __m512i encode16(__m512 v) {
  using T = Fp8Traits<F>;
  using C = Fp8EncodeConsts<F>;
  constexpr int kDrop = C::kDrop, kExpShift = C::kExpShift, kMinNormalBits = C::kMinNormalBits,
                kSubShift = C::kSubShift;
  const __m512i one = _mm512_set1_epi32(1);
  const __m512i u = _mm512_castps_si512(v);
  const __m512i sign = _mm512_and_si512(_mm512_srli_epi32(u, 24), _mm512_set1_epi32(0x80));
  const __m512i a = _mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF));
  // Normal in FP8 (or overflow).
  const __m512i r = _mm512_add_epi32(_mm512_add_epi32(a, _mm512_set1_epi32((1 << (kDrop - 1)) - 1)),
                                     _mm512_and_si512(_mm512_srli_epi32(a, kDrop), one));
  const __m512i shifted = _mm512_srli_epi32(r, kDrop);
  const __m512i normal = _mm512_sub_epi32(shifted, _mm512_set1_epi32(kExpShift << T::kMantBits));
  const __mmask16 is_normal = _mm512_cmpge_epi32_mask(a, _mm512_set1_epi32(kMinNormalBits));
  __m512i code;
  if ((~is_normal & _mm512_test_epi32_mask(a, a)) == 0) {
    code = _mm512_maskz_mov_epi32(is_normal, normal);  // every lane normal or zero
  } else {
    // Subnormal in FP8.
    const __m512i exp = _mm512_srli_epi32(a, 23);
    const __mmask16 has_exp = _mm512_test_epi32_mask(exp, exp);
    const __m512i mant = _mm512_or_si512(_mm512_and_si512(a, _mm512_set1_epi32(0x7FFFFF)),
                                         _mm512_maskz_mov_epi32(has_exp, _mm512_set1_epi32(0x800000)));
    const __m512i e = _mm512_max_epu32(exp, one);
    __m512i shift = _mm512_sub_epi32(_mm512_set1_epi32(kSubShift), e);  // < 0 or > 31: 31
    const __mmask16 negative = _mm512_cmplt_epi32_mask(shift, _mm512_setzero_si512());
    shift = _mm512_mask_mov_epi32(_mm512_min_epi32(shift, _mm512_set1_epi32(31)), negative, _mm512_set1_epi32(31));
    shift = _mm512_max_epi32(shift, one);
    const __m512i q = _mm512_srlv_epi32(mant, shift);
    const __m512i rem = _mm512_and_si512(mant, _mm512_sub_epi32(_mm512_sllv_epi32(one, shift), one));
    const __m512i half = _mm512_sllv_epi32(one, _mm512_sub_epi32(shift, one));
    const __mmask16 up = _mm512_cmpgt_epi32_mask(rem, half) |
                         (_mm512_cmpeq_epi32_mask(rem, half) & _mm512_test_epi32_mask(q, one));
    const __m512i sub = _mm512_mask_add_epi32(q, up, q, one);
    code = _mm512_mask_mov_epi32(sub, is_normal, normal);
  }
  const __mmask16 overflow =
      _mm512_cmpge_epi32_mask(a, _mm512_set1_epi32(0x7F800000)) |
      _mm512_cmpge_epi32_mask(shifted, _mm512_set1_epi32((kExpShift << T::kMantBits) + int(T::kMaxCode) + 1));
  code = _mm512_mask_mov_epi32(code, overflow, _mm512_set1_epi32(int(kSat ? T::kMaxCode : T::kOverflowCode)));
  code = _mm512_or_si512(code, sign);
  return _mm512_mask_mov_epi32(code, _mm512_cmpgt_epi32_mask(a, _mm512_set1_epi32(0x7F800000)),
                               _mm512_set1_epi32(0x7F));
}

// The sum of 16 unsigned 32-bit lanes, in 64 bits.
FP8MOE_AVX512 inline int64_t sum_u32_lanes(__m512i v) {
  return _mm512_reduce_add_epi64(_mm512_add_epi64(_mm512_cvtepu32_epi64(_mm512_castsi512_si256(v)),
                                                  _mm512_cvtepu32_epi64(_mm512_extracti64x4_epi64(v, 1))));
}

// 16 lanes of encode_avx512: the codes stored, the counts kept as lane-wise vector sums (no mask
// moves to scalar registers in the loop), the amax folded in when asked.
template <Fp8Dtype F, bool kSat, bool kPerElement>
FP8MOE_AVX512 inline void encode_step16(const float* x, uint8_t* q, const float* scale, __m512 one_scale,
                                        __mmask16 live, bool want_amax, __m512i* sat, __m512i* under, __m512i* m) {
  const __m512i abs_mask = _mm512_set1_epi32(0x7FFFFFFF), one = _mm512_set1_epi32(1);
  const bool full = live == __mmask16(0xFFFF);
  const __m512 xv = full ? _mm512_loadu_ps(x) : _mm512_maskz_loadu_ps(live, x);
  const __m512 sv = !kPerElement ? one_scale : full ? _mm512_loadu_ps(scale) : _mm512_maskz_loadu_ps(live, scale);
  const __m512 v = _mm512_mul_ps(xv, sv);
  const __m512i code = encode16<F, kSat>(v);
  if (full)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(code));
  else
    _mm512_mask_cvtepi32_storeu_epi8(q, live, code);
  const __m512 av = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v), abs_mask));
  const __m512 limit = _mm512_set1_ps(kSaturateFrom<F>);
  const __mmask16 s = F == Fp8Dtype::e4m3 ? _mm512_cmp_ps_mask(av, limit, _CMP_GT_OQ)
                                          : _mm512_cmp_ps_mask(av, limit, _CMP_GE_OQ);
  const __mmask16 u = _mm512_cmp_ps_mask(v, _mm512_setzero_ps(), _CMP_NEQ_UQ) &
                      _mm512_testn_epi32_mask(code, _mm512_set1_epi32(0x7F));
  *sat = _mm512_mask_add_epi32(*sat, s & live, *sat, one);
  *under = _mm512_mask_add_epi32(*under, u & live, *under, one);
  if (want_amax) *m = _mm512_max_epu32(*m, _mm512_and_si512(_mm512_castps_si512(xv), abs_mask));
}

template <Fp8Dtype F, bool kSat, bool kPerElement>
FP8MOE_AVX512 void encode_avx512(const float* x, uint8_t* q, int64_t n, const float* scale, bool want_amax,
                                 EncodeStats* st) {
  const __m512 one_scale = _mm512_set1_ps(scale[0]);
  __m512i m = _mm512_setzero_si512(), sat = _mm512_setzero_si512(), under = _mm512_setzero_si512();
  // Lane counters hold at most 2^31 - 1 each: spans of up to 2^35 elements.
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    encode_step16<F, kSat, kPerElement>(x + i, q + i, kPerElement ? scale + i : scale, one_scale, __mmask16(0xFFFF),
                                        want_amax, &sat, &under, &m);
  if (i < n)
    encode_step16<F, kSat, kPerElement>(x + i, q + i, kPerElement ? scale + i : scale, one_scale,
                                        __mmask16((1u << (n - i)) - 1u), want_amax, &sat, &under, &m);
  st->saturated += sum_u32_lanes(sat);
  st->underflowed += sum_u32_lanes(under);
  if (want_amax) st->amax_bits = std::max(st->amax_bits, uint32_t(_mm512_reduce_max_epu32(m)));
}

FP8MOE_AVX512 uint32_t abs_bits_max_avx512(const float* x, int64_t n) {
  const __m512i abs_mask = _mm512_set1_epi32(0x7FFFFFFF);
  __m512i m0 = _mm512_setzero_si512(), m1 = _mm512_setzero_si512();
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    m0 = _mm512_max_epu32(m0, _mm512_and_si512(_mm512_loadu_si512(x + i), abs_mask));
    m1 = _mm512_max_epu32(m1, _mm512_and_si512(_mm512_loadu_si512(x + i + 16), abs_mask));
  }
  for (; i < n; i += 16) {
    const __mmask16 live = n - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - i)) - 1u);
    m0 = _mm512_max_epu32(m0, _mm512_and_si512(_mm512_maskz_loadu_epi32(live, x + i), abs_mask));
  }
  return uint32_t(_mm512_reduce_max_epu32(_mm512_max_epu32(m0, m1)));
}

FP8MOE_AVX512 void abs_bits_max_into_avx512(uint32_t* m, const float* x, int64_t n) {
  const __m512i abs_mask = _mm512_set1_epi32(0x7FFFFFFF);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 live = n - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - i)) - 1u);
    const __m512i v = _mm512_and_si512(_mm512_maskz_loadu_epi32(live, x + i), abs_mask);
    _mm512_mask_storeu_epi32(m + i, live, _mm512_max_epu32(_mm512_maskz_loadu_epi32(live, m + i), v));
  }
}

// 32 bytes at a time: the BF16 magnitude from the 128-entry table (two 64-entry permutes and a
// select on bit 6), the sign from bit 7, then the exponent moved unless zero / inf / NaN.
template <Fp8Dtype F, bool kPerElement>
FP8MOE_AVX512 void to_bf16_avx512(const uint8_t* src, uint16_t* out, int64_t n, const int16_t* exp_add) {
  const uint16_t* mag = bf16_table<F>().mag;
  const __m512i t0 = _mm512_load_si512(mag), t1 = _mm512_load_si512(mag + 32);
  const __m512i t2 = _mm512_load_si512(mag + 64), t3 = _mm512_load_si512(mag + 96);
  const __m512i exp_mask = _mm512_set1_epi16(0x7F80), one_add = _mm512_set1_epi16(exp_add[0]);
  for (int64_t i = 0; i < n; i += 32) {
    const __mmask32 live = n - i >= 32 ? __mmask32(0xFFFFFFFFu) : __mmask32((1u << (n - i)) - 1u);
    const __m512i add = kPerElement ? _mm512_maskz_loadu_epi16(live, exp_add + i) : one_add;
    const __m512i b = _mm512_cvtepu8_epi16(_mm256_maskz_loadu_epi8(live, src + i));
    const __m512i lo = _mm512_permutex2var_epi16(t0, b, t1), hi = _mm512_permutex2var_epi16(t2, b, t3);
    __m512i t = _mm512_mask_mov_epi16(lo, _mm512_test_epi16_mask(b, _mm512_set1_epi16(0x40)), hi);
    t = _mm512_or_si512(t, _mm512_slli_epi16(_mm512_and_si512(b, _mm512_set1_epi16(0x80)), 8));
    const __m512i e = _mm512_and_si512(t, exp_mask);
    const __mmask32 keep = _mm512_cmpeq_epi16_mask(e, _mm512_setzero_si512()) | _mm512_cmpeq_epi16_mask(e, exp_mask);
    t = _mm512_mask_add_epi16(t, ~keep, t, add);
    _mm512_mask_storeu_epi16(out + i, live, t);
  }
}

// ---- AVX2: 8 lanes ---------------------------------------------------------------------------

template <Fp8Dtype F, bool kSat>
FP8MOE_AVX2 inline __m256i encode8(__m256 v) {
  using T = Fp8Traits<F>;
  using C = Fp8EncodeConsts<F>;
  constexpr int kDrop = C::kDrop, kExpShift = C::kExpShift, kMinNormalBits = C::kMinNormalBits,
                kSubShift = C::kSubShift;
  const __m256i one = _mm256_set1_epi32(1), zero = _mm256_setzero_si256();
  const __m256i u = _mm256_castps_si256(v);
  const __m256i sign = _mm256_and_si256(_mm256_srli_epi32(u, 24), _mm256_set1_epi32(0x80));
  const __m256i a = _mm256_and_si256(u, _mm256_set1_epi32(0x7FFFFFFF));
  const __m256i r = _mm256_add_epi32(_mm256_add_epi32(a, _mm256_set1_epi32((1 << (kDrop - 1)) - 1)),
                                     _mm256_and_si256(_mm256_srli_epi32(a, kDrop), one));
  const __m256i shifted = _mm256_srli_epi32(r, kDrop);
  const __m256i normal = _mm256_sub_epi32(shifted, _mm256_set1_epi32(kExpShift << T::kMantBits));
  const __m256i is_normal = _mm256_cmpgt_epi32(a, _mm256_set1_epi32(kMinNormalBits - 1));
  const __m256i is_zero = _mm256_cmpeq_epi32(a, zero);
  __m256i code;
  if (_mm256_movemask_epi8(_mm256_or_si256(is_normal, is_zero)) == -1) {
    code = _mm256_and_si256(normal, is_normal);  // every lane normal or zero (as encode16)
  } else {
    const __m256i exp = _mm256_srli_epi32(a, 23);
    const __m256i has_exp = _mm256_xor_si256(_mm256_cmpeq_epi32(exp, zero), _mm256_set1_epi32(-1));
    const __m256i mant = _mm256_or_si256(_mm256_and_si256(a, _mm256_set1_epi32(0x7FFFFF)),
                                         _mm256_and_si256(has_exp, _mm256_set1_epi32(0x800000)));
    const __m256i e = _mm256_max_epu32(exp, one);
    __m256i shift = _mm256_sub_epi32(_mm256_set1_epi32(kSubShift), e);
    const __m256i negative = _mm256_cmpgt_epi32(zero, shift);
    shift = _mm256_blendv_epi8(_mm256_min_epi32(shift, _mm256_set1_epi32(31)), _mm256_set1_epi32(31), negative);
    shift = _mm256_max_epi32(shift, one);
    const __m256i q = _mm256_srlv_epi32(mant, shift);
    const __m256i rem = _mm256_and_si256(mant, _mm256_sub_epi32(_mm256_sllv_epi32(one, shift), one));
    const __m256i half = _mm256_sllv_epi32(one, _mm256_sub_epi32(shift, one));
    const __m256i up = _mm256_or_si256(_mm256_cmpgt_epi32(rem, half),
                                       _mm256_and_si256(_mm256_cmpeq_epi32(rem, half), _mm256_slli_epi32(q, 31)));
    // up lanes are all-ones (gt) or have bit 31 set (tie with odd q): shift down to 0 / 1.
    const __m256i sub = _mm256_add_epi32(q, _mm256_srli_epi32(up, 31));
    code = _mm256_blendv_epi8(sub, normal, is_normal);
  }
  const __m256i overflow = _mm256_or_si256(
      _mm256_cmpgt_epi32(a, _mm256_set1_epi32(0x7F800000 - 1)),
      _mm256_cmpgt_epi32(shifted, _mm256_set1_epi32((kExpShift << T::kMantBits) + int(T::kMaxCode))));
  code = _mm256_blendv_epi8(code, _mm256_set1_epi32(int(kSat ? T::kMaxCode : T::kOverflowCode)), overflow);
  code = _mm256_or_si256(code, sign);
  return _mm256_blendv_epi8(code, _mm256_set1_epi32(0x7F), _mm256_cmpgt_epi32(a, _mm256_set1_epi32(0x7F800000)));
}

template <Fp8Dtype F, bool kSat, bool kPerElement>
FP8MOE_AVX2 void encode_avx2(const float* x, uint8_t* q, int64_t n, const float* scale, bool want_amax,
                             EncodeStats* st) {
  const __m256i abs_mask = _mm256_set1_epi32(0x7FFFFFFF);
  const __m256 limit = _mm256_set1_ps(kSaturateFrom<F>);
  const __m256 one_scale = _mm256_set1_ps(scale[0]);
  // Byte 0 of each 32-bit lane to the low 4 bytes of each 128-bit half, then the halves together.
  const __m256i pick = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,  //
                                        0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
  const __m256i join = _mm256_setr_epi32(0, 4, 1, 1, 1, 1, 1, 1);
  __m256i m = _mm256_setzero_si256();
  int64_t sat = 0, under = 0, i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 xv = _mm256_loadu_ps(x + i);
    const __m256 v = _mm256_mul_ps(xv, kPerElement ? _mm256_loadu_ps(scale + i) : one_scale);
    const __m256i code = encode8<F, kSat>(v);
    const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(code, pick), join);
    _mm_storel_epi64(reinterpret_cast<__m128i*>(q + i), _mm256_castsi256_si128(bytes));
    const __m256 av = _mm256_castsi256_ps(_mm256_and_si256(_mm256_castps_si256(v), abs_mask));
    const int s = _mm256_movemask_ps(F == Fp8Dtype::e4m3 ? _mm256_cmp_ps(av, limit, _CMP_GT_OQ)
                                                         : _mm256_cmp_ps(av, limit, _CMP_GE_OQ));
    const __m256 nonzero = _mm256_cmp_ps(v, _mm256_setzero_ps(), _CMP_NEQ_UQ);
    const __m256i zero_code = _mm256_cmpeq_epi32(_mm256_and_si256(code, _mm256_set1_epi32(0x7F)), _mm256_setzero_si256());
    const int u = _mm256_movemask_ps(_mm256_and_ps(nonzero, _mm256_castsi256_ps(zero_code)));
    sat += __builtin_popcount(unsigned(s));
    under += __builtin_popcount(unsigned(u));
    if (want_amax) m = _mm256_max_epu32(m, _mm256_and_si256(_mm256_castps_si256(xv), abs_mask));
  }
  st->saturated += sat;
  st->underflowed += under;
  if (want_amax) {
    alignas(32) uint32_t lanes[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), m);
    st->amax_bits = std::max(st->amax_bits, *std::max_element(lanes, lanes + 8));
  }
  if (i < n) encode_scalar<F, kSat, kPerElement>(x + i, q + i, n - i, kPerElement ? scale + i : scale, want_amax, st);
}

FP8MOE_AVX2 uint32_t abs_bits_max_avx2(const float* x, int64_t n) {
  const __m256i abs_mask = _mm256_set1_epi32(0x7FFFFFFF);
  __m256i m = _mm256_setzero_si256();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    m = _mm256_max_epu32(m, _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i)), abs_mask));
  alignas(32) uint32_t lanes[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), m);
  return std::max(*std::max_element(lanes, lanes + 8), abs_bits_max_scalar(x + i, n - i));
}

FP8MOE_AVX2 void abs_bits_max_into_avx2(uint32_t* m, const float* x, int64_t n) {
  const __m256i abs_mask = _mm256_set1_epi32(0x7FFFFFFF);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i v = _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i)), abs_mask);
    __m256i* mp = reinterpret_cast<__m256i*>(m + i);
    _mm256_storeu_si256(mp, _mm256_max_epu32(_mm256_loadu_si256(mp), v));
  }
  abs_bits_max_into_scalar(m + i, x + i, n - i);
}

template <Fp8Dtype F, bool kPerElement>
FP8MOE_AVX2 void to_bf16_avx2(const uint8_t* src, uint16_t* out, int64_t n, const int16_t* exp_add) {
  const int* table = reinterpret_cast<const int*>(bf16_table<F>().all);
  const __m256i exp_mask = _mm256_set1_epi32(0x7F80), one_add = _mm256_set1_epi32(exp_add[0]);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    __m256i t[2] = {_mm256_i32gather_epi32(table, _mm256_cvtepu8_epi32(b), 4),
                    _mm256_i32gather_epi32(table, _mm256_cvtepu8_epi32(_mm_srli_si128(b, 8)), 4)};
    for (int h = 0; h < 2; ++h) {
      __m256i& v = t[h];
      const __m256i add =
          kPerElement ? _mm256_cvtepi16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(exp_add + i + 8 * h)))
                      : one_add;
      const __m256i e = _mm256_and_si256(v, exp_mask);
      const __m256i keep = _mm256_or_si256(_mm256_cmpeq_epi32(e, _mm256_setzero_si256()), _mm256_cmpeq_epi32(e, exp_mask));
      v = _mm256_and_si256(_mm256_add_epi32(v, _mm256_andnot_si256(keep, add)), _mm256_set1_epi32(0xFFFF));
    }
    // packus works per 128-bit half: (t0.lo, t1.lo, t0.hi, t1.hi); put the quarters back in order.
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(t[0], t[1]), 0xD8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), packed);
  }
  to_bf16_scalar<F, kPerElement>(src + i, out + i, n - i, kPerElement ? exp_add + i : exp_add);
}

// ---- FP32 <-> BF16 (kernels/fp8.h's bf16_encode / bf16_decode, 16 or 8 lanes) -------------------

// bf16_encode's integer steps as 32-bit lanes, the BF16 bits in the high half: u + 0x7FFF + the
// kept part's lowest bit, or (NaN) u | 0x00400000 (quiet).
FP8MOE_AVX512 inline __m512i bf16_round16(__m512i u) {
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb);
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF)),
                                                 _mm512_set1_epi32(0x7F800000));
  return _mm512_mask_or_epi32(r, nan, u, _mm512_set1_epi32(0x00400000));
}

FP8MOE_AVX512 void f32_to_bf16_avx512(const float* x, uint16_t* y, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512i r = bf16_round16(_mm512_loadu_si512(x + i));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + i), _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16)));
  }
  for (; i < n; ++i) y[i] = bf16_encode(x[i]);
}

FP8MOE_AVX512 void bf16_to_f32_avx512(const uint16_t* x, float* y, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i)));
    _mm512_storeu_si512(y + i, _mm512_slli_epi32(w, 16));
  }
  for (; i < n; ++i) y[i] = bf16_decode(x[i]);
}

FP8MOE_AVX512 void round_bf16_avx512(const float* x, float* y, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512i r = bf16_round16(_mm512_loadu_si512(x + i));
    _mm512_storeu_si512(y + i, _mm512_and_si512(r, _mm512_set1_epi32(int(0xFFFF0000u))));
  }
  for (; i < n; ++i) y[i] = bf16_decode(bf16_encode(x[i]));
}

FP8MOE_AVX2 inline __m256i bf16_round8(__m256i u) {
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb);
  // |u| > 0x7F800000 as signed 32-bit compares: |u| < 2^31.
  const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7FFFFFFF)),
                                         _mm256_set1_epi32(0x7F800000));
  return _mm256_blendv_epi8(r, _mm256_or_si256(u, _mm256_set1_epi32(0x00400000)), nan);
}

FP8MOE_AVX2 void f32_to_bf16_avx2(const float* x, uint16_t* y, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256i a = _mm256_srli_epi32(bf16_round8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i))), 16);
    const __m256i b = _mm256_srli_epi32(bf16_round8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i + 8))), 16);
    // packus works per 128-bit half: put the quarters back in order.
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + i), _mm256_permute4x64_epi64(_mm256_packus_epi32(a, b), 0xD8));
  }
  for (; i < n; ++i) y[i] = bf16_encode(x[i]);
}

FP8MOE_AVX2 void bf16_to_f32_avx2(const uint16_t* x, float* y, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + i)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + i), _mm256_slli_epi32(w, 16));
  }
  for (; i < n; ++i) y[i] = bf16_decode(x[i]);
}

FP8MOE_AVX2 void round_bf16_avx2(const float* x, float* y, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i r = bf16_round8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + i), _mm256_and_si256(r, _mm256_set1_epi32(int(0xFFFF0000u))));
  }
  for (; i < n; ++i) y[i] = bf16_decode(bf16_encode(x[i]));
}
#endif  // FP8MOE_X86_SIMD

using EncodeFn = void (*)(const float*, uint8_t*, int64_t, const float*, bool, EncodeStats*);

template <Fp8Dtype F, bool kSat, bool kPerElement>
EncodeFn pick_encode(SimdLevel level) {
#if FP8MOE_X86_SIMD
  if (level == SimdLevel::avx512) return encode_avx512<F, kSat, kPerElement>;
  if (level == SimdLevel::avx2) return encode_avx2<F, kSat, kPerElement>;
#endif
  (void)level;
  return encode_scalar<F, kSat, kPerElement>;
}

template <Fp8Dtype F>
EncodeFn pick_encode(SimdLevel level, bool saturate, bool per_element) {
  if (saturate) return per_element ? pick_encode<F, true, true>(level) : pick_encode<F, true, false>(level);
  return per_element ? pick_encode<F, false, true>(level) : pick_encode<F, false, false>(level);
}

}  // namespace

void encode_span(SimdLevel level, Fp8Dtype f, bool saturate, const float* x, uint8_t* q, int64_t n,
                 const float* scale, bool per_element, bool want_amax, EncodeStats* stats) {
  if (n <= 0) return;
  const EncodeFn fn = f == Fp8Dtype::e4m3 ? pick_encode<Fp8Dtype::e4m3>(level, saturate, per_element)
                                          : pick_encode<Fp8Dtype::e5m2>(level, saturate, per_element);
  fn(x, q, n, scale, want_amax, stats);
}

uint32_t abs_bits_max(SimdLevel level, const float* x, int64_t n) {
  if (n <= 0) return 0;
#if FP8MOE_X86_SIMD
  if (level == SimdLevel::avx512) return abs_bits_max_avx512(x, n);
  if (level == SimdLevel::avx2) return abs_bits_max_avx2(x, n);
#endif
  (void)level;
  return abs_bits_max_scalar(x, n);
}

void abs_bits_max_into(SimdLevel level, uint32_t* m, const float* x, int64_t n) {
  if (n <= 0) return;
#if FP8MOE_X86_SIMD
  if (level == SimdLevel::avx512) return abs_bits_max_into_avx512(m, x, n);
  if (level == SimdLevel::avx2) return abs_bits_max_into_avx2(m, x, n);
#endif
  (void)level;
  abs_bits_max_into_scalar(m, x, n);
}

namespace {
template <bool kPerElement>
void to_bf16(SimdLevel level, Fp8Dtype f, const uint8_t* src, uint16_t* out, int64_t n, const int16_t* add) {
  if (n <= 0) return;
  const bool e4m3 = f == Fp8Dtype::e4m3;
#if FP8MOE_X86_SIMD
  if (level == SimdLevel::avx512) return e4m3 ? to_bf16_avx512<Fp8Dtype::e4m3, kPerElement>(src, out, n, add)
                                              : to_bf16_avx512<Fp8Dtype::e5m2, kPerElement>(src, out, n, add);
  if (level == SimdLevel::avx2) return e4m3 ? to_bf16_avx2<Fp8Dtype::e4m3, kPerElement>(src, out, n, add)
                                            : to_bf16_avx2<Fp8Dtype::e5m2, kPerElement>(src, out, n, add);
#endif
  (void)level;
  e4m3 ? to_bf16_scalar<Fp8Dtype::e4m3, kPerElement>(src, out, n, add)
       : to_bf16_scalar<Fp8Dtype::e5m2, kPerElement>(src, out, n, add);
}
}  // namespace

void fp8_to_bf16_span(SimdLevel level, Fp8Dtype f, const uint8_t* src, uint16_t* out, int64_t n, int k) {
  const int16_t add = int16_t(k * 128);
  to_bf16<false>(level, f, src, out, n, &add);
}

void fp8_to_bf16_span(SimdLevel level, Fp8Dtype f, const uint8_t* src, uint16_t* out, int64_t n,
                      const int16_t* exp_add) {
  to_bf16<true>(level, f, src, out, n, exp_add);
}

void f32_to_bf16_span(SimdLevel level, const float* x, uint16_t* y, int64_t n) {
  if (n <= 0) return;
#if FP8MOE_X86_SIMD
  if (level == SimdLevel::avx512) return f32_to_bf16_avx512(x, y, n);
  if (level == SimdLevel::avx2) return f32_to_bf16_avx2(x, y, n);
#endif
  (void)level;
  for (int64_t i = 0; i < n; ++i) y[i] = bf16_encode(x[i]);
}

void bf16_to_f32_span(SimdLevel level, const uint16_t* x, float* y, int64_t n) {
  if (n <= 0) return;
#if FP8MOE_X86_SIMD
  if (level == SimdLevel::avx512) return bf16_to_f32_avx512(x, y, n);
  if (level == SimdLevel::avx2) return bf16_to_f32_avx2(x, y, n);
#endif
  (void)level;
  for (int64_t i = 0; i < n; ++i) y[i] = bf16_decode(x[i]);
}

void round_bf16_span(SimdLevel level, const float* x, float* y, int64_t n) {
  if (n <= 0) return;
#if FP8MOE_X86_SIMD
  if (level == SimdLevel::avx512) return round_bf16_avx512(x, y, n);
  if (level == SimdLevel::avx2) return round_bf16_avx2(x, y, n);
#endif
  (void)level;
  for (int64_t i = 0; i < n; ++i) y[i] = bf16_decode(bf16_encode(x[i]));
}

}  // namespace fp8moe::cpu
