// FP8 formats (OCP OFP8): E4M3 (the `fn` variant) and E5M2. Encode from FP32 (and BF16) with
// round-to-nearest-even, saturating or not; decode to FP32 exactly.
//
//            bias  max finite          min normal  min subnormal  inf         NaN
//   E4M3      7    448   (S.1111.110)  2^-6        2^-9           none        S.1111.111
//   E5M2     15    57344 (S.11110.11)  2^-14       2^-16          S.11111.00  S.11111.{01,10,11}
//
// Bit-exact with CUDA's cuda_fp8.h (__nv_cvt_float_to_fp8), which is the test oracle:
//  - NaN input encodes to 0x7F in both formats, whatever its sign (CUDA canonicalises NaN to a
//    positive quiet NaN before converting; so do we).
//  - Saturating mode: overflow and +-inf become +-max finite (E4M3 0x7E/0xFE, E5M2 0x7B/0xFB).
//  - Non-saturating mode: overflow gives E4M3 NaN (0x7F/0xFF) and E5M2 +-inf (0x7C/0xFC).
//  - Ties round to even, also at the top: 464 (between 448 and the NaN slot 480) -> 448.
//
// The functions are FP8MOE_HD: the CPU quantize loops and the CUDA kernels run this same code.
#pragma once

#include <cstdint>
#include <cstring>

#include "kernels/hd.h"

namespace fp8moe {

enum class Fp8Dtype : uint8_t { e4m3, e5m2 };

// Per-format constants.
template <Fp8Dtype F>
struct Fp8Traits;
template <>
struct Fp8Traits<Fp8Dtype::e4m3> {
  static constexpr int kMantBits = 3;
  static constexpr int kBias = 7;
  static constexpr uint32_t kMaxCode = 0x7E;       // 448
  static constexpr uint32_t kOverflowCode = 0x7F;  // NaN: E4M3 has no infinity
  static constexpr float kMax = 448.0f;
  static constexpr float kMinNormal = 0.015625f;   // 2^-6
  static constexpr float kMinSubnormal = 0.001953125f;  // 2^-9
};
template <>
struct Fp8Traits<Fp8Dtype::e5m2> {
  static constexpr int kMantBits = 2;
  static constexpr int kBias = 15;
  static constexpr uint32_t kMaxCode = 0x7B;       // 57344
  static constexpr uint32_t kOverflowCode = 0x7C;  // infinity
  static constexpr float kMax = 57344.0f;
  static constexpr float kMinNormal = 6.103515625e-05f;     // 2^-14
  static constexpr float kMinSubnormal = 1.52587890625e-05f;  // 2^-16
};

// The encoder's constants, derived from the format: fp8_encode below and its vector forms
// (kernels/cpu/fp8_simd.cpp) take them from here.
template <Fp8Dtype F>
struct Fp8EncodeConsts {
  using T = Fp8Traits<F>;
  static constexpr uint32_t kDrop = 23 - T::kMantBits;               // mantissa bits rounded away
  static constexpr uint32_t kExpShift = 127 - T::kBias;              // FP32 -> FP8 exponent bias change
  static constexpr uint32_t kMinNormalBits = (kExpShift + 1) << 23;  // 2^(1 - bias) as FP32 bits
  // A subnormal result's code is the FP32 mantissa (with its implicit bit) >> (kSubShift - e).
  static constexpr uint32_t kSubShift = 150 + 1 - T::kBias - T::kMantBits;
};

FP8MOE_HD inline uint32_t float_bits(float x) {
  uint32_t u;
  memcpy(&u, &x, sizeof u);
  return u;
}
FP8MOE_HD inline float bits_float(uint32_t u) {
  float x;
  memcpy(&x, &u, sizeof x);
  return x;
}

// FP32 -> FP8 byte, round to nearest even. Branch-free (both the normal and the subnormal result
// are computed and one is selected), so that CPU loops over it vectorize.
template <Fp8Dtype F, bool kSaturate>
FP8MOE_HD inline uint8_t fp8_encode(float x) {
  using T = Fp8Traits<F>;
  using C = Fp8EncodeConsts<F>;
  constexpr uint32_t kDrop = C::kDrop, kExpShift = C::kExpShift, kMinNormalBits = C::kMinNormalBits,
                     kSubShift = C::kSubShift;
  const uint32_t u = float_bits(x);
  const uint32_t sign = (u >> 24) & 0x80u;
  const uint32_t a = u & 0x7FFFFFFFu;

  // Normal in FP8 (or overflow): round the mantissa to kMantBits; carries move into the exponent.
  const uint32_t r = a + ((1u << (kDrop - 1)) - 1) + ((a >> kDrop) & 1u);
  const uint32_t shifted = r >> kDrop;  // (FP32 exponent << mant) | mantissa
  const uint32_t normal = shifted - (kExpShift << T::kMantBits);

  // Subnormal in FP8: code = round_even(|x| / min_subnormal) in 0 .. 2^mant (the top one is the
  // min normal). |x| = mant * 2^(e - 150), e = max(exp, 1), so code = mant >> (kSubShift - e).
  const uint32_t exp = a >> 23;
  const uint32_t mant = (a & 0x7FFFFFu) | (exp ? 0x800000u : 0u);
  const uint32_t e = exp ? exp : 1u;
  uint32_t shift = kSubShift - e;               // >= kDrop + 1 for subnormal inputs
  shift = shift > 31u || e > kSubShift ? 31u : shift;  // (normal inputs: value unused)
  shift = shift < 1u ? 1u : shift;
  const uint32_t q = mant >> shift;
  const uint32_t rem = mant & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1u);
  const uint32_t sub = q + ((rem > half) | ((rem == half) & q & 1u));

