// Placement (model/placement.h): over every position of a grid, the blocks the ranks hold tile
// each parameter exactly once, with what each axis owns checked against the layout the README
// states (stages split blocks earlier-heavy, experts in consecutive runs, tp slices in rank order).
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <numeric>
#include <vector>

#include "model/placement.h"

namespace fp8moe {
namespace {

ModelConfig model() {  // 5 blocks (uneven over 2 or 3 stages), 8 experts, widths divisible by 4
  ModelConfig m;
  m.vocab_size = 64, m.d_model = 16, m.n_layers = 5, m.n_heads = 4, m.n_kv_heads = 4, m.head_dim = 4;
  m.first_dense_layers = 1, m.d_ff_dense = 32;
  m.moe.n_experts = 8, m.moe.top_k = 2, m.moe.n_shared_experts = 1, m.moe.d_expert = 8;
  return m;
}

TEST(Placement, StageBlocksAreContiguousAndTheEarlierStagesTakeTheRemainder) {
  EXPECT_EQ(stage_layers(5, 0, 2), (std::pair<int, int>{0, 3}));
  EXPECT_EQ(stage_layers(5, 1, 2), (std::pair<int, int>{3, 5}));
  EXPECT_EQ(stage_layers(5, 0, 3), (std::pair<int, int>{0, 2}));
  EXPECT_EQ(stage_layers(5, 1, 3), (std::pair<int, int>{2, 4}));
  EXPECT_EQ(stage_layers(5, 2, 3), (std::pair<int, int>{4, 5}));
  EXPECT_EQ(stage_layers(61, 15, 16), (std::pair<int, int>{58, 61}));  // DeepSeek-V3's 61 over 16
}

// parallel.stage_layers: even is the rule above, given is taken as it is, and a Placement with a
// split holds the blocks it says.
TEST(Placement, StageSplitEvenGivenAndTheBlocksAStageHolds) {
  const ModelConfig m = model();
  EXPECT_EQ(stage_split(m, {}, 2, 16), (std::vector<int>{3, 2}));
  EXPECT_EQ(stage_split(m, {}, 3, 16), (std::vector<int>{2, 2, 1}));
  EXPECT_EQ(stage_split(m, {StageSplit::given, {1, 1, 3}}, 3, 16), (std::vector<int>{1, 1, 3}));
  EXPECT_EQ(stage_split(m, {StageSplit::given, {1, 1, 3}}, 1, 16), (std::vector<int>{5}));  // a one-rank tool
  const int begin[] = {0, 1, 2}, end[] = {1, 2, 5};
  for (int s = 0; s < 3; ++s) {
    const Placement pl(m, {.stage = s, .stages = 3, .split = {1, 1, 3}});
    EXPECT_EQ(pl.layer_begin(), begin[s]);
    EXPECT_EQ(pl.layer_end(), end[s]);
    EXPECT_EQ(pl.first_stage(), s == 0);
    EXPECT_EQ(pl.last_stage(), s == 2);
  }
}

// The forward FLOPs per token of a block and of the last stage's extra work, written out for a
// GQA model from its shapes (integers: every sum below is exact in a double).
int64_t gqa_block_flops(const ModelConfig& m, int l, int64_t T) {
  const int64_t D = m.d_model, q = int64_t(m.n_heads) * m.head_dim, kv = int64_t(m.n_kv_heads) * m.head_dim;
  int64_t f = 2 * (D * q + 2 * D * kv + q * D);                                // wq, wk, wv, wo
  f += int64_t(m.n_heads) * 2 * m.head_dim * T;                                // QK^T and PV, causal
  if (l < m.first_dense_layers) return f + 2 * 3 * D * m.d_ff_dense;           // w1, w3, w2
  const int64_t E = m.moe.n_experts, k = m.moe.top_k, F = m.moe.d_expert;
  return f + 2 * E * D + 2 * 3 * D * F * m.moe.n_shared_experts + 2 * 3 * D * F * k;  // router, shared, routed top k
}

// balanced: against every composition of the blocks into the stages, by the costs above: the split
// whose most expensive stage costs least, and among those the one with the most blocks earliest
// (the lexicographically greatest counts).
TEST(Placement, BalancedSplitIsTheBestOfEveryComposition) {
  int empty_lasts = 0;
  for (const int64_t T : {int64_t(16), int64_t(4096)})
  for (const int depth : {0, 1})
  for (const int64_t V : {int64_t(64), int64_t(4096)}) {
    ModelConfig m = model();
    m.n_layers = 7, m.mtp_depth = depth, m.vocab_size = int(V);
    std::vector<int64_t> block;
    for (int l = 0; l < m.n_layers; ++l) block.push_back(gqa_block_flops(m, l, T));
    // The last stage: the head for the model and each module, and each module's eh_proj and block
    // (an MoE block).
    const int64_t last = 2 * V * m.d_model * (1 + depth) +
                         depth * (2 * 2 * int64_t(m.d_model) * m.d_model + gqa_block_flops(m, m.n_layers, T));
    const LayerCosts c = layer_costs(m, T);
    for (int l = 0; l < m.n_layers; ++l) ASSERT_EQ(c.block[size_t(l)], double(block[size_t(l)])) << "block " << l;
    ASSERT_EQ(c.last, double(last));
    for (int P = 2; P <= 5; ++P) {
      SCOPED_TRACE("T " + std::to_string(T) + " mtp " + std::to_string(depth) + " V " + std::to_string(V) + " P " +
                   std::to_string(P));
      // The best of every composition of n_layers into P parts >= 1 (lexicographically decreasing:
      // the first best has the most blocks on the earlier stages), and of those into P - 1 parts
      // >= 1 and a last stage of none; the latter where strictly better.
      std::vector<int> best[2], counts(static_cast<size_t>(P), 1);
      int64_t best_cost[2] = {-1, -1};
      std::function<void(int, int, int)> visit = [&](int p, int left, int empty) {
        if (p == P - 1) {
          counts[size_t(p)] = left;
          int64_t worst = 0;
          for (int s = 0, l = 0; s < P; ++s) {
            int64_t stage = s == P - 1 ? last : 0;
            for (int i = 0; i < counts[size_t(s)]; ++i) stage += block[size_t(l++)];
            worst = std::max(worst, stage);
          }
          if (best_cost[empty] < 0 || worst < best_cost[empty]) best_cost[empty] = worst, best[empty] = counts;
          return;
        }
        const int keep = P - 1 - p - empty;  // blocks the later stages need
        for (int n = left - keep; n >= 1; --n) {
          if (empty && p == P - 2 && n != left) continue;  // the last stage takes none
          counts[size_t(p)] = n, visit(p + 1, left - n, empty);
        }
      };
      visit(0, m.n_layers, 0);
      visit(0, m.n_layers, 1);
      ASSERT_EQ(best[1].back(), 0);
      const bool empty_last = best_cost[1] < best_cost[0];
      empty_lasts += empty_last;
      EXPECT_EQ(stage_split(m, {StageSplit::balanced, {}}, P, T), best[empty_last ? 1 : 0]);
    }
  }
  // Some of the cases above (a large vocabulary's head on few stages) are best with a last stage
  // of the head alone, and some are not.
  EXPECT_GT(empty_lasts, 0);
  EXPECT_LT(empty_lasts, 2 * 2 * 2 * 4);
}

// DualPipeV's balanced split (stage_split with v_shape) balances ranks, chunk r with chunk
// 2P - 1 - r (the last with the head and the modules): its most expensive rank costs what the best
// of every composition of the blocks into 2P chunks (each >= 1, the last >= 0) costs, by the
// block FLOPs written out above; the last chunk is empty only where that is strictly cheaper.
TEST(Placement, DualPipeVBalancedSplitIsTheBestOfEveryComposition) {
  int empty_lasts = 0, cases = 0;
  for (const int64_t V : {int64_t(64), int64_t(4096)})
    for (const int depth : {0, 1})
      for (const int L : {6, 9}) {
        ModelConfig m = model();
        m.n_layers = L, m.mtp_depth = depth, m.vocab_size = int(V);
        const int64_t T = 16;
        std::vector<int64_t> block;
        for (int l = 0; l < L; ++l) block.push_back(gqa_block_flops(m, l, T));
        const int64_t last = 2 * V * m.d_model * (1 + depth) +
                             depth * (2 * 2 * int64_t(m.d_model) * m.d_model + gqa_block_flops(m, L, T));
        for (int P = 2; 2 * P <= L; ++P) {
          SCOPED_TRACE("V " + std::to_string(V) + " mtp " + std::to_string(depth) + " L " + std::to_string(L) +
                       " P " + std::to_string(P));
          auto worst_rank = [&](const std::vector<int>& counts) {
            std::vector<int64_t> rank(size_t(P), 0);
            for (int c = 0, l = 0; c < 2 * P; ++c)
              for (int i = 0; i < counts[size_t(c)]; ++i) rank[size_t(c < P ? c : 2 * P - 1 - c)] += block[size_t(l++)];
            rank[0] += last;
            return *std::max_element(rank.begin(), rank.end());
          };
          int64_t best[2] = {-1, -1};  // [last chunk empty]
          std::vector<int> counts(size_t(2 * P), 0);
          std::function<void(int, int)> visit = [&](int c, int left) {
            if (c == 2 * P - 1) {
              counts[size_t(c)] = left;
              const int64_t w = worst_rank(counts);
              int64_t& b = best[left == 0 ? 1 : 0];
              if (b < 0 || w < b) b = w;
              return;
            }
            for (int n = 1; n <= left - (2 * P - 2 - c); ++n) counts[size_t(c)] = n, visit(c + 1, left - n);
          };
          visit(0, L);
          const std::vector<int> got = stage_split(m, {StageSplit::balanced, {}}, 2 * P, T, true);
          ASSERT_EQ(got.size(), size_t(2 * P));
          EXPECT_EQ(std::accumulate(got.begin(), got.end(), 0), L);
          for (int c = 0; c + 1 < 2 * P; ++c) EXPECT_GE(got[size_t(c)], 1) << "chunk " << c;
          const bool empty_last = best[1] >= 0 && best[1] < best[0];
          EXPECT_EQ(worst_rank(got), empty_last ? best[1] : best[0]);
          EXPECT_EQ(got.back() == 0, empty_last);
          empty_lasts += empty_last, ++cases;
        }
      }
  EXPECT_GT(empty_lasts, 0);
  EXPECT_LT(empty_lasts, cases);
}

// A last stage of the head alone (parallel.stage_layers [.., 0]): it holds the final norm, the
// head and the multi-token prediction module's parameters and no block; the stage before it ends
// at n_layers and holds none of them.
TEST(Placement, ALastStageOfTheHeadAlone) {
  ModelConfig m = model();
  m.mtp_depth = 1;
  const ParamTable table = build_param_table(m);
  const std::vector<int> split = {2, m.n_layers - 2, 0};
  for (int s = 0; s < 3; ++s) {
    const Placement pl(m, {.stage = s, .stages = 3, .split = split});
    EXPECT_EQ(pl.first_stage(), s == 0);
    EXPECT_EQ(pl.last_stage(), s == 2);
    EXPECT_EQ(pl.layer_end() - pl.layer_begin(), split[size_t(s)]);
    for (const ParamSpec& p : table.params) {
      const bool head = p.layer >= m.n_layers, embed = p.layer < 0;
      const bool block = !head && !embed && p.layer >= pl.layer_begin() && p.layer < pl.layer_end();
      EXPECT_EQ(pl.shard(p).held(), (head && s == 2) || (embed && s == 0) || block) << p.name << " on stage " << s;
    }
  }
}

// parallel.mtp_own_stage (GridPosition::mtp_alone): the modules alone on the last chunk (no block),
// the main head on the chunk of the last block. The head stage holds the final norm and the head;
// the last stage the modules and a tied copy of the head (not the final norm). Under 1F1B the
// stages P - 2 and P - 1; under DualPipeV rank 1's back chunk and rank 0's.
TEST(Placement, TheModulesAloneOnTheLastChunkTheHeadBeforeIt) {
  ModelConfig m = model();
  m.mtp_depth = 1;
  const ParamTable table = build_param_table(m);
  struct Case {
    bool v;
    int stages;
    std::vector<int> split;
    int head, last;  // the ranks
  };
  for (const Case& k : {Case{false, 3, {2, m.n_layers - 2, 0}, 1, 2}, Case{true, 2, {1, 1, m.n_layers - 2, 0}, 1, 0}}) {
    for (int s = 0; s < k.stages; ++s) {
      const Placement pl(m, {.stage = s, .stages = k.stages, .split = k.split, .v_shape = k.v, .mtp_alone = true});
      SCOPED_TRACE((k.v ? "dualpipev rank " : "1f1b stage ") + std::to_string(s));
      EXPECT_EQ(pl.head_rank(), k.head);
      EXPECT_EQ(pl.last_rank(), k.last);
      EXPECT_EQ(pl.head_stage(), s == k.head);
      EXPECT_EQ(pl.last_stage(), s == k.last);
      EXPECT_EQ(pl.in_head_tie(), s == k.head || s == k.last);
      const int back = pl.chunks() - 1;
      EXPECT_EQ(pl.chunk_head(back), s == k.head);
      EXPECT_FALSE(pl.chunk_head(back) && pl.chunk_last(back));
      if (s == k.head) EXPECT_EQ(pl.layer_end(back), m.n_layers);  // the last block's chunk
      for (const ParamSpec& p : table.params) {
        const bool head = p.name == "head.weight", norm = p.name == "final_norm.weight";
        const bool module = p.layer >= m.n_layers && !head && !norm;
        if (head) EXPECT_EQ(pl.shard(p).held(), s == k.head || s == k.last);
        if (head) EXPECT_EQ(pl.holds_tied_copy(p), s == k.last);
        if (norm) EXPECT_EQ(pl.shard(p).held(), s == k.head);
        if (module) EXPECT_EQ(pl.shard(p).held(), s == k.last) << p.name;
        if (!head) EXPECT_FALSE(pl.holds_tied_copy(p)) << p.name;
      }
    }
  }
  // Without it the last chunk runs the head too, and nothing is a copy.
  const Placement one(m, {.stage = 2, .stages = 3, .split = {2, m.n_layers - 2, 0}});
  EXPECT_TRUE(one.chunk_head(0) && one.chunk_last(0));
  for (const ParamSpec& p : table.params) EXPECT_FALSE(one.holds_tied_copy(p)) << p.name;
}

// The balanced split with the modules alone: the last stage (chunk) holds no block and carries the
// modules' cost only, the stage before it (DualPipeV: rank 1) the main head's; the split's most
// expensive stage (rank) costs what the best of every composition with an empty last part costs.
TEST(Placement, BalancedSplitWithTheModulesAlone) {
  ModelConfig m = model();
  m.n_layers = 7, m.mtp_depth = 1, m.vocab_size = 4096;
  const int64_t T = 16;
  const LayerCosts c = layer_costs(m, T);
  EXPECT_EQ(c.head, 2.0 * m.vocab_size * m.d_model);
  const double mods = c.last - c.head;
  for (const bool v : {false, true})
    for (int P = 2; P <= (v ? 3 : 5); ++P) {
      SCOPED_TRACE(std::string(v ? "dualpipev" : "1f1b") + " P " + std::to_string(P));
      const int parts = v ? 2 * P : P;
      auto worst = [&](const std::vector<int>& counts) {
        std::vector<double> rank(size_t(P), 0);
        for (int q = 0, l = 0; q < parts; ++q) {
          const size_t r = size_t(v ? (q < P ? q : 2 * P - 1 - q) : q);
          for (int i = 0; i < counts[size_t(q)]; ++i) rank[r] += c.block[size_t(l++)];
        }
        rank[size_t(v ? 0 : P - 1)] += mods, rank[size_t(v ? 1 : P - 2)] += c.head;
        return *std::max_element(rank.begin(), rank.end());
      };
      double best = -1;
      std::vector<int> counts(size_t(parts), 0);
      std::function<void(int, int)> visit = [&](int q, int left) {
        if (q == parts - 1) {
          if (left != 0) return;
          counts[size_t(q)] = 0;
          const double w = worst(counts);
          if (best < 0 || w < best) best = w;
          return;
        }
        for (int n = 1; n <= left - (parts - 2 - q); ++n) counts[size_t(q)] = n, visit(q + 1, left - n);
      };
      visit(0, m.n_layers);
      const std::vector<int> got = stage_split(m, {StageSplit::balanced, {}}, parts, T, v, true);
      ASSERT_EQ(got.size(), size_t(parts));
      EXPECT_EQ(got.back(), 0);
      EXPECT_EQ(std::accumulate(got.begin(), got.end(), 0), m.n_layers);
      EXPECT_EQ(worst(got), best);
    }
}

TEST(Placement, ExpertsAreConsecutiveRunsOfEOverPAndTheOwnerAgrees) {
  const ModelConfig m = model();
  for (int P : {1, 2, 4, 8})
    for (int r = 0; r < P; ++r) {
      const Placement pl(m, GridPosition{.expert_rank = r, .experts = P, .split = {}});
      EXPECT_EQ(pl.local_experts(), 8 / P);
      EXPECT_EQ(pl.first_expert(), r * (8 / P));
      for (int e = 0; e < 8; ++e)
        EXPECT_EQ(pl.expert_owner(e) == r, e >= pl.first_expert() && e < pl.first_expert() + pl.local_experts())
            << "expert " << e << " on rank " << r << " of " << P;
    }
}

TEST(Placement, EveryElementOfEveryParameterIsHeldOnceOverTheGrid) {
  const ModelConfig m = model();
  const ParamTable table = build_param_table(m);
  for (int tp : {1, 2, 4})
    for (int pp : {1, 2, 3})
      for (int ep : {1, 2, 4}) {
        std::vector<std::vector<int>> held;
        for (const ParamSpec& p : table.params) held.emplace_back(size_t(p.numel()), 0);
        for (int t = 0; t < tp; ++t)
          for (int s = 0; s < pp; ++s)
            for (int e = 0; e < ep; ++e) {
              const Placement pl(m, {.tensor_rank = t, .tensor = tp, .stage = s, .stages = pp, .expert_rank = e, .experts = ep, .split = {}});
              for (size_t i = 0; i < table.params.size(); ++i) {
                const ParamSpec& p = table.params[i];
                const Shard sh = pl.shard(p);
                if (!sh.held()) continue;
                // The stage holding the block, and the tensor-parallel slice in rank order.
                const auto [l0, l1] = stage_layers(m.n_layers, s, pp);
                const int layer = p.layer < 0 ? 0 : p.layer >= m.n_layers ? m.n_layers - 1 : p.layer;
                EXPECT_TRUE(layer >= l0 && layer < l1) << p.name;
                if (p.tp == TpSplit::rows) {
                  EXPECT_EQ(sh.r0, t * p.rows / tp) << p.name;
                } else if (p.tp == TpSplit::cols) {
                  EXPECT_EQ(sh.c0, t * p.cols / tp) << p.name;
                } else {
                  EXPECT_EQ(sh.numel(), p.numel()) << p.name;
                }
                // Replicas hold the same block: a non-expert parameter on every expert rank (they
                // are data replicas), an unsplit one on every tensor rank. Count rank 0's.
                if ((p.expert < 0 && e != 0) || (p.tp == TpSplit::none && t != 0)) continue;
                for (int64_t r = sh.r0; r < sh.r0 + sh.rows; ++r)
                  for (int64_t c = sh.c0; c < sh.c0 + sh.cols; ++c) ++held[i][size_t(r * p.cols + c)];
              }
            }
        for (size_t i = 0; i < table.params.size(); ++i)
          for (size_t k = 0; k < held[i].size(); ++k)
            ASSERT_EQ(held[i][k], 1) << table.params[i].name << " element " << k << " at tp " << tp << " pp " << pp
                                     << " ep " << ep;
      }
}

// DualPipeV (GridPosition::v_shape): 2P chunks, rank s holding chunk s and chunk 2P - 1 - s, so
// that rank 0 holds the embedding, the first chunk, the last chunk and the head, and every block is
// held by exactly one rank. 9 blocks over 2 x 2 chunks (even: 3, 2, 2, 2) and given [1, 3, 3, 2].
TEST(Placement, DualPipeVRanksHoldTheVsTwoChunks) {
  ModelConfig m = model();
  m.n_layers = 9;
  const ParamTable table = build_param_table(m);
  struct Case {
    std::vector<int> split;
    std::vector<std::pair<int, int>> rank0, rank1;  // chunk 0, chunk 1 of each rank
  };
  for (const Case& c : {Case{{}, {{0, 3}, {7, 9}}, {{3, 5}, {5, 7}}}, Case{{1, 3, 3, 2}, {{0, 1}, {7, 9}}, {{1, 4}, {4, 7}}}}) {
    std::vector<int> holders(size_t(m.n_layers), 0);
    for (int s = 0; s < 2; ++s) {
      const Placement pl(m, {.tensor_rank = 0, .tensor = 1, .stage = s, .stages = 2, .expert_rank = 0, .experts = 1,
                             .split = c.split, .v_shape = true});
      const auto& want = s == 0 ? c.rank0 : c.rank1;
      ASSERT_EQ(pl.chunks(), 2);
      for (int k = 0; k < 2; ++k) {
        EXPECT_EQ((std::pair<int, int>{pl.layer_begin(k), pl.layer_end(k)}), want[size_t(k)]) << "rank " << s << " chunk " << k;
        EXPECT_EQ(pl.chunk_first(k), s == 0 && k == 0);
        EXPECT_EQ(pl.chunk_last(k), s == 0 && k == 1);
      }
      EXPECT_EQ(pl.first_stage(), s == 0);
      EXPECT_EQ(pl.last_stage(), s == 0);
      for (const ParamSpec& p : table.params) {
        const bool held = pl.shard(p).held();
        if (p.layer < 0 || p.layer >= m.n_layers) {
          EXPECT_EQ(held, s == 0) << p.name << " on rank " << s;  // the embedding, the final norm, the head
        } else if (held && p.name == block_prefix(m, p.layer) + "attn_norm.weight") {
          ++holders[size_t(p.layer)];
        }
      }
    }
    for (int l = 0; l < m.n_layers; ++l) EXPECT_EQ(holders[size_t(l)], 1) << "block " << l;
  }
}

TEST(Placement, LocalWidthsAreTheTensorParallelShares) {
  const Placement pl(model(), {.tensor_rank = 3, .tensor = 4, .stage = 0, .stages = 1, .expert_rank = 0, .experts = 1, .split = {}});
  EXPECT_EQ(pl.local().n_heads, 1);
  EXPECT_EQ(pl.local().n_kv_heads, 1);
  EXPECT_EQ(pl.local().d_ff_dense, 8);
  EXPECT_EQ(pl.local().moe.d_expert, 2);
  EXPECT_EQ(pl.local().vocab_size, 16);
  EXPECT_EQ(pl.vocab_first(), 48);
  EXPECT_EQ(pl.local().d_model, 16);  // the residual stream is not split
}

TEST(Placement, ReplicaRowsCoverEveryRowOnceInOrder) {
  for (int64_t rows : {1, 7, 64, 129})
    for (int R : {1, 2, 3, 8}) {
      int64_t next = 0;
      for (int r = 0; r < R; ++r) {
        const RowRange rr = replica_rows(rows, r, R);
        EXPECT_EQ(rr.begin, next);
        EXPECT_LE(rr.end - rr.begin, rows / R + 1);
        next = rr.end;
      }
      EXPECT_EQ(next, rows);
    }
}

}  // namespace
}  // namespace fp8moe
