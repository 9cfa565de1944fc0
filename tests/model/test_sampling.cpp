// generate's sampler against the distribution it promises: over a grid of M evenly spaced u, each
// token is chosen in a fraction within 1/M of its probability under softmax(logits / T) restricted
// to the top k (closed form below, in double), and never outside the top k.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "model/sampling.h"

namespace fp8moe {
namespace {

TEST(Sampling, GreedyTakesTheLargestLogitLowestIdOnTies) {
  const std::vector<float> l = {0.5f, 2.0f, -1.0f, 2.0f};
  EXPECT_EQ(sample_token(l.data(), 4, 0.0, 0, 0.99), 1);
  EXPECT_EQ(sample_token(l.data(), 4, 0.0, 1, 0.0), 1);
}

TEST(Sampling, FrequenciesFollowTheTemperatureAndTopK) {
  // Logits 0, 1, ..., 7 scattered over 8 ids; token id of logit j: (3 j + 1) % 8.
  std::vector<float> logits(8);
  for (int j = 0; j < 8; ++j) logits[size_t((3 * j + 1) % 8)] = float(j);
  const int M = 100000;
  for (double T : {0.5, 1.0, 2.0})
    for (int64_t k : {int64_t(0), int64_t(1), int64_t(3), int64_t(8), int64_t(20)}) {
      SCOPED_TRACE("temperature " + std::to_string(T) + ", top-k " + std::to_string(k));
      const int kept = k == 0 || k > 8 ? 8 : int(k);
      // The kept logits are 7, 6, ..., 8 - kept: p(logit j) = e^(j / T) / sum over kept of e^(i / T).
      double z = 0;
      for (int j = 8 - kept; j < 8; ++j) z += std::exp(j / T);
      std::vector<int> count(8, 0);
      for (int m = 0; m < M; ++m) ++count[size_t(sample_token(logits.data(), 8, T, k, (m + 0.5) / M))];
      for (int j = 0; j < 8; ++j) {
        const int id = (3 * j + 1) % 8;
        const double want = j >= 8 - kept ? std::exp(j / T) / z : 0.0;
        EXPECT_NEAR(double(count[size_t(id)]) / M, want, 1.0 / M + 1e-12) << "logit " << j << " (id " << id << ")";
      }
    }
}

}  // namespace
}  // namespace fp8moe
