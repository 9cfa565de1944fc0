// The vectorized FP8 loops (kernels/cpu/fp8_simd.h) at every level this CPU has, against the
// element code of kernels/fp8.h (itself checked against CUDA's conversion for all 2^32 inputs,
// bench/fp8_exhaustive, which also runs these vector forms) and against exact arithmetic: the
// widening to BF16 against ldexp of the decoded value. Lengths 0..80 cover every tail of the
// 8-, 16- and 32-lane loops. A level the CPU lacks is SKIPPED, with the reason.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "kernels/cpu/fp8_simd.h"

namespace fp8moe::test {
namespace {

using cpu::SimdLevel;

}  // namespace
}  // namespace fp8moe::test
namespace fp8moe::cpu {
void PrintTo(SimdLevel l, std::ostream* os) { *os << to_string(l); }
}  // namespace fp8moe::cpu
namespace fp8moe::test {
namespace {

class Fp8Simd : public testing::TestWithParam<SimdLevel> {
 protected:
  void SetUp() override {
    if (GetParam() > cpu::cpu_simd_level())
      GTEST_SKIP() << "this CPU runs " << cpu::to_string(cpu::cpu_simd_level()) << ", not "
                   << cpu::to_string(GetParam());
  }
};

// Values of every kind: normal, FP8-subnormal, FP32-subnormal, zeros, ties, huge, inf, NaN.
std::vector<float> mixed_values(int64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<uint32_t> bits;
  const float special[] = {0.0f, -0.0f, 464.0f, -464.0f, 61440.0f, 480.0f, INFINITY, -INFINITY, NAN, -NAN,
                           1e-45f, -1e-40f, 0.0009765625f, 0.0029296875f, 7.62939453125e-06f, 3e38f};
  std::vector<float> x(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t kind = bits(rng) % 8;
    if (kind == 0) x[i] = special[bits(rng) % (sizeof special / sizeof special[0])];
    else if (kind == 1) x[i] = bits_float(bits(rng));  // any pattern
    else if (kind == 2) x[i] = normal(rng) * 1e-3f;    // many FP8 subnormals after scaling
    else x[i] = normal(rng) * 100.0f;
  }
  return x;
}

struct Expected {
  std::vector<uint8_t> q;
  int64_t saturated = 0, underflowed = 0;
  uint32_t amax_bits = 0;
};

Expected reference(Fp8Dtype f, bool sat, const float* x, int64_t n, const float* scale, bool per_element) {
  Expected e;
  const float limit = f == Fp8Dtype::e4m3 ? 464.0f : 61440.0f;
  for (int64_t i = 0; i < n; ++i) {
    const float v = x[i] * scale[per_element ? i : 0];
    const uint8_t b = fp8_encode(v, f, sat);
    e.q.push_back(b);
    const float a = std::fabs(v);
    e.saturated += f == Fp8Dtype::e4m3 ? a > limit : a >= limit;
    e.underflowed += v != 0.0f && (b & 0x7F) == 0;
    uint32_t u;
    std::memcpy(&u, &x[i], 4);
    e.amax_bits = std::max(e.amax_bits, u & 0x7FFFFFFFu);
  }
  return e;
}

TEST_P(Fp8Simd, EncodeSpanMatchesTheElementEncoder) {
  const SimdLevel level = GetParam();
  for (Fp8Dtype f : {Fp8Dtype::e4m3, Fp8Dtype::e5m2})
    for (bool sat : {true, false})
      for (bool per_element : {false, true})
        for (int64_t n = 0; n <= 80; ++n) {
          const std::vector<float> x = mixed_values(n + 1, uint64_t(n) * 7 + sat + 2 * per_element);
          std::vector<float> scale = mixed_values(n + 1, uint64_t(n) * 13 + 5);
          for (float& s : scale) s = std::ldexp(1.0f, int(float_bits(s) % 40) - 20);  // powers of two, 2^-20 .. 2^19
          scale[0] = 0.75f;  // one non-power-of-two scale: rounding happens in the product
          const float* xs = x.data() + 1;  // unaligned start
          const Expected want = reference(f, sat, xs, n, scale.data(), per_element);
          std::vector<uint8_t> q(static_cast<size_t>(n) + 1, 0xAB);
          cpu::EncodeStats st;
          st.amax_bits = 5;  // accumulates: max with what is there
          cpu::encode_span(level, f, sat, xs, q.data(), n, scale.data(), per_element, true, &st);
          SCOPED_TRACE(testing::Message() << to_string(f) << (sat ? " sat" : " nosat")
                                          << (per_element ? " per-element" : " one scale") << " n=" << n);
          for (int64_t i = 0; i < n; ++i) ASSERT_EQ(q[i], want.q[i]) << "element " << i << " x " << xs[i];
          EXPECT_EQ(q[n], 0xAB) << "wrote past the span";
          EXPECT_EQ(st.saturated, want.saturated);
          EXPECT_EQ(st.underflowed, want.underflowed);
          EXPECT_EQ(st.amax_bits, std::max<uint32_t>(5, want.amax_bits));
          cpu::EncodeStats no_amax;
          cpu::encode_span(level, f, sat, xs, q.data(), n, scale.data(), per_element, false, &no_amax);
          EXPECT_EQ(no_amax.amax_bits, 0u);
          EXPECT_EQ(no_amax.saturated, want.saturated);
        }
}

TEST_P(Fp8Simd, AbsBitsMaxFindsTheLargestAndNaN) {
  const SimdLevel level = GetParam();
  for (int64_t n = 0; n <= 80; ++n)
    for (int64_t at = 0; at < std::max<int64_t>(n, 1); ++at) {
      std::vector<float> x(static_cast<size_t>(n), -0.5f);
      std::vector<uint32_t> m(static_cast<size_t>(n), 0x3E000000u), want_m = m;  // 0.125 already there
      uint32_t want = n ? 0x3F000000u : 0;
      if (n) {
        x[at] = -3.0f;
        want = 0x40400000u;
      }
      for (int64_t i = 0; i < n; ++i) want_m[i] = float_bits(std::fabs(x[i]));
      EXPECT_EQ(cpu::abs_bits_max(level, x.data(), n), want) << "n=" << n << " at " << at;
      cpu::abs_bits_max_into(level, m.data(), x.data(), n);
      EXPECT_EQ(m, want_m) << "n=" << n;
      if (n) {
        x[at] = -NAN;
        EXPECT_TRUE(std::isnan(bits_float(cpu::abs_bits_max(level, x.data(), n)))) << "n=" << n << " NaN at " << at;
      }
    }
}

// Every byte, shifted by every k the GEMM allows (results normal), at every tail length.
TEST_P(Fp8Simd, WidenToBf16IsExact) {
  const SimdLevel level = GetParam();
  for (Fp8Dtype f : {Fp8Dtype::e4m3, Fp8Dtype::e5m2})
    for (int k : {-100, -37, -1, 0, 1, 5, 100}) {
      std::vector<uint8_t> src(256 + 80);
      for (size_t i = 0; i < src.size(); ++i) src[i] = uint8_t(i * 167 + 3);  // every byte, scrambled
      for (int64_t n : {int64_t(0), int64_t(1), int64_t(15), int64_t(31), int64_t(33), int64_t(256 + 79)}) {
        std::vector<uint16_t> out(static_cast<size_t>(n) + 1, 0xBEEF);
        std::vector<uint16_t> out_each(out);
        const std::vector<int16_t> adds(static_cast<size_t>(n) + 1, int16_t(k * 128));
        cpu::fp8_to_bf16_span(level, f, src.data() + 1, out.data(), n, k);
        cpu::fp8_to_bf16_span(level, f, src.data() + 1, out_each.data(), n, adds.data());
        EXPECT_EQ(out_each, out) << "a step per element, all equal to k";
        for (int64_t i = 0; i < n; ++i) {
          const float v = fp8_decode(src[i + 1], f);
          // Zeros, infinities and NaN are not scaled; the rest are exact in BF16 after 2^k.
          const float want = (v == 0.0f || !std::isfinite(v)) ? v : float(std::ldexp(double(v), k));
          const uint16_t got = out[i];
          const float back = bits_float(uint32_t(got) << 16);
          if (std::isnan(want)) {
            ASSERT_TRUE(std::isnan(back)) << to_string(f) << " byte " << int(src[i + 1]);
            ASSERT_EQ(got >> 15, uint32_t(src[i + 1] >> 7)) << "NaN sign";
          } else {
            ASSERT_EQ(float_bits(back), float_bits(want)) << to_string(f) << " byte " << int(src[i + 1]) << " k " << k;
          }
        }
        EXPECT_EQ(out[n], 0xBEEF) << "wrote past the span";
      }
    }
}

// FP32 <-> BF16 (train.activations bf16): every level gives bf16_encode's bits (NaN quiet, ties to
// even, FP32 subnormals rounded like any value), decodes exactly, and rounds in place; and writes
// nothing past the span.
TEST_P(Fp8Simd, Bf16ConversionsAreTheScalarEncoder) {
  const SimdLevel level = GetParam();
  std::vector<float> x = mixed_values(1000, 91);
  for (uint32_t u : {0x3F808000u, 0x3F818000u, 0x7F7FFFFFu, 0x7F7F8000u, 0x00008000u, 0x00018000u, 0xFF800001u,
                     0x7FC00001u, 0x80000000u})
    x.push_back(bits_float(u));
  for (int64_t n : {int64_t(0), int64_t(1), int64_t(7), int64_t(16), int64_t(17), int64_t(33), int64_t(x.size()) - 1}) {
    std::vector<uint16_t> y(static_cast<size_t>(n) + 1, 0xBEEF);
    cpu::f32_to_bf16_span(level, x.data() + 1, y.data(), n);
    std::vector<float> back(static_cast<size_t>(n) + 1, 7.0f), rounded(x.begin() + 1, x.begin() + 1 + n);
    rounded.push_back(7.0f);
    cpu::bf16_to_f32_span(level, y.data(), back.data(), n);
    cpu::round_bf16_span(level, rounded.data(), rounded.data(), n);
    for (int64_t i = 0; i < n; ++i) {
      const uint16_t want = bf16_encode(x[size_t(i) + 1]);
      ASSERT_EQ(y[size_t(i)], want) << "element " << i << " bits " << std::hex << float_bits(x[size_t(i) + 1]);
      ASSERT_EQ(float_bits(back[size_t(i)]), uint32_t(want) << 16) << "element " << i;
      ASSERT_EQ(float_bits(rounded[size_t(i)]), uint32_t(want) << 16) << "element " << i;
    }
    EXPECT_EQ(y[size_t(n)], 0xBEEF) << "wrote past the span";
    EXPECT_EQ(back[size_t(n)], 7.0f) << "wrote past the span";
    EXPECT_EQ(rounded[size_t(n)], 7.0f) << "wrote past the span";
  }
}

// A different step per element (a cols_Tx1 row): each element moved by its own k.
TEST_P(Fp8Simd, WidenToBf16WithAStepPerElement) {
  const SimdLevel level = GetParam();
  for (int64_t n : {int64_t(7), int64_t(16), int64_t(45), int64_t(300)}) {
    std::vector<uint8_t> src(static_cast<size_t>(n));
    std::vector<int16_t> adds(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      src[i] = uint8_t(i * 89 + 11);
      adds[i] = int16_t(((i * 37) % 61 - 30) * 128);
    }
    std::vector<uint16_t> out(static_cast<size_t>(n));
    cpu::fp8_to_bf16_span(level, Fp8Dtype::e4m3, src.data(), out.data(), n, adds.data());
    for (int64_t i = 0; i < n; ++i) {
      const float v = fp8_decode(src[i], Fp8Dtype::e4m3);
      const float want = (v == 0.0f || !std::isfinite(v)) ? v : float(std::ldexp(double(v), adds[i] / 128));
      const float back = bits_float(uint32_t(out[i]) << 16);
      if (std::isnan(want)) EXPECT_TRUE(std::isnan(back));
      else EXPECT_EQ(float_bits(back), float_bits(want)) << "byte " << int(src[i]) << " k " << adds[i] / 128;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Levels, Fp8Simd, testing::Values(SimdLevel::scalar, SimdLevel::avx2, SimdLevel::avx512),
                         [](const testing::TestParamInfo<SimdLevel>& i) { return std::string(cpu::to_string(i.param)); });

}  // namespace
}  // namespace fp8moe::test
