#include "model/transformer.h"

#include <algorithm>
#include <cmath>

#include "kernels/check.h"
#include "kernels/rope.h"

namespace fp8moe {

struct StageRun::Impl {
  int64_t B = 0, T = 0, N = 0;
  const int32_t* tokens = nullptr;   // first stage: for the embedding's backward (the caller's memory)
  // Multi-token prediction: its input tokens (first stage, the caller's memory), their embeddings
  // (first stage; on the last stage of several a copy of the received ones), their gradient (last
  // stage), and the modules' state (last stage).
  const int32_t* mtp_tokens = nullptr;
  Tensor mtp_emb, mtp_demb;
  std::vector<MtpSaved> mtp;
  int64_t mtp_n = 0;                 // depth x N x D while the modules run, else 0
  std::vector<Tensor> xs;            // block inputs of this stage, then its output
  std::vector<BlockSaved> saved;
  HeadSaved head;                    // the head's chunk
  Tensor dx;                         // after backward: the gradient of this stage's input
  StepResult result;
  bool backward = false;
  float aux_grad_scale = 1.0f;
  int chunk = 0;                     // which of the rank's chunks (model/placement.h)
  bool first = false, last = false;  // whether it starts the model (embedding) / ends it (head, modules)
  bool runs_head = false;            // whether it runs the main head (the last chunk, or the one before: mtp_alone)
};

StageRun::StageRun() = default;
StageRun::~StageRun() = default;
StageRun::StageRun(StageRun&&) noexcept = default;
StageRun& StageRun::operator=(StageRun&&) noexcept = default;
const StepResult& StageRun::result() const { return impl_->result; }
// (The head's chunk before the modules' (mtp_alone) sends them the final norm's output, hf.)
const float* StageRun::output() const { return impl_->runs_head && !impl_->last ? impl_->head.hf.f32() : impl_->xs.back().f32(); }
const float* StageRun::input_grad() const { return impl_->dx.f32(); }
int64_t StageRun::activation_size() const { return impl_->xs.back().numel(); }
const float* StageRun::mtp_output() const { return impl_->mtp_n > 0 ? impl_->mtp_emb.f32() : nullptr; }
const float* StageRun::mtp_input_grad() const { return impl_->mtp_n > 0 ? impl_->mtp_demb.f32() : nullptr; }
int64_t StageRun::mtp_size() const { return impl_->mtp_n; }

void RopeTables::ensure(Backend& be, const ModelConfig& m, int64_t len) {
  const int64_t hd = m.rope_dim(), half = hd / 2;  // the channels of a head that RoPE rotates
  if (len <= T) return;
  std::vector<float> c(size_t(len * half)), s(c.size()), ci(c.size()), si(c.size());
  cpu::rope_table(len, hd, m.rope_theta, false, c.data(), s.data());
  cpu::rope_table(len, hd, m.rope_theta, true, ci.data(), si.data());
  cs = tensor_from(be, c, {len, half}), sn = tensor_from(be, s, {len, half});
  cs_inv = tensor_from(be, ci, {len, half}), sn_inv = tensor_from(be, si, {len, half});
  T = len;
}

namespace {
GridPosition position_in(const Config& c, const ModelGroups& g) {
  GridPosition at;
  if (g.tensor) at.tensor_rank = g.tensor->rank(), at.tensor = g.tensor->size();
  if (g.pipeline) at.stage = g.pipeline->rank(), at.stages = g.pipeline->size();
  if (g.expert) at.expert_rank = g.expert->rank(), at.experts = g.expert->size();
  // (A one-rank tool of a pipelined config holds every block, whatever the schedule.)
  at.v_shape = c.parallel.pipeline_schedule == PipelineSchedule::dualpipev && at.stages > 1;
  at.mtp_alone = c.parallel.mtp_own_stage && at.stages > 1;
  at.split = stage_split(c.model, c.parallel.stage_layers, at.chunks(), c.train.seq_len, at.v_shape, at.mtp_alone);
  return at;
}

int64_t count_targets(const int32_t* targets, int64_t N, int32_t pad) {
  return std::count_if(targets, targets + N, [&](int32_t t) { return t != pad; });
}
}  // namespace

Transformer::Transformer(Backend& be, const Config& cfg, ModelGroups groups)
    : be_(be), cfg_(cfg), table_(build_param_table(cfg.model)), groups_(groups),
      placement_(cfg.model, position_in(cfg, groups)) {
  const ModelConfig& m = cfg_.model;
  if (groups.expert && groups.expert->size() > 1) {
    FP8MOE_ASSERT(groups.expert_counts, "expert parallelism needs the expert group's host communicator");
    dispatcher_ = std::make_unique<ExpertDispatcher>(be, *groups.expert, *groups.expert_counts, m.moe.n_experts);
  }
  std::vector<Shard> shards;
  for (const ParamSpec& p : table_.params) shards.push_back(placement_.shard(p));
  store_ = std::make_unique<ParamStore>(be, table_, shards, uint64_t(cfg.train.seed));
  Communicator* tp = placement_.at().tensor > 1 ? groups.tensor : nullptr;
  fp8_ = std::make_unique<Fp8State>(be, cfg_.fp8, *store_, Fp8Groups{tp, groups.data, groups.expert_data});
  loads_h_ = HostBuffer<int64_t>(be, m.moe.n_experts);
  rope_.ensure(be, m, cfg.train.seq_len);
  ctx_ = std::make_unique<ModelContext>(
      ModelContext{be, m, placement_, placement_.local(), tp, *fp8_, rope_, dispatcher_.get(), &loads_h_,
                   cfg.train.activations, cfg.train.recompute == Recompute::selective, cfg.train.hp_gemm,
                   cfg.train.moe_gates});
  // The blocks of this rank's chunks in turn and, with the head, the multi-token prediction
  // modules' blocks.
  auto add_block = [&](int l) {
    blocks_.push_back(std::make_unique<Block>(*ctx_, l, recomputed(l)));
    if (blocks_.back()->is_moe()) router_biases_.push_back({l, store_->param(slot(block_prefix(m, l) + "moe.router_bias"))});
  };
  for (int c = 0; c < placement_.chunks(); ++c) {
    chunk_block0_.push_back(int(blocks_.size()));
    for (int l = placement_.layer_begin(c); l < placement_.layer_end(c); ++l) add_block(l);
  }
  if (placement_.last_stage())
    for (int l = m.n_layers; l < m.n_layers + m.mtp_depth; ++l) add_block(l);
  if (placement_.first_stage()) embed_ = fp8_->weight("embed.weight");
  // The head stage's final norm and head; with mtp_alone the last stage holds the head's weight
  // alone (its tied copy, for the modules' heads).
  if (placement_.head_stage()) head_.norm = fp8_->weight("final_norm.weight");
  if (placement_.head_stage() || placement_.last_stage()) head_.head = fp8_->weight("head.weight");
  if (placement_.last_stage()) {
    std::vector<Block*> modules;
    for (auto it = blocks_.end() - m.mtp_depth; it != blocks_.end(); ++it) modules.push_back(it->get());
    if (m.mtp_depth > 0) mtp_ = std::make_unique<Mtp>(*ctx_, modules, head_.head, embed_);
  }
}

Transformer::~Transformer() = default;

size_t Transformer::slot(const std::string& name) const {
  const int64_t i = table_.index_of(name);
  FP8MOE_ASSERT(i >= 0, "no parameter named ", name);
  return size_t(i);
}

bool Transformer::recomputed(int layer) const {
  return recomputes_layer(cfg_.train.recompute, cfg_.train.recompute_layers, cfg_.model.first_dense_layers, layer);
}

void Transformer::embed_forward(const int32_t* tokens, int64_t N, float* out) {
  const int64_t D = local().d_model, Vl = local().vocab_size, v0 = placement_.vocab_first();
  be_.embedding_forward(embed_.w, tokens, N, D, v0, Vl, out);
  ctx_->tp_sum(out, N * D);  // each token's row comes from the one rank holding it
  ctx_->round_activation(out, N * D);  // the residual stream's first rounding point
}

void Transformer::embed_backward(const float* dx, const int32_t* tokens, int64_t N) {
  const int64_t D = local().d_model, Vl = local().vocab_size, v0 = placement_.vocab_first();
  be_.embedding_backward(dx, tokens, N, D, v0, Vl, embed_.g);
}

void Transformer::finish_block(const Block& block, BlockSaved* s, StepResult* result) {
  if (dispatcher_ && dispatcher_->relays()) {  // the rows the relay planned for this block
    const ExpertDispatcher::RelayRows& now = dispatcher_->relay_rows();
    if (training_forward_ && recomputed(block.layer())) {
      relay_again_.across += now.across - relay_mark_.across, relay_again_.relayed += now.relayed - relay_mark_.relayed;
      relay_again_.plans += now.plans - relay_mark_.plans;
    }
    relay_mark_ = now;
  }
  const int moe = block.layer() - cfg_.model.first_dense_layers;  // the modules' blocks count on
  if (moe >= 0) {
    result->expert_load[size_t(moe)] = s->moe.routing.load_host;
    result->dropped += s->moe.routing.dropped();
    if (keep_routing_) result->routing[size_t(moe)] = to_host<int32_t>(s->moe.routing.expert);
  }
  block.finish(s);
}

StepResult Transformer::forward_backward(const int32_t* tokens, const int32_t* targets, int64_t B, int64_t T,
                                         bool backward, float loss_scale, int64_t mean_over, double aux_weight,
                                         StageWeights* weights) {
  FP8MOE_ASSERT(placement_.at().stages == 1, "forward_backward on one pipeline stage of several");
  const ModelConfig& m = cfg_.model;
  const int64_t N = B * T, moe_layers = m.moe_layers();
  for (int64_t i = 0; i < N; ++i)
    FP8MOE_ASSERT(tokens[i] >= 0 && tokens[i] < m.vocab_size, "token ", tokens[i], " outside the vocabulary of ",
                  m.vocab_size);
  Tensor ids = tensor_from(be_, std::vector<int32_t>(tokens, tokens + N), {N});
  Tensor tgt = tensor_from(be_, std::vector<int32_t>(targets, targets + N), {N});
  const int depth = backward ? m.mtp_depth : 0;  // the modules train; an evaluation leaves them out
  Tensor losses = Tensor::zeros(be_, DType::f64, {1 + moe_layers + depth});
  const int64_t counted = count_targets(targets, N, m.pad_id);
  // The modules' shifted tokens and targets, and their counted targets (mean_over: this batch's).
  MtpInputs mtp;
  if (depth > 0) mtp = mtp_inputs(be_, tokens, targets, B, T, depth, m.pad_id);
  if (backward) begin_step();
  StageRun run = stage_forward(ids.data<int32_t>(), tgt.data<int32_t>(), counted, B, T, nullptr, backward,
                               {losses.data<double>(), losses.data<double>() + 1, losses.data<double>() + 1 + moe_layers},
                               loss_scale, mean_over, aux_weight, depth > 0 ? &mtp.batch : nullptr);
  if (backward) stage_backward(run, nullptr, nullptr, {}, weights);
  // The losses as the training loop combines them (app/stage_runner.cpp).
  StepResult r = run.result();
  const std::vector<double> h = to_host<double>(losses);
  const int64_t denom = mean_over > 0 ? mean_over : counted;
  r.ce = denom > 0 ? h[0] / double(denom) : 0.0;
  for (int64_t l = 0; l < moe_layers; ++l) r.aux += h[size_t(1 + l)];
  r.aux *= aux_weight;
  r.loss = r.ce + r.aux;
  for (int k = 0; k < depth; ++k) {
    const double over = double(mtp.batch.mean_over[size_t(k)]);
    r.mtp += over > 0 ? h[size_t(1 + moe_layers + k)] / over / depth : 0.0;
  }
  return r;
}

StageRun Transformer::stage_forward(const int32_t* tokens, const int32_t* targets, int64_t counted, int64_t B,
                                    int64_t T, const float* x_in, bool backward, const LossSlots& slots,
                                    float loss_scale, int64_t mean_over, double aux_weight, const MtpBatch* mtp,
                                    int chunk) {
  const ModelConfig& m = cfg_.model;
  const int64_t N = B * T, D = m.d_model;
  FP8MOE_ASSERT(chunk >= 0 && chunk < placement_.chunks(), "chunk ", chunk, " of ", placement_.chunks());
  const int L0 = placement_.layer_begin(chunk), L1 = placement_.layer_end(chunk), b0 = chunk_block0_[size_t(chunk)];
  rope_.ensure(be_, m, T);
  StageRun run;
  run.impl_ = std::make_unique<StageRun::Impl>();
  StageRun::Impl& st = *run.impl_;
  st.B = B, st.T = T, st.N = N, st.backward = backward;
  st.chunk = chunk, st.first = placement_.chunk_first(chunk), st.last = placement_.chunk_last(chunk);
  st.runs_head = placement_.chunk_head(chunk);
  st.aux_grad_scale = float(loss_scale * aux_weight);
  training_forward_ = backward;
  if (dispatcher_) relay_mark_ = dispatcher_->relay_rows();
  StepResult& result = st.result;

  for (int l = L0; l <= L1; ++l) st.xs.emplace_back(be_, DType::f32, Shape{N, D});
  const bool with_mtp = backward && m.mtp_depth > 0 && mtp;
  FP8MOE_ASSERT(!(backward && m.mtp_depth > 0) || mtp, "a training forward of a model with multi-token prediction "
                "needs its MtpBatch");
  if (with_mtp) st.mtp_n = int64_t(m.mtp_depth) * N * D;
  if (st.first) {
    embed_forward(tokens, N, st.xs[0].f32());
    st.tokens = tokens;
    if (with_mtp) {  // the modules' input embeddings, for the last stage
      st.mtp_tokens = mtp->tokens;
      st.mtp_emb = Tensor(be_, DType::f32, {st.mtp_n});
      for (int k = 0; k < m.mtp_depth; ++k) embed_forward(mtp->tokens + k * N, N, st.mtp_emb.f32() + k * N * D);
    }
  } else {
    be_.copy(st.xs[0].f32(), x_in, size_t(N * D) * sizeof(float));
  }
  st.saved.resize(size_t(L1 - L0));
  result.expert_load.resize(size_t(m.moe_layers()));
  result.routing.resize(size_t(m.moe_layers()));
  int64_t saved_bytes = 0;
  for (int l = L0; l < L1; ++l) {
    Block& block = *blocks_[size_t(b0 + l - L0)];
    BlockSaved& sv = st.saved[size_t(l - L0)];
    const int moe = l - m.first_dense_layers;
    block.forward(st.xs[size_t(l - L0)].f32(), B, T, st.xs[size_t(l - L0 + 1)].f32(), &sv,
                  backward ? block.training() : Pass::evaluation(), moe >= 0 && slots.aux ? slots.aux + moe : nullptr);
    ctx_->round_activation(st.xs[size_t(l - L0 + 1)].f32(), N * D);  // between blocks (and stages)
    finish_block(block, &sv, &result);
    // The block's input, for its backward (or its recomputation): in BF16 under bf16 activations.
    if (backward) ctx_->stash(&st.xs[size_t(l - L0)]);
    const int64_t xb = int64_t(dtype_size(st.xs[size_t(l - L0)].dtype()));
    // A recomputed block keeps only its input (the stage's), its routing and its rows' gates.
    saved_bytes += sv.kept ? sv.bytes(D, xb) : N * D * xb + sv.moe.routing.bytes() + int64_t(sv.moe.gate_rows.bytes());
  }
  saved_bytes_per_token_ = N > 0 && L1 > L0 ? double(saved_bytes) / double(N) / double(L1 - L0) : 0.0;
  if (st.runs_head || st.last) stage_head_forward(run, targets, counted, slots, loss_scale, mean_over, with_mtp ? mtp : nullptr);
  if (!backward) st.saved.clear(), st.xs.erase(st.xs.begin(), st.xs.end() - 1);
  return run;
}

// The head after the chunk's blocks, and the multi-token prediction modules after it; with
// mtp_alone one or the other: the head on the chunk of the last block, the modules on the last
// chunk (no blocks), which reads the head's chunk's hf as its input.
void Transformer::stage_head_forward(StageRun& run, const int32_t* targets, int64_t counted, const LossSlots& slots,
                                     float loss_scale, int64_t mean_over, const MtpBatch* mtp) {
  StageRun::Impl& st = *run.impl_;
  const ModelConfig& m = cfg_.model;
  if (st.runs_head) {
    const int64_t denom = mean_over > 0 ? mean_over : counted;
    HeadLoss loss;
    loss.targets = targets;
    loss.grad_scale = denom > 0 ? loss_scale / float(denom) : 0.0f;  // d (scaled mean) / d logits
    loss.loss_sum = slots.ce_sum;
    loss.backward = st.backward;
    head_forward(*ctx_, head_, st.xs.back().f32(), st.N, &loss, &st.head);
    st.result.tokens = counted;
  }
  if (!mtp || !st.last) return;
  if (!st.first) {  // the first chunk's embeddings (another stage's, or this rank's other run's), kept until backward
    FP8MOE_ASSERT(mtp->embeddings, "the last stage needs the first stage's multi-token prediction embeddings");
    st.mtp_emb = Tensor(be_, DType::f32, {st.mtp_n});
    be_.copy(st.mtp_emb.f32(), mtp->embeddings, size_t(st.mtp_n) * sizeof(float));
  }
  const int first_module_moe = m.n_layers - m.first_dense_layers;
  const float* hf = st.runs_head ? st.head.hf.f32() : st.xs.back().f32();  // (mtp_alone: received)
  const Tensor rounded = modules_hf(st);
  if (!rounded.empty()) hf = rounded.f32();
  mtp_->forward(st.mtp_emb.f32(), hf, st.B, st.T, *mtp, loss_scale, slots.mtp,
                slots.aux ? slots.aux + first_module_moe : nullptr, &st.mtp,
                [&](const Block& block, BlockSaved* s) { finish_block(block, s, &st.result); });
}

// (Tags: once a step, after every pipeline message of the step has been received, and before the
// next step's: they cannot meet another message.)
constexpr int kTiedHeadTag = 32767;  // MPI's least MPI_TAG_UB

std::pair<size_t, int64_t> Transformer::tied_head() const {
  if (!placement_.in_head_tie() || !groups_.pipeline) return {0, 0};
  const size_t i = slot("head.weight");
  return {i, store_->shard(i).numel()};
}

int64_t Transformer::tie_head_gradient() {
  const auto [i, n] = tied_head();
  if (n == 0) return 0;
  const Placement& pl = placement_;
  float* g = store_->grad(i);
  if (pl.at().stage == pl.last_rank()) {
    groups_.pipeline->isend(g, n, pl.head_rank(), kTiedHeadTag);
    groups_.pipeline->wait_sends();
    return n;
  }
  Tensor theirs(be_, DType::f32, {n});
  groups_.pipeline->recv(theirs.f32(), n, pl.last_rank(), kTiedHeadTag);
  be_.add(g, theirs.f32(), g, n);
  return 0;
}

int64_t Transformer::share_tied_head() {
  const auto [i, n] = tied_head();
  if (n == 0) return 0;
  const Placement& pl = placement_;
  if (pl.at().stage == pl.head_rank()) {
    groups_.pipeline->isend(store_->param(i), n, pl.last_rank(), kTiedHeadTag);
    groups_.pipeline->wait_sends();
    return n;
  }
  groups_.pipeline->recv(store_->param(i), n, pl.head_rank(), kTiedHeadTag);
  return 0;
}

std::vector<bool> Transformer::tied_copies() const {
  std::vector<bool> c;
  for (const ParamSpec& p : table_.params) c.push_back(placement_.holds_tied_copy(p));
  return c;
}

// Under BF16 activations, where the modules run with the head: the head's hf rounded to BF16, as
// the modules would receive it on a stage of their own (parallel.mtp_own_stage), so that they read
// the same values on every layout (and, in the backward, return their gradient of it rounded).
// Empty otherwise. A temporary: the forward and the backward each make it from the head's hf.
Tensor Transformer::modules_hf(const StageRun::Impl& st) const {
  if (!st.runs_head || !ctx_->bf16_activations()) return {};
  const int64_t n = st.N * cfg_.model.d_model;
  Tensor r(be_, DType::f32, {n});
  be_.copy(r.f32(), st.head.hf.f32(), size_t(n) * sizeof(float));
  ctx_->round_activation(r.f32(), n);
  return r;
}

void StageWeights::run(const std::function<void(int)>& after_block) {
  for (auto& [layer, work] : blocks_) {
    work.run();
    if (after_block && layer >= 0) after_block(layer);
  }
  blocks_.clear();
}

void Transformer::stage_backward(StageRun& run, const float* dy, const float* d_mtp,
                                 const std::function<void(int)>& after_block, StageWeights* weights) {
  FP8MOE_ASSERT(!(weights && after_block), "stage_backward: with its weights left for later, their run() is final");
  StageRun::Impl& st = *run.impl_;
  FP8MOE_ASSERT(st.backward, "stage_backward of a forward without backward");
  const ModelConfig& m = cfg_.model;
  const int64_t N = st.N, D = m.d_model;
  const int L0 = placement_.layer_begin(st.chunk), L1 = placement_.layer_end(st.chunk), b0 = chunk_block0_[size_t(st.chunk)];
  Tensor dx(be_, DType::f32, {N, D});  // each block's output gradient, then (in place) its input's
  if (st.runs_head || st.last) {
    // The head's and the modules' weight GEMMs, in the order the backward meets them (the head's
    // gradient is the main head's and every module's): one LaterWork, not a block's (no layer).
    LaterWork* later = nullptr;
    if (weights) {
      weights->blocks_.emplace_back(-1, LaterWork{});
      later = &weights->blocks_.back().second;
      later->detached = true;
    }
    // The modules read the normed output too: their gradient of it joins the head's (with
    // mtp_alone: received from the last chunk, as dy; there, it is the chunk's input gradient).
    auto modules_backward = [&](float* dhf) {
      if (st.mtp_n == 0) return;
      st.mtp_demb = Tensor(be_, DType::f32, {st.mtp_n});
      const Tensor rounded = modules_hf(st);  // (made again from the head's hf, alive until its backward ends)
      const float* hf = !rounded.empty() ? rounded.f32() : st.runs_head ? st.head.hf.f32() : st.xs.back().f32();
      if (rounded.empty()) {
        mtp_->backward(&st.mtp, st.mtp_emb.f32(), hf, N, st.aux_grad_scale, st.mtp_demb.f32(), dhf, later);
      } else {  // their gradient of hf rounded, as another chunk would send it, then the head's
        Tensor d(be_, DType::f32, {N, D});
        be_.zero(d.f32(), size_t(N * D) * sizeof(float));
        mtp_->backward(&st.mtp, st.mtp_emb.f32(), hf, N, st.aux_grad_scale, st.mtp_demb.f32(), d.f32(), later);
        ctx_->round_activation(d.f32(), N * D);
        be_.add(dhf, d.f32(), dhf, N * D);
      }
      ctx_->round_activation(st.mtp_demb.f32(), st.mtp_n);  // a pipeline message on several stages
      if (!st.first) st.mtp_emb.reset();
    };
    if (!st.runs_head) {
      be_.zero(dx.f32(), size_t(N * D) * sizeof(float));
      modules_backward(dx.f32());
      ctx_->round_activation(dx.f32(), N * D);  // the gradient of hf to the head's chunk
    } else {
      head_backward(*ctx_, head_, st.xs.back().f32(), N, &st.head, dx.f32(), [&](float* dhf) {
        if (st.last) modules_backward(dhf);
        else be_.add(dhf, dy, dhf, N * D);
      }, later);
    }
  } else {
    be_.copy(dx.f32(), dy, size_t(N * D) * sizeof(float));
  }
  for (int l = L1 - 1; l >= L0; --l) {
    Block& block = *blocks_[size_t(b0 + l - L0)];
    BlockSaved& sv = st.saved[size_t(l - L0)];
    Tensor xw;  // the block's input in FP32 where it was kept in BF16 (a kept block's: where read)
    if (sv.kept) {
      sv.x = nullptr, sv.x_kept = &st.xs[size_t(l - L0)];
    } else {
      const float* x = ctx_->unstash(st.xs[size_t(l - L0)], &xw);
      block.recompute_if_dropped(x, &sv);
      sv.x = x;
    }
    LaterWork* later = nullptr;
    if (weights) {
      weights->blocks_.emplace_back(l, LaterWork{});
      later = &weights->blocks_.back().second;
      later->detached = true;
    }
    block.backward(sv, dx.f32(), dx.f32(), st.aux_grad_scale, later);
    ctx_->round_activation(dx.f32(), N * D);  // the gradient between blocks (and stages)
    sv = BlockSaved{};
    if (after_block) after_block(l);
  }
  if (st.first) {
    embed_backward(dx.f32(), st.tokens, N);
    if (st.mtp_n > 0) {  // the modules' input embeddings
      const float* de = st.last ? st.mtp_demb.f32() : d_mtp;
      FP8MOE_ASSERT(de, "the first stage's backward needs the gradient of the multi-token prediction embeddings");
      for (int k = 0; k < m.mtp_depth; ++k) embed_backward(de + k * N * D, st.mtp_tokens + k * N, N);
    }
  }
  st.dx = std::move(dx);
  st.saved.clear();
  st.xs.erase(st.xs.begin(), st.xs.end() - 1);
}

std::vector<float> Transformer::next_token_logits(const int32_t* tokens, int64_t T) { return last_logits(tokens, T, 1, nullptr); }

std::vector<float> Transformer::sequence_logits(const int32_t* tokens, int64_t T, std::vector<std::vector<float>>* mtp) {
  return last_logits(tokens, T, T, mtp);
}

std::vector<float> Transformer::last_logits(const int32_t* tokens, int64_t T, int64_t rows,
                                            std::vector<std::vector<float>>* mtp) {
  FP8MOE_ASSERT(placement_.at().tensor == 1 && !dispatcher_ && placement_.at().stages == 1,
                "generation runs on one rank holding the whole model");
  FP8MOE_ASSERT(rows >= 1 && rows <= T, rows, " rows of logits of ", T, " positions");
  const ModelConfig& m = cfg_.model;
  const int64_t D = m.d_model, V = m.vocab_size;
  for (int64_t i = 0; i < T; ++i)
    FP8MOE_ASSERT(tokens[i] >= 0 && tokens[i] < V, "token ", tokens[i], " outside the vocabulary of ", V);
  rope_.ensure(be_, m, T);
  const Tensor ids = tensor_from(be_, std::vector<int32_t>(tokens, tokens + T), {T});
  Tensor x(be_, DType::f32, {T, D}), y(be_, DType::f32, {T, D});
  be_.embedding_forward(embed_.w, ids.data<int32_t>(), T, D, 0, V, x.f32());
  ctx_->round_activation(x.f32(), T * D);  // the training forward's rounding points
  for (int l = 0; l < m.n_layers; ++l) {
    BlockSaved s;
    blocks_[size_t(l)]->forward(x.f32(), 1, T, y.f32(), &s, Pass::evaluation(), nullptr);
    ctx_->round_activation(y.f32(), T * D);
    std::swap(x, y);
  }
  HeadSaved h;
  Tensor logits;
  head_forward(*ctx_, head_, x.f32() + (T - rows) * D, rows, nullptr, &h, &logits);
  if (mtp) {
    // The multi-token prediction modules over every position, as in training (teacher-forced).
    FP8MOE_ASSERT(rows == T, "the modules' logits need every position");
    *mtp = m.mtp_depth > 0 ? mtp_->logits(tokens, T, h.hf.f32()) : std::vector<std::vector<float>>{};
  }
  return to_host<float>(logits);
}

void Transformer::update_router_biases(const std::vector<std::vector<int64_t>>& expert_load) {
  const ModelConfig& m = cfg_.model;
  FP8MOE_ASSERT(int64_t(expert_load.size()) == m.moe_layers(), "expert loads of ", expert_load.size(), " MoE layers");
  // This stage's MoE blocks, and on the last stage the multi-token prediction modules' blocks.
  for (const auto& [l, bias] : router_biases_) {
    const std::vector<int64_t>& load = expert_load[size_t(l - m.first_dense_layers)];
    if (load.empty()) continue;
    const Tensor d = tensor_from(be_, load, {int64_t(load.size())});
    be_.bias_update(bias, d.data<int64_t>(), int64_t(load.size()), m.moe.bias_update_rate);
  }
}

}  // namespace fp8moe
