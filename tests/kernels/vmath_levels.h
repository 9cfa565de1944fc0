// The CPU ops that take their exponentials from kernels/cpu/vmath.h, on every level of it this
// CPU runs (scalar, SSE2, AVX, AVX-512): the results must be the widest level's bit for bit, so
// that the op gives the same bits with or without AVX-512 (vmath.h).
#pragma once

#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>
#include <vector>

#include "kernels/cpu/vmath.h"

namespace fp8moe::test {

// fn() returns the op's outputs as one vector (FP32 outputs converted to double: exact, and
// distinct floats stay distinct doubles). Each level's outputs against the widest level's.
template <class Fn>
void expect_same_bits_on_every_level(Fn fn, const char* what) {
  namespace vm = cpu::vm;
  const vm::Level widest = vm::level();
  const std::vector<double> want = fn();
  int levels = 0;
  for (vm::Level l : vm::kLevels) {
    if (!vm::supported(l)) continue;
    ++levels;
    vm::set_level(l);
    const std::vector<double> got = fn();
    vm::set_level(widest);
    ASSERT_EQ(got.size(), want.size()) << what << " on " << vm::to_string(l);
    for (size_t i = 0; i < got.size(); ++i)
      ASSERT_EQ(std::memcmp(&got[i], &want[i], sizeof(double)), 0)
          << what << " element " << i << " on " << vm::to_string(l) << ": " << got[i] << " vs " << want[i] << " on "
          << vm::to_string(widest);
  }
  std::printf("[ MEASURE  ] %s: the same bits on %d vector math levels\n", what, levels);
}

inline void append(std::vector<double>& out, const std::vector<float>& v) { out.insert(out.end(), v.begin(), v.end()); }

}  // namespace fp8moe::test
