// Reproducible random inputs for the kernel tests.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

namespace fp8moe::test {

// n samples of N(0, sd^2) from a seeded mt19937_64, in order.
inline std::vector<float> normal_vector(int64_t n, uint64_t seed, float sd = 1.0f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.0f, sd);
  std::vector<float> x(static_cast<size_t>(n));
  for (float& v : x) v = d(rng);
  return x;
}

}  // namespace fp8moe::test
