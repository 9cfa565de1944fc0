#include "kernels/router.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "kernels/check.h"
#include "kernels/cpu/vmath.h"

namespace fp8moe::cpu {

namespace {
// p = 1 / (1 + exp(-z)).
FP8MOE_SIMD_CLONES void sigmoid(const float* z, float* p, int64_t n) {
  vm::exp_neg(z, p, n);
  for (int64_t i = 0; i < n; ++i) p[i] = 1.0f / (1.0f + p[i]);
}
}  // namespace

void route(const float* z, const float* bias, const RouterRule& rule, const RoutingBuffers& r) {
  const int64_t N = r.N, E = r.E, k = r.k, G = rule.n_group;
  FP8MOE_ASSERT(k == rule.top_k && k >= 1 && k <= E, "top_k ", k, " of ", E, " experts");
  const int64_t per_group = E / G;
  FP8MOE_ASSERT(E % G == 0 && rule.topk_group >= 1 && rule.topk_group <= G && k <= rule.topk_group * per_group,
                "node-limited routing: ", E, " experts in ", G, " groups, ", rule.topk_group, " of them, top ", k);
  std::vector<float> key(static_cast<size_t>(E)), group_score(static_cast<size_t>(G));
  std::vector<double> ez(rule.sigmoid ? 0 : static_cast<size_t>(E));  // a token's exp(z - max z)
  std::vector<int32_t> order(static_cast<size_t>(E)), group_order(static_cast<size_t>(G));
  // Scores: sigmoid as 1 / (1 + exp(-z)) over all N E at once, softmax per token (double
  // exponentials and sum, as the GPU's); the exponentials from kernels/cpu/vmath.h.
  if (rule.sigmoid) sigmoid(z, r.prob, N * E);
  for (int64_t n = 0; n < N; ++n) {
    const float* zr = z + n * E;
    float* p = r.prob + n * E;
    if (!rule.sigmoid) {
      const float m = *std::max_element(zr, zr + E);
      vm::exp_sub_f64(zr, m, ez.data(), E);
      const double sum = vm::lane_sum(E, [&](int64_t e) { return ez[e]; });
      for (int64_t e = 0; e < E; ++e) p[e] = float(ez[e] / sum);
    }
    // Selection keys: score + bias. Node-limited routing keeps the topk_group groups whose two
    // best keys sum highest and takes the others out of the choice.
    for (int64_t e = 0; e < E; ++e) key[e] = p[e] + bias[e];
    if (G > 1) {
      for (int64_t g = 0; g < G; ++g) {
        const float* kg = key.data() + g * per_group;
        float best = -INFINITY, second = -INFINITY;
        for (int64_t e = 0; e < per_group; ++e) {
          if (kg[e] > best) second = best, best = kg[e];
          else if (kg[e] > second) second = kg[e];
        }
        group_score[g] = best + second;
      }
      std::iota(group_order.begin(), group_order.end(), 0);
      std::stable_sort(group_order.begin(), group_order.end(),
                       [&](int32_t a, int32_t b) { return group_score[a] > group_score[b]; });
      for (int64_t j = rule.topk_group; j < G; ++j)
        std::fill_n(key.data() + group_order[j] * per_group, per_group, -INFINITY);
    }
    // Top-k by key; ties go to the lower expert index (a stable, deterministic order).
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return key[a] > key[b]; });
    double chosen = 0;
    for (int64_t j = 0; j < k; ++j) chosen += p[order[j]];
    for (int64_t j = 0; j < k; ++j) {
      r.expert[n * k + j] = order[j];
      const double g = rule.normalise ? p[order[j]] / chosen : double(p[order[j]]);
      r.gate[n * k + j] = float(g * rule.scaling);
    }
  }
  // Capacity: assignments beyond it, in token order, are dropped.
  std::fill_n(r.load, E, int64_t(0));
  for (int64_t i = 0; i < N * k; ++i) {
    const int32_t e = r.expert[i];
    if (r.load[e] >= rule.capacity) {
      r.kept[i] = 0, r.gate[i] = 0.0f;
      continue;
    }
    r.kept[i] = 1;
    ++r.load[e];
  }
  // Permutation: rows grouped by expert, token order inside a group.
  r.offsets[0] = 0;
  for (int64_t e = 0; e < E; ++e) r.offsets[e + 1] = r.offsets[e] + r.load[e];
  std::vector<int64_t> fill(r.offsets, r.offsets + E);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t j = 0; j < k; ++j) {
      const int64_t slot = n * k + j;
      if (!r.kept[slot]) {
        r.slot_row[slot] = -1;
        continue;
      }
      const int32_t e = r.expert[slot];
      r.row_token[fill[e]] = n;
      r.row_slot[fill[e]] = int32_t(j);
      r.slot_row[slot] = int32_t(fill[e]);
      ++fill[e];
    }
}

}  // namespace fp8moe::cpu
