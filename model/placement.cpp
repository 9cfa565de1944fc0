#include "model/placement.h"

#include "kernels/check.h"

namespace fp8moe {

std::pair<int, int> stage_layers(int n_layers, int stage, int stages) {
  auto first = [&](int s) { return int((int64_t(s) * n_layers + stages - 1) / stages); };
  return {first(stage), first(stage + 1)};
}

RowRange replica_rows(int64_t rows, int replica, int replicas) {
  return {rows * replica / replicas, rows * (replica + 1) / replicas};
}

Placement::Placement(const ModelConfig& m, const GridPosition& at)
    : at_(at), n_layers_(m.n_layers), experts_{m.moe.n_experts, at.experts}, local_(m) {
  FP8MOE_ASSERT(at.stages <= m.n_layers, m.n_layers, " blocks over ", at.stages, " pipeline stages");
  FP8MOE_ASSERT(m.moe.n_experts % at.experts == 0, m.moe.n_experts, " experts over ", at.experts,
                " expert-parallel ranks");
  std::tie(layer_begin_, layer_end_) = stage_layers(m.n_layers, at.stage, at.stages);
  const int t = at.tensor;
  // (MLA's latents are replicated: its ranks are not split.)
  FP8MOE_ASSERT(m.n_heads % t == 0 && (m.mla() || m.n_kv_heads % t == 0) && m.d_ff_dense % t == 0 &&
                    m.moe.d_expert % t == 0 && m.vocab_size % t == 0,
                "the model's heads, widths and vocabulary over ", t, " tensor-parallel ranks");
  local_.n_heads /= t, local_.n_kv_heads = m.mla() ? m.n_kv_heads : m.n_kv_heads / t;
  local_.d_ff_dense /= t, local_.moe.d_expert /= t;
  local_.vocab_size /= t;
}

Shard Placement::shard(const ParamSpec& p) const {
  if (p.expert >= 0 && (p.expert < first_expert() || p.expert >= first_expert() + local_experts())) return {};
  const bool on_stage = p.layer < 0            ? first_stage()
                        : p.layer >= n_layers_ ? last_stage()
                                               : p.layer >= layer_begin_ && p.layer < layer_end_;
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
