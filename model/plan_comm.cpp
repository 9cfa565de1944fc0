// The plan's communication: the analytical bytes of each group (the formulas the runs' measured
// counts are checked against, app/comm_accounting.cpp), and the expert rows' sizes on the wire.
#include <algorithm>

#include "model/config.h"
#include "model/plan_model.h"
#include "parallel/communicator.h"

namespace fp8moe {

bool tensor_scaled_wire(const Fp8Config* fp8, ActivationDtype activations) {
  return activations == ActivationDtype::bf16 && fp8 && fp8->layers.experts &&
         (fp8->recipe == Fp8Recipe::delayed || fp8->recipe == Fp8Recipe::current);
}

// tp  per micro-batch: (3 L_s + first + last) all-reduces of N x D floats (2 more per block that
//     train.recompute runs again: every block under full, the MoE blocks under moe), per block the
//     attention's input gradient (GQA: N x D; MLA: N x (kv_lora + qk_rope) at the latents and
//     N x q_lora, or N x D without a query latent), MoE layers' gate gradients (N x k doubles),
//     the cross-entropy's 3 vectors of N; each all-reduce of B bytes sends 2 (T - 1) / T x B.
// ep  per MoE layer and micro-batch: 4 x (routed rows whose expert is on another rank) x D floats
//     (dispatch and combine, forward and backward) + the counts (P - 1) x L x 8; train.moe_gates
//     expert: 12 bytes more per such row (its gate out, the gate's FP64 gradient back); a MoE layer
//     that train.recompute moe or full runs again sends its forward's 2 exchanges again; train.activations
//     bf16: the rows of expert_row_bytes, and with a per-tensor recipe the two exchanges' amax
//     all-reduces (expert_wire_scale_bytes).
// dp, edp  the bucket of the dense (expert) trainable parameters this rank holds, B bytes: ZeRO-1
//     reduce-scatter + all-gather, or an all-reduce: 2 (R - 1) / R x B; with optim.grad_reduce
//     bf16 the reduce-scatter sends BF16 values and the all-gather FP32 (ZeRO-1's weights, or
//     without ZeRO the sums): 1.5 (R - 1) / R x B.
// pp  per micro-batch: N x D floats to the next stage (not the last) and to the previous one (not
//     the first); with mtp_depth modules every message also carries their depth x N x D
//     embeddings (forward) or gradient (backward), from the first stage to the last and back;
//     the head's input gradient from a last stage of no block is FP32 (Placement::head_alone;
//     the modules' embeddings' gradient after it as the activations).
//     parallel.mtp_own_stage: once a step the last stage sends the head stage its gradient of the
//     head's weight and the head stage its updated weight back, V / T x D floats each.
// mtp the modules' blocks count in L_s and the MoE layers of the last stage; tp adds per module an
//     all-reduce of N x D on the first stage (its embedding) and N x D plus 20 N bytes on the last
//     (its head's input gradient, its cross-entropy); the main head's (N x D and 20 N) are the head
//     stage's (the last, or the one before it under parallel.mtp_own_stage).
ExpertRowBytes expert_row_bytes(int64_t D, const Fp8Config* fp8, ActivationDtype activations, GateSite gates) {
  const double d = double(D), g = gates == GateSite::expert ? 4 + 8 : 0;
  if (activations == ActivationDtype::fp32) return {4 * d, 4 * d, 4 * d, 4 * d, g};
  // model/moe.cpp moe_wire: the routed experts' layers FP8 (all three, one configuration):
  // blockwise rows carry their 1 x T scales; per-tensor rows D bytes (the exchange's one scale is
  // not sent: expert_wire_scale_bytes).
  const bool fp8_rows = fp8 && fp8->recipe != Fp8Recipe::off && fp8->layers.experts;
  const double fp8_row = !fp8_rows ? 2 * d
                         : fp8->recipe == Fp8Recipe::blockwise ? fp8_copy_bytes(1, D, PlanTiling::rows_1xT, fp8->tile)
                                                               : d;
  return {fp8_row, 2 * d, fp8_row, 2 * d, g};
}

double expert_wire_scale_bytes(int P, const Fp8Config* fp8, ActivationDtype activations) {
  return tensor_scaled_wire(fp8, activations) ? 2 * double(ring_allreduce_bytes(P, 4)) : 0;
}

double pipeline_value_bytes(ActivationDtype activations) { return activations == ActivationDtype::bf16 ? 2 : 4; }

std::array<int, 2> shape_blocks(const CommShape& s) {
  const int d = s.model->first_dense_layers;
  auto range = [&](int b, int e) { return std::array<int, 2>{e - b, std::max(0, e - std::max(b, d))}; };
  const std::array<int, 2> a = range(s.layer_begin, s.layer_end),
                           b = s.v_shape ? range(s.layer_begin2, s.layer_end2) : std::array<int, 2>{};
  return {a[0] + b[0], a[1] + b[1]};
}

std::array<double, 2> recomputed_blocks(const CommShape& s) {
  const ModelConfig& m = *s.model;
  static const std::vector<int> none;
  const std::vector<int>& listed = s.recompute_layers ? *s.recompute_layers : none;
  std::array<double, 2> n{};
  auto count = [&](int l) {
    if (recomputes_layer(s.recompute, listed, m.first_dense_layers, l)) ++n[l >= m.first_dense_layers ? 1 : 0];
  };
  for (int l = s.layer_begin; l < s.layer_end; ++l) count(l);
  for (int l = s.layer_begin2; s.v_shape && l < s.layer_end2; ++l) count(l);
  for (int k = 0; s.last && k < m.mtp_depth; ++k) count(m.n_layers + k);
  return n;
}

double recomputed_moe_share(const CommShape& s) {
  const ModelConfig& m = *s.model;
  const double moe_layers = shape_blocks(s)[1] + (s.last ? m.mtp_depth : 0);
  return moe_layers > 0 ? recomputed_blocks(s)[1] / moe_layers : 0;
}

namespace {
// Of the step's expert rows, those of the MoE blocks run again: as the run counted them, or by
// those blocks' share of the stage's MoE blocks (uniform routing: the plan).
struct AgainRows {
  double off_rank = 0, off_node = 0, across = 0, forwarded = 0;
};
AgainRows again_rows(const CommShape& s) {
  const double share = recomputed_moe_share(s);
  auto pick = [&](double counted, double all) { return counted >= 0 ? counted : share * all; };
  return {pick(s.rows_off_rank_again, s.rows_off_rank), pick(s.rows_off_node_again, s.rows_off_node),
          pick(s.relay_across_again, s.relay_across), pick(s.relay_forwarded_again, s.relay_forwarded)};
}
}  // namespace

std::array<double, 5> analytic_comm_bytes(const CommShape& s) {
  const ModelConfig& m = *s.model;
  const double N = s.tokens, D = m.d_model, Mb = s.micro_batches;
  const double depth = m.mtp_depth, mtp_blocks = s.last ? depth : 0;
  const std::array<int, 2> blocks = shape_blocks(s);
  const double Ls = blocks[0] + mtp_blocks, Lm = blocks[1] + mtp_blocks;
  auto ring = [](int n) { return n > 1 ? 2.0 * (n - 1) / n : 0.0; };
  const double attn_grad = !m.mla() ? D : m.kv_lora_rank + m.qk_rope_head_dim + (m.q_lora_rank > 0 ? m.q_lora_rank : D);
  std::array<double, 5> b{};
  // Blocks whose forward train.recompute (or recompute_layers) runs again: its two all-reduces
  // (attention and FFN output).
  const std::array<double, 2> rc = recomputed_blocks(s);
  const double again = rc[0] + rc[1];
  const AgainRows a = again_rows(s);  // a MoE block run again sends its forward's two exchanges again
  const bool main_head = s.mtp_alone ? s.head : s.last;
  const double heads = (main_head ? 1 : 0) + mtp_blocks;  // the head's runs here: the main model's, the modules'
  b[0] = ring(s.tensor) * Mb *
         (((3 * Ls + 2 * again + (s.first ? 1 + depth : 0) + heads) * D + Ls * attn_grad) * N * 4 +
          Lm * N * m.moe.top_k * 8 + N * 20 * heads);
  const ExpertRowBytes rb = expert_row_bytes(m.d_model, s.fp8, s.activations, s.moe_gates);
  const double row = rb.per_step(0), row_again = rb.per_step(1) - row;
  b[1] = s.expert > 1 ? s.rows_off_rank * row + a.off_rank * row_again + Mb * Lm * (s.expert - 1) * s.local_experts * 8 +
                           Mb * Lm * expert_wire_scale_bytes(s.expert, s.fp8, s.activations)
                     : 0;
  if (s.expert > 1 && s.relay) {
    // The relay (parallel/expert_dispatch.h): the relayed exchanges' rows across nodes go once per
    // token and node, and between the relay and the expert's rank where that is another rank; two
    // more counts per rank and layer, and the relay's map (4 bytes per rank of the other nodes and
    // per row across).
    const double tok = rb.relayed(0), tok_again = rb.relayed(1) - tok;
    b[1] += (s.relay_across + s.relay_forwarded - s.rows_off_node) * tok +
            (a.across + a.forwarded - a.off_node) * tok_again + Mb * Lm * (s.expert - 1) * 2 * 8 +
            4 * (Mb * Lm * s.remote_ranks + s.rows_off_node);
  }
  const double reduce = s.grad_reduce == ReduceDtype::bf16 ? 0.75 : 1.0;  // of the FP32 reduce-scatter + all-gather
  b[2] = reduce * ring(s.data) * s.dense_bytes;
  b[3] = reduce * ring(s.expert_data) * s.expert_bytes;
  // 1F1B: the activation to the next stage, its gradient to the previous one, the modules'
  // embeddings with them. DualPipeV: each way of the V both, but the turn's and rank 0's own (the
  // modules' embeddings stay on rank 0, which holds the first chunk and the last).
  const double pp_row = Mb * N * D * pipeline_value_bytes(s.activations);
  b[4] = s.v_shape ? pp_row * ((s.turn ? 0 : 2) + (s.first ? 0 : 2))
                   : pp_row * (1 + depth) * ((s.last ? 0 : 1) + (s.first ? 0 : 1));
  // A last chunk of no block sends the head's input gradient in FP32 whatever train.activations
  // (the modules' embeddings' gradient with it as the activations).
  if (s.head_alone && s.last && !(s.first && !s.v_shape))
    b[4] += Mb * N * D * (4 - pipeline_value_bytes(s.activations));
  // Once a step the stages sum the loss, the modules' loss and every MoE layer's expert loads
  // (app/stage_runner.cpp finish_step), an all-reduce over the pipeline group.
  const double all_moe_layers = std::max(0, m.n_layers - m.first_dense_layers) + depth;
  b[4] += ring(s.pipeline) * (2 * 8 + all_moe_layers * m.moe.n_experts * 8);
  if (s.mtp_alone && (s.head || s.last)) b[4] += 4 * double(m.vocab_size) / s.tensor * D;
  return b;
}

std::array<double, 2> expert_rows_by_node(const CommShape& s) {
  const ExpertRowBytes rb = expert_row_bytes(s.model->d_model, s.fp8, s.activations, s.moe_gates);
  const AgainRows a = again_rows(s);
  const double row = rb.per_step(0), row_again = rb.per_step(1) - row;
  const double tok = s.relay ? rb.relayed(0) : 0, tok_again = s.relay ? rb.relayed(1) - rb.relayed(0) : 0;
  return {(s.rows_off_rank - s.rows_off_node) * row + (a.off_rank - a.off_node) * row_again + s.relay_forwarded * tok +
              a.forwarded * tok_again,
          s.rows_off_node * (row - tok) + a.off_node * (row_again - tok_again) + s.relay_across * tok +
              a.across * tok_again};
}

}  // namespace fp8moe