  uint32_t code = a >= kMinNormalBits ? normal : sub;
  const bool overflow = a >= 0x7F800000u || shifted >= ((kExpShift << T::kMantBits) + T::kMaxCode + 1);
  code = overflow ? (kSaturate ? T::kMaxCode : T::kOverflowCode) : code;
  code |= sign;
  return static_cast<uint8_t>(a > 0x7F800000u ? 0x7Fu : code);  // NaN: canonical, positive
}

// FP8 byte -> FP32, exact.
template <Fp8Dtype F>
FP8MOE_HD inline float fp8_decode(uint8_t b) {
  using T = Fp8Traits<F>;
  const uint32_t sign = uint32_t(b & 0x80u) << 24;
  const uint32_t e = (b & 0x7Fu) >> T::kMantBits;
  const uint32_t m = b & ((1u << T::kMantBits) - 1u);
  constexpr uint32_t kExpMax = (0x7Fu >> T::kMantBits);
  if (F == Fp8Dtype::e4m3 && (b & 0x7Fu) == 0x7Fu) return bits_float(sign | 0x7FC00000u);  // NaN
  if (F == Fp8Dtype::e5m2 && e == kExpMax) return bits_float(sign | (m ? 0x7FC00000u : 0x7F800000u));
  if (e == 0) {  // subnormal: m * 2^(1 - bias - mant)
    const float v = float(m) * T::kMinSubnormal;
    return sign ? -v : v;
  }
  return bits_float(sign | ((e + 127u - T::kBias) << 23) | (m << (23 - T::kMantBits)));
}

// Runtime-dispatched forms.
FP8MOE_HD inline uint8_t fp8_encode(float x, Fp8Dtype f, bool saturate) {
  if (f == Fp8Dtype::e4m3)
    return saturate ? fp8_encode<Fp8Dtype::e4m3, true>(x) : fp8_encode<Fp8Dtype::e4m3, false>(x);
  return saturate ? fp8_encode<Fp8Dtype::e5m2, true>(x) : fp8_encode<Fp8Dtype::e5m2, false>(x);
}
FP8MOE_HD inline float fp8_decode(uint8_t b, Fp8Dtype f) {
  return f == Fp8Dtype::e4m3 ? fp8_decode<Fp8Dtype::e4m3>(b) : fp8_decode<Fp8Dtype::e5m2>(b);
}
FP8MOE_HD inline float fp8_max(Fp8Dtype f) {
  return f == Fp8Dtype::e4m3 ? Fp8Traits<Fp8Dtype::e4m3>::kMax : Fp8Traits<Fp8Dtype::e5m2>::kMax;
}

// FP32 -> BF16 bits, round to nearest even; NaN stays a (quiet) NaN. BF16 -> FP32 is exact.
FP8MOE_HD inline uint16_t bf16_encode(float x) {
  uint32_t u = float_bits(x);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return uint16_t((u >> 16) | 0x40u);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}
FP8MOE_HD inline float bf16_decode(uint16_t b) { return bits_float(uint32_t(b) << 16); }
// An activation element as kept (train.activations): FP32 itself, or BF16 bits widened (exact). The
// ops that read either form are written once over both.
FP8MOE_HD inline float kept_value(float x) { return x; }
FP8MOE_HD inline float kept_value(uint16_t bf16) { return bf16_decode(bf16); }

// BF16 (raw bits) -> FP8: a BF16 value is exactly the FP32 value with the low 16 bits zero.
FP8MOE_HD inline uint8_t fp8_encode_bf16(uint16_t bf16, Fp8Dtype f, bool saturate) {
  return fp8_encode(bits_float(uint32_t(bf16) << 16), f, saturate);
}

// Decode tables for the CPU (256 entries per format).
const float* fp8_decode_table(Fp8Dtype f);

const char* to_string(Fp8Dtype f);

}  // namespace fp8moe
