// The BF16 roundings the tests check the kernels against, found without kernels/fp8.h's bit
// tricks (test_elementwise, test_moe_ops).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace fp8moe::test {

// The BF16 nearest to x, found without bf16_encode's bit trick: of the two BF16 values around x
// (x's high 16 bits, and the next BF16 away from zero), the closer in FP64; a tie goes to the one
// whose last mantissa bit is 0. Past BF16's largest finite value rounding gives infinity (RNE).
inline uint16_t nearest_bf16(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  if (std::isnan(x)) return uint16_t((u >> 16) | 0x40u);
  const uint16_t lo = uint16_t(u >> 16), hi = uint16_t(lo + 1);  // same sign, larger magnitude
  auto val = [](uint16_t b) {
    const uint32_t w = uint32_t(b) << 16;
    float f;
    std::memcpy(&f, &w, 4);
    return double(f);
  };
  if ((u & 0xFFFFu) == 0) return lo;
  // Past the largest finite BF16 the next value is infinity, which rounding treats as 2^128.
  const double vh = std::isinf(val(hi)) ? std::copysign(std::ldexp(1.0, 128), double(x)) : val(hi);
  const double dl = std::abs(double(x) - val(lo)), dh = std::abs(vh - double(x));
  if (dl != dh) return dl < dh ? lo : hi;
  return (lo & 1u) ? hi : lo;
}

// A BF16 value widened to FP32: its bits in the high half (exact).
inline float bf16_value(uint16_t b) {
  const uint32_t w = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &w, 4);
  return f;
}

}  // namespace fp8moe::test
