#include "app/comm_accounting.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

namespace fp8moe {
namespace {
constexpr const char* kGroupNames[5] = {"tp", "ep", "dp", "edp", "pp"};  // the order of counted_
}

CommAccounting::CommAccounting(const Config& cfg, const Transformer& model, const TrainGroups& groups,
                               int64_t sequences)
    : cfg_(cfg), model_(model), g_(groups),
      counted_{groups.tensor, groups.expert, groups.data, groups.expert_data, groups.pipeline}, sequences_(sequences) {
  for (size_t i = 0; i < model.table().params.size(); ++i)
    if (model.holds(i) && model.table().params[i].trainable)
      (model.table().params[i].expert >= 0 ? expert_bytes_ : dense_bytes_) += double(model.shard(i).numel()) * 4;
}

void CommAccounting::start_step() {
  for (const GroupPair& c : counted_) c.reset_bytes_sent();
}

// The analytical count, per step:
//   tp  per micro-batch: (3 L_s + first + last) all-reduces of N x D floats, per block the
//       attention's input gradient (GQA: N x D; MLA: N x (kv_lora + qk_rope) at the latents and
//       N x q_lora, or N x D without a query latent), MoE layers' gate gradients (N x k doubles),
//       the cross-entropy's 3 vectors of N; each all-reduce of B bytes sends 2 (T - 1) / T x B.
//   ep  per MoE layer and micro-batch: 4 x (routed rows whose expert is on another rank) x D
//       floats (dispatch and combine, forward and backward) + the counts (P - 1) x L x 8.
//   dp, edp  the bucket of the dense (expert) trainable parameters this rank holds, B bytes:
//       ZeRO-1 reduce-scatter + all-gather, or an all-reduce: 2 (R - 1) / R x B.
//   pp  per micro-batch: N x D floats to the next stage (not the last) and to the previous one
//       (not the first); with mtp_depth modules every message also carries their depth x N x D
//       embeddings (forward) or gradient (backward), from the first stage to the last and back.
//   mtp the modules' blocks count in L_s and the MoE layers of the last stage; tp adds per module
//       an all-reduce of N x D on the first stage (its embedding) and N x D plus 20 N bytes on the
//       last (its head's input gradient, its cross-entropy).
void CommAccounting::end_step(double rows_off) {
  const ModelConfig& m = cfg_.model;
  const Placement& place = model_.placement();
  const bool first = place.first_stage(), last = place.last_stage();
  const double N = double(sequences_ * cfg_.train.seq_len), D = m.d_model, Mb = cfg_.parallel.micro_batches;
  const int l0 = place.layer_begin(), l1 = place.layer_end();
  // The multi-token prediction modules: MoE blocks on the last stage; each embeds its tokens on the
  // first stage (an all-reduce of N x D over tp), and on the last its head's input gradient (N x D)
  // and cross-entropy (20 N bytes); across stages its embeddings ride with the activations.
  const double depth = m.mtp_depth, mtp_blocks = last ? depth : 0;
  const double Ls = l1 - l0 + mtp_blocks, Lm = std::max(0, l1 - std::max(l0, m.first_dense_layers)) + mtp_blocks;
  auto ring = [](int n) { return n > 1 ? 2.0 * (n - 1) / n : 0.0; };
  double local[10] = {};
  for (int g = 0; g < 5; ++g) local[g] = double(counted_[size_t(g)].bytes_sent());
  const double attn_grad = !m.mla() ? D : m.kv_lora_rank + m.qk_rope_head_dim + (m.q_lora_rank > 0 ? m.q_lora_rank : D);
  local[5] = ring(g_.tensor.size()) * Mb *
             (((3 * Ls + (first ? 1 + depth : 0) + (last ? 1 + depth : 0)) * D + Ls * attn_grad) * N * 4 +
              Lm * N * m.moe.top_k * 8 + (last ? N * 20 * (1 + depth) : 0));
  const int Pe = g_.expert.size(), Le = place.local_experts();
  local[6] = Pe > 1 ? 4 * rows_off * D * 4 + Mb * Lm * (Pe - 1) * Le * 8 : 0;
  local[7] = ring(g_.data.size()) * dense_bytes_;
  local[8] = ring(g_.expert_data.size()) * expert_bytes_;
  local[9] = Mb * N * D * 4 * (1 + depth) * ((last ? 0 : 1) + (first ? 0 : 1));
  g_.world->allreduce_sum(local, 10);
  for (int g = 0; g < 5; ++g) measured_[size_t(g)] = local[g], expected_[size_t(g)] = local[5 + g];
}

void CommAccounting::print() const {
  std::printf("communication of the last step, bytes summed over the ranks (README \"Communication\"):\n"
              "  group      measured    analytical  ratio\n");
  for (size_t g = 0; g < 5; ++g)
    if (expected_[g] > 0 || measured_[g] > 0)
      std::printf("  %-5s  %12.0f  %12.0f  %5.3f\n", kGroupNames[g], measured_[g], expected_[g],
                  expected_[g] > 0 ? measured_[g] / expected_[g] : NAN);
}

}  // namespace fp8moe
