// fp8moe's FP8 encoder and decoder against CUDA's own conversions (cuda_fp8.h), which are
// host-callable and need no GPU. 2^24 random bit patterns per format and mode, plus every
// boundary; BF16 and decoding exhaustively. (All 2^32 floats: bench/fp8_exhaustive.)
#include <cuda_fp8.h>
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "kernels/fp8.h"

namespace fp8moe {
namespace {

__nv_fp8_interpretation_t interp(Fp8Dtype f) { return f == Fp8Dtype::e4m3 ? __NV_E4M3 : __NV_E5M2; }

uint8_t oracle(float x, Fp8Dtype f, bool sat) {
  return __nv_cvt_float_to_fp8(x, sat ? __NV_SATFINITE : __NV_NOSAT, interp(f));
}

struct Mode {
  Fp8Dtype format;
  bool saturate;
};
void PrintTo(const Mode& m, std::ostream* os) { *os << to_string(m.format) << (m.saturate ? "_sat" : "_nosat"); }

class Fp8Oracle : public testing::TestWithParam<Mode> {};

// Every boundary: zeros, min subnormal and its halves, min normal, ties, max, max + half ulp, inf,
// NaN, and their neighbours one float ulp either side.
std::vector<float> boundary_values() {
  std::vector<float> base = {0.0f, 1.0f, 448.0f, 464.0f, 480.0f, 57344.0f, 61440.0f, 65536.0f,
                             0.015625f, 0.001953125f, 0.0009765625f, 0.0029296875f,  // E4M3 min normal/subnormal, half, 1.5x
                             6.103515625e-05f, 1.52587890625e-05f, 7.62939453125e-06f, 2.288818359375e-05f,
                             1.0625f, 1.1875f, 1.125f, 3.5f, 240.0f, 256.0f, 416.0f, 432.0f, 40960.0f, 53248.0f,
                             1e-30f, 1e-45f, 3.0e38f, INFINITY, NAN, 1.17549435e-38f};
  std::vector<float> out;
  for (float b : base)
    for (float s : {1.0f, -1.0f}) {
      const float v = s * b;
      out.push_back(v);
      out.push_back(std::nextafter(v, INFINITY));
      out.push_back(std::nextafter(v, -INFINITY));
    }
  // Every midpoint between neighbouring representable values of both formats, and their ulp neighbours.
  for (Fp8Dtype f : {Fp8Dtype::e4m3, Fp8Dtype::e5m2})
    for (int b = 0; b < 127; ++b) {
      const float lo = fp8_decode(uint8_t(b), f), hi = fp8_decode(uint8_t(b + 1), f);
      if (!std::isfinite(lo) || !std::isfinite(hi)) continue;
      const float mid = 0.5f * (lo + hi);
      for (float v : {mid, std::nextafter(mid, INFINITY), std::nextafter(mid, 0.0f), lo, hi})
        out.insert(out.end(), {v, -v});
    }
  return out;
}

TEST_P(Fp8Oracle, BoundariesMatchCuda) {
  const Mode m = GetParam();
  for (float x : boundary_values())
    ASSERT_EQ(int(fp8_encode(x, m.format, m.saturate)), int(oracle(x, m.format, m.saturate)))
        << "x = " << x << " (bits 0x" << std::hex << float_bits(x) << ")";
}

TEST_P(Fp8Oracle, RandomBitPatternsMatchCuda) {
  const Mode m = GetParam();
  std::mt19937 rng(12345 + int(m.format) * 2 + m.saturate);
  constexpr int64_t kCount = int64_t(1) << 24;
  int64_t mismatches = 0;
  uint32_t first_bad = 0;
  for (int64_t i = 0; i < kCount; ++i) {
    // Half the patterns uniform over all bits; half concentrated on the exponents FP8 can represent.
    uint32_t u = rng();
    if (i & 1) u = (u & 0x807FFFFFu) | ((100u + (u >> 23) % 60u) << 23);
    const float x = bits_float(u);
    if (fp8_encode(x, m.format, m.saturate) != oracle(x, m.format, m.saturate) && mismatches++ == 0) first_bad = u;
  }
  EXPECT_EQ(mismatches, 0) << "first mismatch at bits 0x" << std::hex << first_bad;
}

TEST_P(Fp8Oracle, EveryBf16MatchesCuda) {
  const Mode m = GetParam();
  for (uint32_t b = 0; b < 65536; ++b) {
    const auto raw = static_cast<uint16_t>(b);
    __nv_bfloat16_raw r;
    r.x = raw;
    ASSERT_EQ(int(fp8_encode_bf16(raw, m.format, m.saturate)),
              int(__nv_cvt_bfloat16raw_to_fp8(r, m.saturate ? __NV_SATFINITE : __NV_NOSAT, interp(m.format))))
        << "bf16 0x" << std::hex << b;
  }
}

INSTANTIATE_TEST_SUITE_P(Modes, Fp8Oracle,
                         testing::Values(Mode{Fp8Dtype::e4m3, true}, Mode{Fp8Dtype::e4m3, false},
                                         Mode{Fp8Dtype::e5m2, true}, Mode{Fp8Dtype::e5m2, false}),
                         [](const auto& i) {
                           return std::string(to_string(i.param.format)) + (i.param.saturate ? "_sat" : "_nosat");
                         });

TEST(Bf16, EncodeMatchesCudaOn2To24PatternsAndDecodeIsExact) {
  // The optimizer's BF16 moments: fp8moe's rounding against cuda_bf16.h's __float2bfloat16_rn.
  std::mt19937 rng(7);
  for (int64_t i = 0; i < (int64_t(1) << 24); ++i) {
    const float x = bits_float(i < 16 ? uint32_t(i) << 28 : rng());
    const __nv_bfloat16 ref = __float2bfloat16_rn(x);
    const uint16_t ref_bits = static_cast<__nv_bfloat16_raw>(ref).x;
    const uint16_t got = bf16_encode(x);
    if (std::isnan(x)) {
      ASSERT_TRUE(std::isnan(bf16_decode(got)));
      continue;
    }
    ASSERT_EQ(got, ref_bits) << "x bits 0x" << std::hex << float_bits(x);
    ASSERT_EQ(float_bits(bf16_decode(got)), uint32_t(ref_bits) << 16);
  }
}

TEST(Fp8Decode, EveryByteMatchesCudaViaHalf) {
  for (Fp8Dtype f : {Fp8Dtype::e4m3, Fp8Dtype::e5m2}) {
    const float* table = fp8_decode_table(f);
    for (int b = 0; b < 256; ++b) {
      const __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(b), interp(f));
      const float want = __half2float(__half(h));  // every FP8 value is exact in FP16
      const float got = fp8_decode(uint8_t(b), f);
      if (std::isnan(want)) {
        EXPECT_TRUE(std::isnan(got)) << to_string(f) << " byte " << b;
        EXPECT_TRUE(std::isnan(table[b]));
      } else {
        EXPECT_EQ(float_bits(got), float_bits(want)) << to_string(f) << " byte " << b << ": " << got << " vs " << want;
        EXPECT_EQ(float_bits(table[b]), float_bits(want));
      }
    }
  }
}

TEST(Fp8Decode, RoundTripOfEveryFiniteCode) {
  for (Fp8Dtype f : {Fp8Dtype::e4m3, Fp8Dtype::e5m2})
    for (int b = 0; b < 256; ++b) {
      const float v = fp8_decode(uint8_t(b), f);
      if (!std::isfinite(v)) continue;
      // -0 encodes back to 0x80, every other finite value to itself.
      EXPECT_EQ(int(fp8_encode(v, f, true)), b) << to_string(f) << " " << v;
      EXPECT_EQ(int(fp8_encode(v, f, false)), b) << to_string(f) << " " << v;
    }
}

TEST(Fp8Encode, DocumentedEdgeCases) {
  using F = Fp8Dtype;
  EXPECT_EQ(fp8_encode(464.0f, F::e4m3, true), 0x7E);     // tie to even at the top
  EXPECT_EQ(fp8_encode(464.0f, F::e4m3, false), 0x7E);
  EXPECT_EQ(fp8_encode(464.01f, F::e4m3, false), 0x7F);   // overflow -> NaN
  EXPECT_EQ(fp8_encode(464.01f, F::e4m3, true), 0x7E);    // saturates
  EXPECT_EQ(fp8_encode(-INFINITY, F::e4m3, true), 0xFE);
  EXPECT_EQ(fp8_encode(INFINITY, F::e5m2, false), 0x7C);
  EXPECT_EQ(fp8_encode(-INFINITY, F::e5m2, false), 0xFC);
  EXPECT_EQ(fp8_encode(INFINITY, F::e5m2, true), 0x7B);
  EXPECT_EQ(fp8_encode(-NAN, F::e4m3, true), 0x7F);       // NaN sign dropped, as CUDA does
  EXPECT_EQ(fp8_encode(0.0009765625f, F::e4m3, true), 0x00);  // half the min subnormal: tie to 0
  EXPECT_EQ(fp8_encode(0.00146484375f, F::e4m3, true), 0x01); // 0.75 x min subnormal: up to 1
  EXPECT_EQ(fp8_encode(0.0029296875f, F::e4m3, true), 0x02);  // 1.5 x min subnormal: tie to even 2
}

}  // namespace
}  // namespace fp8moe
