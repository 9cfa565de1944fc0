#include "kernels/fp8.h"

#include <array>

namespace fp8moe {
namespace {
template <Fp8Dtype F>
std::array<float, 256> make_table() {
  std::array<float, 256> t{};
  for (int b = 0; b < 256; ++b) t[b] = fp8_decode<F>(static_cast<uint8_t>(b));
  return t;
}
}  // namespace

const float* fp8_decode_table(Fp8Dtype f) {
  static const std::array<float, 256> e4m3 = make_table<Fp8Dtype::e4m3>();
  static const std::array<float, 256> e5m2 = make_table<Fp8Dtype::e5m2>();
  return f == Fp8Dtype::e4m3 ? e4m3.data() : e5m2.data();
}

const char* to_string(Fp8Dtype f) { return f == Fp8Dtype::e4m3 ? "e4m3" : "e5m2"; }

}  // namespace fp8moe
