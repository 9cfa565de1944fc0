#include "model/placement.h"

#include <algorithm>
#include <numeric>

#include "kernels/check.h"

namespace fp8moe {

std::pair<int, int> stage_layers(int n_layers, int stage, int stages) {
  auto first = [&](int s) { return int((int64_t(s) * n_layers + stages - 1) / stages); };
  return {first(stage), first(stage + 1)};
}

LayerCosts layer_costs(const ModelConfig& m, int64_t T) {
  LayerCosts c;
  c.block.assign(size_t(m.n_layers), 0.0);
  const double routed = double(m.moe.top_k) / double(std::max(1, m.moe.n_experts));
  for (const ParamSpec& p : build_param_table(m).params) {
    if (p.cols == 1 || p.rows == 1 || !p.trainable || p.name == "embed.weight") continue;  // norms, lookups
    const double fwd = 2 * double(p.numel()) * (p.expert >= 0 ? routed : 1.0) * (p.name == "head.weight" ? 1 + m.mtp_depth : 1);
    (p.layer >= 0 && p.layer < m.n_layers ? c.block[size_t(p.layer)] : c.last) += fwd;
    if (p.name == "head.weight") c.head += 2 * double(p.numel());
  }
  const double core = double(m.n_heads) * double(m.qk_head_dim() + m.v_dim()) * double(T);
  for (double& b : c.block) b += core;
  c.last += core * m.mtp_depth;
  return c;
}

namespace {

// DualPipeV's balanced split of L blocks into 2P chunks: rank r runs chunk r (the front: blocks
// [f_r, f_r+1) from the start) and chunk 2P - 1 - r (the back: [g_r+1, g_r) from the end), the two
// ways meeting on rank P - 1 (f_P = g_P); every chunk holds a block but rank 0's back chunk, which
// also runs the head and the modules (costs.last) and holds none only where that makes the most
// expensive rank strictly cheaper. best(r, f, g): the least cost of the most expensive of ranks
// r.. when they hold blocks [f, g). Then each rank in turn takes the most front blocks, then the
// fewest back blocks, that leave the rest a split within that cost.
std::vector<int> v_split(const LayerCosts& c, int L, int P, bool mtp_alone) {
  constexpr double kInf = 1e300;
  std::vector<double> prefix(size_t(L) + 1, 0.0);
  for (int l = 0; l < L; ++l) prefix[size_t(l + 1)] = prefix[size_t(l)] + c.block[size_t(l)];
  auto cost = [&](int a, int b) { return prefix[size_t(b)] - prefix[size_t(a)]; };
  const size_t W = size_t(L) + 1;
  // What rank 0 (the last chunk) and rank 1 carry besides their blocks: with mtp_alone the main
  // head goes with the last block, on rank 1's back chunk.
  const double rank0 = mtp_alone ? c.last - c.head : c.last, rank1 = mtp_alone ? c.head : 0;
  auto solve = [&](int last_least, std::vector<int>* counts) {
    std::vector<double> best(size_t(P + 1) * W * W, kInf);
    auto at = [&](int r, int f, int g) -> double& { return best[(size_t(r) * W + size_t(f)) * W + size_t(g)]; };
    for (int x = 0; x <= L; ++x) at(P, x, x) = 0;
    // The pairs (f2, g2) rank r may leave to the next: its front [f, f2) and back [g2, g).
    auto for_pairs = [&](int r, int f, int g, const auto& fn) {
      const int least = r == 0 ? last_least : 1;
      for (int f2 = f + 1; f2 <= g - least; ++f2)
        for (int g2 = f2; g2 <= g - least; ++g2) {
          if (r == P - 1 && g2 != f2) break;  // the ways meet on the last rank
          if (r == 0 && mtp_alone && g2 != g) continue;  // the last chunk holds the modules alone
          if (!fn(f2, g2, cost(f, f2) + cost(g2, g) + (r == 0 ? rank0 : r == 1 ? rank1 : 0))) return;
        }
    };
    for (int r = P - 1; r >= 0; --r)
      for (int f = 0; f <= L; ++f)
        for (int g = f; g <= L; ++g) {
          if (r == 0 && (f != 0 || g != L)) continue;
          double v = kInf;
          for_pairs(r, f, g, [&](int f2, int g2, double here) {
            v = std::min(v, std::max(here, at(r + 1, f2, g2)));
            return true;
          });
          at(r, f, g) = v;
        }
    const double worst = at(0, 0, L);
    if (worst >= kInf) return worst;
    counts->assign(size_t(2 * P), 0);
    for (int r = 0, f = 0, g = L; r < P; ++r) {
      int pick_f = -1, pick_g = -1;
      for_pairs(r, f, g, [&](int f2, int g2, double here) {
        if (here <= worst && at(r + 1, f2, g2) <= worst && (f2 > pick_f || (f2 == pick_f && g2 > pick_g)))
          pick_f = f2, pick_g = g2;
        return true;
      });
      FP8MOE_ASSERT(pick_f >= 0, "DualPipeV's balanced split lost its way at rank ", r);
      (*counts)[size_t(r)] = pick_f - f, (*counts)[size_t(2 * P - 1 - r)] = g - pick_g;
      f = pick_f, g = pick_g;
    }
    return worst;
  };
  std::vector<int> with_blocks, empty_last;
  const double b = solve(0, &empty_last);
  if (mtp_alone) return empty_last;
  const double a = solve(1, &with_blocks);
  return b < a ? empty_last : with_blocks;
}

}  // namespace

std::vector<int> stage_split(const ModelConfig& m, const StageLayers& s, int stages, int64_t T, bool v_shape,
                             bool mtp_alone) {
  const int L = m.n_layers, P = stages;
  FP8MOE_ASSERT(P >= 1 && P <= L, L, " blocks over ", P, " pipeline stages");
  std::vector<int> counts(static_cast<size_t>(P));
  if (P == 1) return {L};  // (a one-rank tool of a pipelined config: generate, export)
  if (s.split == StageSplit::given) {
    FP8MOE_ASSERT(int(s.given.size()) == P, "parallel.stage_layers gives ", s.given.size(), " stages, not ", P);
    return s.given;
  }
  if (s.split == StageSplit::even) {
    for (int p = 0; p < P; ++p) {
      const auto [b, e] = stage_layers(L, p, P);
      counts[size_t(p)] = e - b;
    }
    return counts;
  }
  if (v_shape) {
    FP8MOE_ASSERT(P % 2 == 0, "DualPipeV's ", P, " chunks");
    return v_split(layer_costs(m, T), L, P / 2, mtp_alone);
  }
  // Balanced. cost(p, l, e): stage p holding blocks [l, e) (the last stage carries costs.last).
  // The last stage may hold no block (the head and the modules only) where that makes the most
  // expensive stage strictly cheaper; every other stage holds at least one.
  const LayerCosts c = layer_costs(m, T);
  std::vector<double> prefix(size_t(L) + 1, 0.0);
  for (int l = 0; l < L; ++l) prefix[size_t(l + 1)] = prefix[size_t(l)] + c.block[size_t(l)];
  // mtp_alone: the last stage holds no block and carries the modules alone: the blocks go over the
  // stages before it, of which the last carries the main head.
  const int Pb = mtp_alone ? P - 1 : P;
  const double tail = mtp_alone ? c.head : c.last;
  auto cost = [&](int p, int l, int e) { return prefix[size_t(e)] - prefix[size_t(l)] + (p == Pb - 1 ? tail : 0); };
  constexpr double kInf = 1e300;
  // best[p][l]: the least cost of the most expensive stage when stages 0..p hold blocks [0, l).
  auto split = [&](int parts, bool empty_last, std::vector<int>* counts) {
    auto least = [&](int p) { return p == parts - 1 && empty_last ? 0 : 1; };  // a stage's fewest blocks
    std::vector<std::vector<double>> best(size_t(parts), std::vector<double>(size_t(L) + 1, kInf));
    for (int l = 1; l <= L; ++l) best[0][size_t(l)] = cost(0, 0, l);
    for (int p = 1; p < parts; ++p)
      for (int l = p; l <= L; ++l)
        for (int j = p; j <= l - least(p); ++j)
          best[size_t(p)][size_t(l)] = std::min(best[size_t(p)][size_t(l)], std::max(best[size_t(p - 1)][size_t(j)], cost(p, j, l)));
    const double worst = best[size_t(parts - 1)][size_t(L)];
    // fits[p][l]: stages p.. can hold blocks [l, L), each at least its fewest, none costing more
    // than worst. Then each stage in turn takes the most blocks that leave the rest a split that fits.
    std::vector<std::vector<char>> fits(size_t(parts) + 1, std::vector<char>(size_t(L) + 1, 0));
    fits[size_t(parts)][size_t(L)] = 1;
    for (int p = parts - 1; p >= 0; --p)
      for (int l = 0; l <= L; ++l)
        for (int e = l + least(p); e <= L && !fits[size_t(p)][size_t(l)]; ++e)
          fits[size_t(p)][size_t(l)] = fits[size_t(p + 1)][size_t(e)] && cost(p, l, e) <= worst;
    for (int p = 0, l = 0; p < parts; ++p) {
      int e = L;
      while (!(fits[size_t(p + 1)][size_t(e)] && cost(p, l, e) <= worst)) --e;
      (*counts)[size_t(p)] = e - l, l = e;
    }
    return worst;
  };
  std::vector<int> empty_last(static_cast<size_t>(P));
  if (mtp_alone) {
    split(Pb, false, &empty_last);
    empty_last.back() = 0;
    return empty_last;
  }
  const double with_blocks = split(P, false, &counts), without = split(P, true, &empty_last);
  return without < with_blocks ? empty_last : counts;
}

RowRange replica_rows(int64_t rows, int replica, int replicas) {
  return {rows * replica / replicas, rows * (replica + 1) / replicas};
}

Placement::Placement(const ModelConfig& m, const GridPosition& at)
    : at_(at), n_layers_(m.n_layers), experts_{m.moe.n_experts, at.experts}, local_(m) {
  FP8MOE_ASSERT(m.moe.n_experts % at.experts == 0, m.moe.n_experts, " experts over ", at.experts,
                " expert-parallel ranks");
  const int parts = at.chunks();
  FP8MOE_ASSERT(parts <= m.n_layers, m.n_layers, " blocks over ", parts, " pipeline chunks");
  std::vector<int> split = at.split;
  if (split.empty()) {
    for (int c = 0; c < parts; ++c) {
      const auto [b, e] = stage_layers(m.n_layers, c, parts);
      split.push_back(e - b);
    }
  } else {
    FP8MOE_ASSERT(int(split.size()) == parts, split.size(), " block counts for ", parts, " pipeline chunks");
    FP8MOE_ASSERT(std::accumulate(split.begin(), split.end(), 0) == m.n_layers &&
                      *std::min_element(split.begin(), split.end() - 1) >= 1 && split.back() >= 0,
                  "the stages' block counts must be at least 1 each (the last stage's at least 0) and add up to ",
                  m.n_layers);
  }
  auto range = [&](int c) {
    const int b = std::accumulate(split.begin(), split.begin() + c, 0);
    return std::pair<int, int>{b, b + split[size_t(c)]};
  };
  ranges_.push_back(range(at.stage));
  if (at.v_shape) ranges_.push_back(range(2 * at.stages - 1 - at.stage));
  const int t = at.tensor;
  // (MLA's latents are replicated: its ranks are not split.)
  FP8MOE_ASSERT(m.n_heads % t == 0 && (m.mla() || m.n_kv_heads % t == 0) && m.d_ff_dense % t == 0 &&
                    m.moe.d_expert % t == 0 && m.vocab_size % t == 0,
                "the model's heads, widths and vocabulary over ", t, " tensor-parallel ranks");
  local_.n_heads /= t, local_.n_kv_heads = m.mla() ? m.n_kv_heads : m.n_kv_heads / t;
  local_.d_ff_dense /= t, local_.moe.d_expert /= t;
  local_.vocab_size /= t;
}

bool Placement::holds_layer(int layer) const {
  for (const auto& [b, e] : ranges_)
    if (layer >= b && layer < e) return true;
  return false;
}

Shard Placement::shard(const ParamSpec& p) const {
  if (p.expert >= 0 && (p.expert < first_expert() || p.expert >= first_expert() + local_experts())) return {};
  // (The modules' parameters count their layers on from n_layers too.)
  const bool head = p.name == "final_norm.weight" || p.name == "head.weight";
  const bool on_stage = p.layer < 0            ? first_stage()
                        : p.layer < n_layers_  ? holds_layer(p.layer)
                        : head                 ? head_stage() || holds_tied_copy(p)
                                               : last_stage();
  if (!on_stage) return {};
  Shard s{0, p.rows, 0, p.cols};
  const int t = at_.tensor;
  if (p.tp == TpSplit::rows) {
    FP8MOE_ASSERT(p.rows % t == 0, p.name, ": ", p.rows, " rows over ", t, " tensor-parallel ranks");
    s.rows = p.rows / t, s.r0 = s.rows * at_.tensor_rank;
  } else if (p.tp == TpSplit::cols) {
    FP8MOE_ASSERT(p.cols % t == 0, p.name, ": ", p.cols, " columns over ", t, " tensor-parallel ranks");
    s.cols = p.cols / t, s.c0 = s.cols * at_.tensor_rank;
  }
  return s;
}

}  // namespace fp8moe
