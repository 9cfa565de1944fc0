#include "model/plan_model.h"

#include <algorithm>
#include <cmath>

#include "model/placement.h"
#include "parallel/communicator.h"
#include "parallel/pipeline_schedule.h"

namespace fp8moe {
namespace {

constexpr double kF32 = 4, kI64 = 8, kI32 = 4, kF64 = 8;

bool fp8_on(const Config& c, LinearClass cls) {
  if (c.fp8.recipe == Fp8Recipe::off) return false;
  const Fp8Layers& on = c.fp8.layers;
  switch (cls) {
    case LinearClass::attention: return on.attention;
    case LinearClass::mlp: return on.mlp;
    case LinearClass::experts: return on.experts;
    case LinearClass::shared_experts: return on.shared_experts;
    default: return false;
  }
}

// What a linear layer keeps of its (M, K) input for backward (model/linear.cpp, LinearSaved):
// nothing in FP32 mode (the caller's FP32 input is kept instead, counted by the caller);
// blockwise the T x 1 copy wgrad reads (fp8.cache_activations: the 1 x T copy); per-tensor the
// FP8 input and its one scale.
double linear_saved(const Config& c, bool on, double M, double K) {
  if (!on) return 0;
  const int T = c.fp8.tile;
  if (c.fp8.recipe == Fp8Recipe::blockwise)
    return c.fp8.cache_activations ? M * K + M * std::ceil(K / T) * kF32 : M * K + std::ceil(M / T) * K * kF32;
  return M * K + kF32;
}

// model/ffn.cpp fuses_w13: W1|W3 as one layer unless blockwise FP8 with F not a multiple of the tile.
bool fused_w13(const Config& c, bool on, int64_t F) {
  return !on || c.fp8.recipe != Fp8Recipe::blockwise || F % c.fp8.tile == 0;
}

// The bytes of a value the backward reads that train.activations bf16 keeps in BF16
// (ModelContext::stash): 2, else 4.
double kept_value_bytes(const Config& c) { return c.train.activations == ActivationDtype::bf16 ? 2 : kF32; }

bool selective(const Config& c) { return c.train.recompute == Recompute::selective; }

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

// model/ffn.h FfnSaved::bytes for M rows of an FFN of width F on one rank.
double ffn_saved(const Config& c, bool on, double M, int64_t D, int64_t F) {
  const bool fused = fused_w13(c, on, F);
  // The gate and up pre-activations (h1 | h3); selective with blockwise cached inputs: in FP8.
  double b = M * 2 * double(F) * kept_value_bytes(c);
  if (selective(c) && on && c.fp8.recipe == Fp8Recipe::blockwise && c.fp8.cache_activations) {
    const double T = c.fp8.tile, f = double(F);  // a byte each, an FP32 scale per 1 x T tile
    b = M * 2 * f + M * (fused ? std::ceil(2 * f / T) : 2 * std::ceil(f / T)) * kF32;
  }
  b += linear_saved(c, on, M, double(D)) * (fused ? 1 : 2);
  if (selective(c)) return b;  // the SwiGLU output (W2's input) made again in backward
  if (!on) b += M * double(F) * kF32;   // the SwiGLU output W2 reads in FP32
  return b + linear_saved(c, on, M, double(F));
}

// model/moe.cpp MoeRouting::bytes: prob (N, E) f32; expert, gate, row_slot, slot_row (N k) 4 bytes
// each, kept (N k) u8, row_token (N k) i64; load (E) and offsets (E + 1) i64; with per-tensor FP8
// rows on the wire (train.activations bf16), their one scale (f32).
double routing_bytes(const Config& c, double N, double E, double k) {
  return N * E * kF32 + N * k * (4 * 4 + 1 + kI64) + E * kI64 + (E + 1) * kI64 +
         (tensor_scaled_wire(&c.fp8, c.train.activations) ? kF32 : 0);
}

bool is_recomputed(const Config& c, int layer) {
  return recomputes_layer(c.train.recompute, c.train.recompute_layers, c.model.first_dense_layers, layer);
}

// The head's runs per micro-batch on a stage that holds it: the main model's on the head stage,
// the modules' on the last (one stage, or two under parallel.mtp_own_stage).
double head_uses(const Placement& place, const ModelConfig& g) {
  return (place.head_stage() ? 1 : 0) + (place.last_stage() ? g.mtp_depth : 0);
}

GridPosition position(const PlanLayout& L, int stage) {
  GridPosition at;
  at.tensor = L.tensor, at.stages = L.pipeline, at.stage = stage, at.experts = L.expert, at.split = L.split;
  at.v_shape = L.v_shape, at.mtp_alone = L.mtp_alone;
  return at;
}

bool is_moe_layer(const ModelConfig& m, int layer) { return layer >= m.first_dense_layers; }

// The routed rows one expert-parallel rank's experts receive per micro-batch (uniform routing) and
// the rows per local expert.
double routed_rows(const ModelConfig& m, const PlanLayout& L) { return double(L.tokens()) * m.moe.top_k; }

// Bytes of a block's kept state (BlockSaved::bytes, model/transformer.cpp). kA: what
// train.activations bf16 keeps in BF16 (ModelContext::stash); a tensor an FP32 linear layer holds
// a pointer to stays FP32.
double kept_block_bytes(const Config& c, const PlanLayout& L, const ModelConfig& m, int layer) {
  const double N = double(L.tokens()), D = m.d_model, H = m.n_heads;  // m: this rank's widths
  const double kA = kept_value_bytes(c);
  const bool attn_fp8 = fp8_on(c, LinearClass::attention);
  const double attn_out = attn_fp8 ? kA : kF32;                  // an FP32 wo holds its input
  double b = N * D * kA + N * kF32 + N * D * kA + N * kF32;      // input, rstd1, x_mid, rstd2
  if (!attn_fp8) b += N * D * kF32;                              // h1, read by FP32 q/k/v in backward
  // wo's FP8 copy of its input (selective: made again from attn, which the core keeps anyway)
  const double wo_input = selective(c) ? 0 : linear_saved(c, attn_fp8, N, H * double(m.mla() ? m.v_head_dim : m.head_dim));
  if (!m.mla()) {
    const double hd = m.head_dim, kvh = m.n_kv_heads;
    b += N * (H * hd + kvh * hd * 2) * kA + N * H * hd * attn_out + N * H * kF32;  // q, k, v; attn; lse
    b += 3 * linear_saved(c, attn_fp8, N, D) + wo_input;
  } else {
    const double qk = m.qk_head_dim(), vd = m.v_head_dim, ql = m.q_lora_rank, kvl = m.kv_lora_rank;
    // q, k, v (selective: the rotated shared key instead of k and v, and of q with the query latent);
    // attn; lse
    if (!selective(c))
      b += N * H * (2 * qk + vd) * kA;
    else
      b += N * m.qk_rope_head_dim * kA + (ql > 0 ? 0 : N * H * qk * kA);
    b += N * H * vd * attn_out + N * H * kF32;
    if (ql > 0) {
      b += N * ql * kA + N * kF32 + (attn_fp8 ? 0 : N * ql * kF32);  // cq, rstd_q, cqn
      b += linear_saved(c, attn_fp8, N, D) + linear_saved(c, attn_fp8, N, ql);
    } else {
      b += linear_saved(c, attn_fp8, N, D);
    }
    b += N * kvl * kA + N * kF32 + (attn_fp8 ? 0 : N * kvl * kF32);  // ckv, rstd_kv, ckvn
    b += linear_saved(c, attn_fp8, N, D) + linear_saved(c, attn_fp8, N, kvl) + wo_input;
  }
  if (!is_moe_layer(m, layer)) {
    const bool on = fp8_on(c, LinearClass::mlp);
    if (!on) b += N * D * kF32;  // h2
    return b + ffn_saved(c, on, N, int64_t(D), m.d_ff_dense);
  }
  const bool shared_fp32 = m.moe.n_shared_experts > 0 && !fp8_on(c, LinearClass::shared_experts);
  if (shared_fp32)
    b += N * D * kF32;  // h2: the FP32 router's weight gradient (and the shared experts') reads it
  else if (!selective(c))
    b += N * D * kA;  // (selective: made again from x_mid)
  b += routing_bytes(c, N, m.moe.n_experts, m.moe.top_k);
  if (m.moe.n_shared_experts > 0)
    b += ffn_saved(c, fp8_on(c, LinearClass::shared_experts), N, int64_t(D), int64_t(m.moe.n_shared_experts) * m.moe.d_expert);
  const bool on = fp8_on(c, LinearClass::experts);
  const double R = routed_rows(m, L), local = double(m.moe.n_experts) / L.expert;
  if (c.train.moe_gates == GateSite::combine)
    b += R * D * kA;                // expert_out (BF16: as combine brought it), for the gates' gradient
  else
    b += R * kF32;                  // train.moe_gates expert: the rows' gates (gate_rows)
  if (!on) b += R * D * kF32;       // xr (one rank) or xl (expert parallelism): the experts' FP32 inputs
  b += local * ffn_saved(c, on, R / local, int64_t(D), m.moe.d_expert);
  return b;
}

// The largest set of temporaries of one block's forward or backward (model/transformer.cpp
// block_forward / block_backward, gqa_/mla_backward, model/ffn.cpp, model/moe.cpp moe_backward),
// on top of the saved state; for a recomputed block, its restored state too.
double block_workspace(const Config& c, const PlanLayout& L, const ModelConfig& m, int layer) {
  const double N = double(L.tokens()), D = m.d_model, H = m.n_heads;
  double attn_bwd = 0, attn_fwd = 0;
  if (!m.mla()) {
    const double hd = m.head_dim, kvh = m.n_kv_heads;
    attn_bwd = N * (2 * H * hd + 2 * kvh * hd + D) * kF32;  // da, dq, dk, dv, part
  } else {
    const double nope = m.qk_nope_head_dim, rope = m.qk_rope_head_dim, qk = nope + rope, vd = m.v_head_dim;
    const double ql = m.q_lora_rank, kvl = m.kv_lora_rank;
    attn_bwd = N * (2 * H * vd + 2 * H * qk + H * (nope + vd) + rope + 2 * kvl + (kvl + rope) + 2 * ql + D) * kF32;
    attn_fwd = N * ((kvl + rope) + rope + H * (nope + vd)) * kF32;  // ckv_pe, kpe, kv
    if (selective(c)) attn_bwd += N * H * (2 * qk + vd) * kF32;      // q, k, v made again
  }
  // selective: wo's FP8 input copy made again
  if (selective(c)) attn_bwd += linear_saved(c, fp8_on(c, LinearClass::attention), N, H * (m.mla() ? m.v_head_dim : m.head_dim));
  double ffn_bwd = 0, ffn_fwd = 0;
  if (!is_moe_layer(m, layer)) {
    const double F = m.d_ff_dense;
    const bool fused = fused_w13(c, fp8_on(c, LinearClass::mlp), m.d_ff_dense);
    ffn_bwd = N * (F + 2 * F) * kF32 + (fused ? 0 : N * D * kF32) + 2 * N * 2 * F;  // da, dh1|dh3, dx3; dy in FP8
    if (selective(c)) ffn_bwd += N * F * kF32;  // the SwiGLU output made again
  } else {
    const double R = routed_rows(m, L), F = m.moe.d_expert, E = m.moe.n_experts, k = m.moe.top_k;
    const double local = E / L.expert;
    const bool ep = L.expert > 1;
    // the experts' da and dh1|dh3: FP8 experts quantize each expert's dh1|dh3 as it is made (its
    // two FP8 copies held, one expert's FP32 at a time); FP32 experts hold every expert's
    const double dh = fp8_on(c, LinearClass::experts) ? R * 2 * F * 2 + R / local * 2 * F * kF32 : R * 2 * F * kF32;
    // dgate, dye (and its received rows), the experts' da, dh1|dh3 and input gradients (and the
    // rows sent back); the router's logits in the forward.
    ffn_bwd = N * k * kF64 + R * D * kF32 * (ep ? 2 : 1) + R * F * kF32 + dh + R * D * kF32 * (ep ? 2 : 1) + N * E * kF32;
    // the rows' gates' gradients (expert parallelism: received, the exchange's buffer, returned)
    if (c.train.moe_gates == GateSite::expert) ffn_bwd += R * kF64 * (ep ? 3 : 1);
    // runtime.overlap_expert_comm: the experts' weight gradients wait behind the combine, with the
    // FP8 copies of their output gradients they read (W2's and W1|W3's: T x 1 tiles blockwise, the
    // one-scale copies otherwise); FP32 experts keep their FP32 dh, counted above.
    if (ep && c.runtime.overlap_expert_comm && fp8_on(c, LinearClass::experts)) {
      const PlanTiling t = c.fp8.recipe == Fp8Recipe::blockwise ? PlanTiling::cols_Tx1 : PlanTiling::per_tensor;
      ffn_bwd += fp8_copy_bytes(int64_t(R), int64_t(D), t, c.fp8.tile) + fp8_copy_bytes(int64_t(R), int64_t(2 * F), t, c.fp8.tile);
    }
    // selective: the router's input made again (from x_mid as kept); the SwiGLU outputs' copies W2
    // reads
    if (selective(c)) ffn_bwd += N * D * kF32 + R * F * (fp8_on(c, LinearClass::experts) ? 1 : kF32);
    ffn_fwd = N * E * kF32 + R * D * kF32 * (ep ? 2 : 1);  // logits; y (and the rows before the exchange)
  }
  const double fwd = 2 * N * D * kF32 + std::max(attn_fwd, ffn_fwd);        // o, f
  // the block's input gradient (written over its output's); dh2 through the FFN branch; dx_mid and
  // dh1 through the attention's (Block::backward)
  const double bwd = N * D * kF32 + std::max(N * D * kF32 + ffn_bwd, 2 * N * D * kF32 + attn_bwd);
  const double restored = is_recomputed(c, layer) ? kept_block_bytes(c, L, m, layer) + N * D * kF32 : 0;
  return std::max(fwd, bwd + restored);
}

}  // namespace

PlanLayout plan_layout(const Config& c, int world) {
  PlanLayout L;
  L.world = world, L.tensor = c.parallel.tensor, L.pipeline = c.parallel.pipeline, L.expert = c.parallel.expert;
  L.data = world / (L.tensor * L.pipeline);
  L.expert_data = L.data / L.expert;
  L.micro_batches = c.parallel.micro_batches;
  L.sequences = int64_t(c.train.global_batch) / (int64_t(L.data) * L.micro_batches);
  L.seq_len = c.train.seq_len;
  L.v_shape = c.parallel.pipeline_schedule == PipelineSchedule::dualpipev && L.pipeline > 1;
  L.mtp_alone = c.parallel.mtp_own_stage && L.pipeline > 1;
  L.split = stage_split(c.model, c.parallel.stage_layers, L.v_shape ? 2 * L.pipeline : L.pipeline, L.seq_len, L.v_shape,
                        L.mtp_alone);
  return L;
}

double fp8_copy_bytes(int64_t rows, int64_t cols, PlanTiling t, int tile) {
  const double r = double(rows), c = double(cols), T = tile;
  switch (t) {
    case PlanTiling::per_tensor: return r * c + kF32;
    case PlanTiling::rows_1xT: return r * c + r * std::ceil(c / T) * kF32;
    case PlanTiling::cols_Tx1: return r * c + std::ceil(r / T) * c * kF32;
    default: return r * c + std::ceil(r / T) * std::ceil(c / T) * kF32;
  }
}

double block_saved_bytes(const Config& c, const PlanLayout& L, int layer) {
  const Placement place(c.model, position(L, 0));
  const ModelConfig& m = place.local();
  if (!is_recomputed(c, layer)) return kept_block_bytes(c, L, m, layer);
  const double N = double(L.tokens());
  if (!is_moe_layer(m, layer)) return N * m.d_model * kept_value_bytes(c);
  // The routing, and with the gates in the experts the rows' gates, stay (BlockSaved::finish).
  const double gate_rows = c.train.moe_gates == GateSite::expert ? routed_rows(m, L) * kF32 : 0;
  return N * m.d_model * kept_value_bytes(c) + routing_bytes(c, N, m.moe.n_experts, m.moe.top_k) + gate_rows;
}

namespace {
// Rows through a linear weight per micro-batch: every token, or an expert's share of the routed
// rows of the expert-parallel group (uniform routing).
double rows_through(const ModelConfig& g, const PlanLayout& L, const ParamSpec& p) {
  const double N = double(L.tokens());
  return p.linear == LinearClass::experts ? N * g.moe.top_k * L.expert / g.moe.n_experts : N;
}
}  // namespace

bool zb1p_weight_op(const Config& c, const PlanLayout& L, const ParamSpec& p) {
  const bool posted = L.expert > 1 && c.runtime.overlap_expert_comm;  // model/moe.cpp keeps them behind the exchange
  const bool experts = p.linear == LinearClass::experts || p.linear == LinearClass::shared_experts;
  const bool head = p.name == "head.weight", eh = p.name.find("eh_proj") != std::string::npos;
  return head || eh || (p.linear != LinearClass::none && p.layer >= 0 && !(experts && posted));
}

double step_budget_seconds(double hours, double tokens, double step_tokens, int world) {
  return hours * 3600.0 / (tokens / step_tokens) / double(world);
}

std::vector<StageMemory> plan_memory(const Config& c, const PlanLayout& L) {
  const ModelConfig& g = c.model;
  const ParamTable table = build_param_table(g);
  const double moment_bytes = c.train.moments_dtype == MomentsDtype::fp32 ? 4 : 2;
  const bool zero = c.optim.zero == 1;
  std::vector<StageMemory> out;
  for (int s = 0; s < L.pipeline; ++s) {
    const Placement place(g, position(L, s));
    const ModelConfig& m = place.local();
    StageMemory r;
    r.stage = s, r.layer_begin = place.layer_begin(), r.layer_end = place.layer_end();
    r.first = place.first_stage(), r.last = place.last_stage(), r.head = place.head_stage();
    if (place.chunks() == 2) r.v_shape = true, r.layer_begin2 = place.layer_begin(1), r.layer_end2 = place.layer_end(1);
    r.mtp_blocks = r.last ? g.mtp_depth : 0;
    // The flat buffers' segments in layout order (model/param_store.h), each member's (numel, cols),
    // for ZeRO-1's cut at row boundaries (model/data_parallel.cpp).
    std::vector<std::pair<int64_t, int64_t>> dense, experts;
    for (const ParamSpec& p : table.params) {
      const Shard sh = place.shard(p);
      if (!sh.held()) continue;
      r.held += sh.numel();
      if (p.trainable) (p.expert >= 0 ? experts : dense).push_back({sh.numel(), sh.cols});
      const bool on = fp8_on(c, p.linear);
      if (on) {
        r.fp8_weights += fp8_copy_bytes(sh.rows, sh.cols,
                                        c.fp8.recipe == Fp8Recipe::blockwise ? PlanTiling::blocks_TxT : PlanTiling::per_tensor,
                                        c.fp8.tile);
        if (c.fp8.recipe == Fp8Recipe::delayed)  // x, w and dy: a history and two scales each
          r.fp8_state += 3 * (double(c.fp8.amax_history_len) + 2) * kF32;
      }
    }
    // The largest ZeRO-1 chunk of a segment over R replicas: cut r at the row boundary at or
    // before size r / R.
    auto largest_chunk = [&](const std::vector<std::pair<int64_t, int64_t>>& seg, int R, int64_t* total) {
      int64_t size = 0;
      for (const auto& e : seg) size += e.first;
      *total = size;
      if (!zero || R <= 1) return size;
      std::vector<int64_t> cut(size_t(R + 1), size);
      cut[0] = 0;
      size_t i = 0;
      int64_t off = 0;
      for (int q = 1; q < R; ++q) {
        const int64_t target = size * q / R;
        while (i < seg.size() && target >= off + seg[i].first) off += seg[i].first, ++i;
        const int64_t at = i < seg.size() ? off + (target - off) / seg[i].second * seg[i].second : size;
        cut[size_t(q)] = std::max(at, cut[size_t(q - 1)]);
      }
      int64_t most = 0;
      for (int q = 0; q < R; ++q) most = std::max(most, cut[size_t(q + 1)] - cut[size_t(q)]);
      return most;
    };
    r.owned_dense = largest_chunk(dense, L.data, &r.dense_trainable);
    r.owned_expert = largest_chunk(experts, L.expert_data, &r.expert_trainable);
    r.weights = double(r.held) * kF32;
    r.grads = double(r.held) * kF32;
    r.moments = 2 * moment_bytes * double(r.owned_dense + r.owned_expert);
    // A checkpoint's rows are split over a block's replicas (dp for dense, edp for experts); with
    // ZeRO-1 each writes the moments it owns.
    // (parallel.mtp_own_stage: the last stage's copy of the head is not written.)
    double copies = 0;
    for (const ParamSpec& p : table.params)
      if (place.holds_tied_copy(p)) copies += double(place.shard(p).numel());
    const double written = (double(r.dense_trainable) - copies) / L.data + double(r.expert_trainable) / L.expert_data;
    r.checkpoint_copy = written * kF32 + (zero ? r.moments : 2 * moment_bytes * written);

    // Activations of one micro-batch on this stage (model/transformer.cpp StageRun::Impl), per
    // chunk: its output, its blocks', the first chunk's modules' input embeddings, the head's
    // chunk's head, the last chunk's modules (one chunk but under parallel.mtp_own_stage).
    const double N = double(L.tokens()), D = g.d_model, V = m.vocab_size, depth = g.mtp_depth;
    double work = 0;
    // train.hp_gemm bf16: the head's BF16 copy and its input's (or dlogits') for the call
    const double head16 = c.train.hp_gemm == GemmDtype::bf16 ? V * D * 2 + N * std::max(D, V) * 2 : 0;
    auto chunk_saved = [&](int b, int e, bool first, bool head, bool last) {
      double saved = N * D * kF32;  // the chunk's output
      for (int l = b; l < e; ++l) {
        saved += block_saved_bytes(c, L, l);
        work = std::max(work, block_workspace(c, L, m, l));
      }
      if (first && depth > 0) saved += depth * N * D * kF32;              // the modules' input embeddings
      if (head) {
        saved += N * D * kF32 + N * kF32 + N * V * kF32;                   // hf, rstd, dlogits
        work = std::max(work, N * V * kF32 + head16);                      // the logits
      }
      if (last) {
        if (depth > 0 && !first) saved += depth * N * D * kF32;          // the received embeddings
        for (int k = 0; k < g.mtp_depth; ++k) {
          const int l = g.n_layers + k;
          // rstd_e, rstd_h, cat (N, 2D), out, hf, rstd_f, dlogits; the block (its input x included)
          saved += 3 * N * kF32 + N * 2 * D * kF32 + 2 * N * D * kF32 + N * V * kF32 + block_saved_bytes(c, L, l);
          work = std::max(work, std::max(block_workspace(c, L, m, l), N * V * kF32 + 2 * N * D * kF32 + head16));
        }
      }
      return saved;
    };
    if (r.v_shape) {
      // (The last chunk's run copies the modules' embeddings from the first chunk's, as it would
      // the received ones.)
      const double saved[2] = {chunk_saved(r.layer_begin, r.layer_end, place.chunk_first(0), false, false),
                               chunk_saved(r.layer_begin2, r.layer_end2, false, place.chunk_head(1), place.chunk_last(1))};
      r.saved_per_micro_batch = saved[0] + saved[1];
      r.activations = dualpipev_activations(L.pipeline, s, L.micro_batches, saved, &r.in_flight,
                                            c.parallel.pair_micro_batches);
    } else {
      r.saved_per_micro_batch = chunk_saved(r.layer_begin, r.layer_end, r.first, r.head, r.last);
      r.in_flight = in_flight_micro_batches(L.pipeline, s, L.micro_batches, c.parallel.pair_micro_batches);
      r.activations = r.saved_per_micro_batch * r.in_flight;
      if (c.parallel.pipeline_schedule == PipelineSchedule::zb1p) {
        // A weight op's copies: each linear layer's input (K) and output gradient (N) per row.
        for (const ParamSpec& p : table.params) {
          const Shard sh = place.shard(p);
          if (!sh.held() || !zb1p_weight_op(c, L, p)) continue;
          const double rows = rows_through(g, L, p);
          const bool hp = p.linear == LinearClass::none;  // the head, eh_proj: BF16 or FP32 copies
          const double per = hp ? (c.train.hp_gemm == GemmDtype::bf16 ? 2 : kF32)
                             : !fp8_on(c, p.linear)                    ? kF32
                             : c.fp8.recipe == Fp8Recipe::blockwise    ? 1 + kF32 / c.fp8.tile
                                                                       : 1;
          const double uses = p.name == "head.weight" ? head_uses(place, g) : 1;  // the modules' heads too
          r.weight_op_bytes += uses * rows * double(sh.rows + sh.cols) * per;
        }
        r.weight_ops_waiting = std::min(s + 1, L.micro_batches);
        r.activations += r.weight_op_bytes * r.weight_ops_waiting;
      }
    }
    r.workspace = work;
    out.push_back(r);
  }
  return out;
}

std::vector<StageFlops> plan_flops(const Config& c, const PlanLayout& L) {
  const ModelConfig& g = c.model;
  const ParamTable table = build_param_table(g);
  const double N = double(L.tokens());
  std::vector<StageFlops> out;
  for (int s = 0; s < L.pipeline; ++s) {
    const Placement place(g, position(L, s));
    const ModelConfig& m = place.local();
    StageFlops f;
    for (const ParamSpec& p : table.params) {
      const Shard sh = place.shard(p);
      if (!sh.held()) continue;
      const bool head = p.name == "head.weight", eh = p.name.find("eh_proj") != std::string::npos;
      const bool router = p.name.size() >= 10 && p.name.compare(p.name.size() - 10, 10, "moe.router") == 0;
      if (p.linear == LinearClass::none && !head && !eh && !router) continue;
      const double rows = rows_through(g, L, p);
      const double fwd = 2 * rows * double(sh.numel()) * (head ? head_uses(place, g) : 1);  // the head serves the modules too
      // A recomputed block runs its linear layers again; not its router (the forward's routing is
      // reused), nor eh_proj and the head (outside the blocks). Selective recomputation runs MLA's
      // up-projections of the keys and values (and of the queries from their latent) again.
      const bool up = selective(c) && g.mla() && p.linear != LinearClass::none &&
                      (ends_with(p.name, "attn.wkv_b") || (g.q_lora_rank > 0 && ends_with(p.name, "attn.wq_b")));
      const bool recomputed = p.linear != LinearClass::none && (is_recomputed(c, p.layer) || up);
      const double flops = 3 * fwd + (recomputed ? fwd : 0);
      const bool bf16 = c.train.hp_gemm == GemmDtype::bf16 && (head || eh || router);
      (fp8_on(c, p.linear) ? f.fp8_gemm : bf16 ? f.bf16_gemm : f.hp_gemm) += flops;
      if (recomputed) f.recompute += fwd;
      if (zb1p_weight_op(c, L, p)) (fp8_on(c, p.linear) ? f.wgrad_fp8 : bf16 ? f.wgrad_bf16 : f.wgrad_hp) += fwd;
    }
    // The attention core, causal (T / 2 keys per query on average): QK^T and PV, 3x for training.
    const double per_block = N * m.n_heads * double(m.qk_head_dim() + m.v_dim()) * double(L.seq_len);
    std::vector<int> blocks;  // the rank's chunks' blocks, then with the head the modules'
    for (int k = 0; k < place.chunks(); ++k)
      for (int l = place.layer_begin(k); l < place.layer_end(k); ++l) blocks.push_back(l);
    for (int k = 0; place.last_stage() && k < g.mtp_depth; ++k) blocks.push_back(g.n_layers + k);
    for (const int l : blocks) {
      f.attention += 3 * per_block + (is_recomputed(c, l) ? per_block : 0);
      if (is_recomputed(c, l)) f.recompute += per_block;
    }
    out.push_back(f);
  }
  return out;
}

}  // namespace fp8moe
