#include "model/sampling.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

namespace fp8moe {

int32_t sample_token(const float* logits, int64_t V, double temperature, int64_t top_k, double u) {
  std::vector<int32_t> order(static_cast<size_t>(V));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return logits[a] > logits[b]; });
  if (temperature <= 0) return order[0];
  const int64_t k = top_k > 0 ? std::min(top_k, V) : V;
  std::vector<double> p(static_cast<size_t>(k));
  for (int64_t j = 0; j < k; ++j) p[size_t(j)] = std::exp((double(logits[order[size_t(j)]]) - logits[order[0]]) / temperature);
  double left = u * std::accumulate(p.begin(), p.end(), 0.0);
  for (int64_t j = 0; j < k; ++j)
    if ((left -= p[size_t(j)]) < 0) return order[size_t(j)];
  return order[size_t(k - 1)];  // u at the top end, through rounding
}

}  // namespace fp8moe
