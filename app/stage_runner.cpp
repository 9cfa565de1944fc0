#include "app/stage_runner.h"

#include <algorithm>
#include <chrono>
#include <cmath>

#include "parallel/mpi_session.h"
#include "parallel/pass_pair.h"
#include "parallel/pipeline_schedule.h"
#include "parallel/trace.h"

namespace fp8moe {
namespace {

// A step's micro-batch states (StageRun) and the messages built from them (`sent`), each let go as
// soon as nothing needs it: a state once its backward is over, no other state's backward still
// reads it (pinned) and its messages have left; a message once its send is complete
// (Communicator::send_complete, polled before each forward and backward). Not once a step: a
// stage would hold every micro-batch's output and input gradient until the step's end (M of them,
// 2 x 117 MB each on the 671B config).
class Releaser {
 public:
  Releaser(Communicator& pipe, std::vector<StageRun>& runs, std::vector<Tensor>& sent)
      : pipe_(pipe), runs_(runs), sent_(sent), hold_(runs.size()) {}
  // Send k (the pipeline's, since its last wait_sends) reads run i's memory or sent[slot].
  void sending(int64_t k, size_t i, size_t slot) {
    ++hold_[i].sends;
    pending_.push_back({k, i, slot});
  }
  void backward_done(size_t i) {
    hold_[i].done = true;
    release(i);
  }
  void pin(size_t i) { ++hold_[i].pins; }
  void unpin(size_t i) {
    --hold_[i].pins;
    release(i);
  }
  void poll() {
    for (size_t j = 0; j < pending_.size();) {
      if (!pipe_.send_complete(pending_[j].k)) {
        ++j;
        continue;
      }
      const Pending p = pending_[j];
      pending_.erase(pending_.begin() + std::ptrdiff_t(j));
      sent_[p.slot] = Tensor{};
      --hold_[p.run].sends;
      release(p.run);
    }
  }

 private:
  struct Hold {
    int sends = 0, pins = 0;
    bool done = false;
  };
  struct Pending {
    int64_t k;
    size_t run, slot;
  };
  void release(size_t i) {
    if (hold_[i].done && hold_[i].sends == 0 && hold_[i].pins == 0) runs_[i] = StageRun{};
  }
  Communicator& pipe_;
  std::vector<StageRun>& runs_;
  std::vector<Tensor>& sent_;
  std::vector<Hold> hold_;
  std::vector<Pending> pending_;
};

}  // namespace

StageRunner::StageRunner(const Config& cfg, Transformer& model, const RunnerGroups& groups)
    : cfg_(cfg), model_(model), be_(model.backend()), g_(groups) {
  FP8MOE_ASSERT(!cfg.parallel.pair_micro_batches || threads_serialized(),
                "parallel.pair_micro_batches runs a pair's second pass on another thread: MPI must provide "
                "MPI_THREAD_SERIALIZED at least");
  T_ = cfg.train.seq_len;
  mbs_ = cfg.train.global_batch / (cfg.parallel.micro_batches * g_.data_host->size());
  act_ = mbs_ * T_ * cfg.model.d_model;
  moe_layers_ = cfg.model.moe_layers();
  depth_ = cfg.model.mtp_depth;
  const Placement& place = model.placement();
  first_ = place.first_stage(), last_ = place.last_stage(), head_ = place.head_stage();
  tied_ = place.in_head_tie();
  v_shape_ = model.placement().chunks() == 2;
  bf16_wire_ = cfg.train.activations == ActivationDtype::bf16;
  if (v_shape_) {  // every rank receives both ways; the modules' embeddings stay on rank 0
    x_in_ = Tensor(be_, DType::f32, {act_}), dy_in_ = Tensor(be_, DType::f32, {act_});
    if (bf16_wire_) wire_in_ = Tensor(be_, DType::bf16, {act_});
  } else {
    // With multi-token prediction every message between stages carries the modules' embeddings
    // (or their gradient) after the activation (or its gradient).
    x_in_ = Tensor(be_, DType::f32, {first_ ? 0 : (1 + depth_) * act_});
    dy_in_ = Tensor(be_, DType::f32, {last_ ? 0 : (1 + depth_) * act_});
    if (bf16_wire_ && !(first_ && last_)) wire_in_ = Tensor(be_, DType::bf16, {(1 + depth_) * act_});
  }
  counts_h_ = HostBuffer<uint64_t>(be_, 2);
  post_layer_ = [this](int layer) {
    sync_->post_layer(model_.store(), layer);
    sync_->progress();
  };
}

// Each step's global batch is micro_batches micro-batches; the data-parallel replicas split each
// micro-batch: replica r computes its sequences [r * mbs, (r + 1) * mbs). Sample positions are
// global, so the step sees the same sequences on any number of replicas.
void StageRunner::sample(DataBlend& data, uint64_t seed, int64_t first_sample, int64_t mb0, int64_t batches,
                         bool count_all) {
  const int64_t R = g_.data_host->size(), n = batches * mbs_ * T_;
  if (tokens_h_.size() < n) tokens_h_ = HostBuffer<int32_t>(be_, n), targets_h_ = HostBuffer<int32_t>(be_, n);
  counted_.assign(size_t(batches), 0);
  for (int64_t b = 0; b < batches; ++b) {
    for (int64_t i = 0; i < mbs_; ++i) {
      const int64_t at = (b * mbs_ + i) * T_;
      data.sample(seed, first_sample + ((mb0 + b) * R + g_.data_host->rank()) * mbs_ + i, T_, &tokens_h_[at],
                  &targets_h_[at]);
    }
    const int32_t* t = targets_h_.data() + b * mbs_ * T_;
    counted_[size_t(b)] = std::count_if(t, t + mbs_ * T_, [&](int32_t x) { return x != cfg_.model.pad_id; });
  }
  // The micro-batches' counted tokens over all replicas: each replica's loss is its share of the
  // micro-batch's mean, so gradients have the 1-rank magnitudes and sum over the replicas.
  counted_all_ = counted_;
  if (count_all && R > 1) g_.data_host->allreduce_sum(counted_all_.data(), batches);
  if (!count_all || depth_ == 0) return;  // the modules train; an evaluation leaves them out
  // The modules' tokens and targets (model/mtp.h), counted the same way.
  const int64_t per = mbs_ * T_;
  if (mtp_tokens_h_.size() < depth_ * n)
    mtp_tokens_h_ = HostBuffer<int32_t>(be_, depth_ * n), mtp_targets_h_ = HostBuffer<int32_t>(be_, depth_ * n);
  mtp_counted_.clear();
  for (int64_t b = 0; b < batches; ++b) {
    const std::vector<int64_t> counted =
        mtp_batch(tokens_h_.data() + b * per, targets_h_.data() + b * per, mbs_, T_, depth_, cfg_.model.pad_id,
                  mtp_tokens_h_.data() + b * depth_ * per, mtp_targets_h_.data() + b * depth_ * per);
    mtp_counted_.insert(mtp_counted_.end(), counted.begin(), counted.end());
  }
  mtp_counted_all_ = mtp_counted_;
  if (R > 1) g_.data_host->allreduce_sum(mtp_counted_all_.data(), batches * depth_);
}

// One upload of the tokens (first stage) and targets (last stage) of every micro-batch. NOTE: from
// pinned memory the copy runs later; the host rewrites these buffers only after the step's (or
// the evaluation's) synchronisation, which the copy precedes.
void StageRunner::upload_batches(int64_t batches, bool with_mtp) {
  const int64_t n = batches * mbs_ * T_;
  if (tokens_.numel() < n) tokens_ = Tensor(be_, DType::i32, {n}), targets_ = Tensor(be_, DType::i32, {n});
  if (first_) be_.upload(tokens_.raw(), tokens_h_.data(), size_t(n) * sizeof(int32_t));
  if (head_) be_.upload(targets_.raw(), targets_h_.data(), size_t(n) * sizeof(int32_t));
  if (!with_mtp || depth_ == 0) return;
  if (mtp_tokens_.numel() < depth_ * n)
    mtp_tokens_ = Tensor(be_, DType::i32, {depth_ * n}), mtp_targets_ = Tensor(be_, DType::i32, {depth_ * n});
  if (first_) be_.upload(mtp_tokens_.raw(), mtp_tokens_h_.data(), size_t(depth_ * n) * sizeof(int32_t));
  if (last_) be_.upload(mtp_targets_.raw(), mtp_targets_h_.data(), size_t(depth_ * n) * sizeof(int32_t));
}

// Receives block; the time they block is the stage's share of the pipeline bubble. Sends are
// non-blocking, collected once a step.
void StageRunner::recv(float* buf, int64_t n, int peer, int tag, StepLocal* local, bool full) {
  const auto t0 = std::chrono::steady_clock::now();
  if (bf16_wire_ && full) {  // act_ FP32 values, then n - act_ BF16 ones (send's `full`)
    g_.pipe->recv(buf, act_ + (n - act_) / 2, peer, tag);
    if (n > act_) {  // the BF16 part out of the way, then widened into place
      be_.copy(wire_in_.raw(), buf + act_, size_t(n - act_) * sizeof(uint16_t));
      be_.from_bf16(wire_in_.data<uint16_t>(), buf + act_, n - act_);
    }
  } else if (bf16_wire_) {  // n BF16 values are n / 2 words (d_model is a multiple of 4: io/config_rules.cpp)
    g_.pipe->recv(static_cast<float*>(wire_in_.raw()), n / 2, peer, tag);
    be_.from_bf16(wire_in_.data<uint16_t>(), buf, n);
  } else {
    g_.pipe->recv(buf, n, peer, tag);
  }
  if (local) local->waited_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

int64_t StageRunner::send(Tensor& keep, const float* a, const float* extra, int64_t n_extra, int peer, int tag,
                          bool copy, bool full) {
  const int64_t n = act_ + n_extra, k = sends_++;
  if (bf16_wire_ && full) {  // a in FP32, extra (rounded already) in BF16 after it: act_ + n_extra / 2 words
    keep = Tensor(be_, DType::f32, {act_ + n_extra / 2});
    be_.copy(keep.f32(), a, size_t(act_) * sizeof(float));
    if (n_extra > 0) be_.to_bf16(extra, static_cast<uint16_t*>(keep.raw()) + 2 * act_, n_extra);
    g_.pipe->isend(keep.f32(), act_ + n_extra / 2, peer, tag);
    return k;
  }
  if (bf16_wire_) {
    keep = Tensor(be_, DType::bf16, {n});
    be_.to_bf16(a, keep.data<uint16_t>(), act_);
    if (n_extra > 0) be_.to_bf16(extra, keep.data<uint16_t>() + act_, n_extra);
    g_.pipe->isend(static_cast<const float*>(keep.raw()), n / 2, peer, tag);
    return k;
  }
  if (n_extra == 0 && !copy) {  // the activation itself, no copy
    g_.pipe->isend(a, act_, peer, tag);
    return k;
  }
  keep = Tensor(be_, DType::f32, {n});
  be_.copy(keep.f32(), a, size_t(act_) * sizeof(float));
  if (n_extra > 0) be_.copy(keep.f32() + act_, extra, size_t(n_extra) * sizeof(float));
  g_.pipe->isend(keep.f32(), n, peer, tag);
  return k;
}

void StageRunner::wait_sends() {
  g_.pipe->wait_sends();
  sends_ = 0;
}

StageRun StageRunner::forward_micro_batch(int mb, const float* x, const float* mtp_embeddings, float loss_scale,
                                          int chunk) {
  const int64_t R = g_.data_host->size(), at = int64_t(mb) * mbs_ * T_;
  double* slot = losses_.data<double>() + mb * slots();
  MtpBatch mtp;
  if (depth_ > 0) {
    mtp.tokens = mtp_tokens_.data<int32_t>() + depth_ * at, mtp.targets = mtp_targets_.data<int32_t>() + depth_ * at;
    mtp.mean_over.assign(mtp_counted_all_.begin() + mb * depth_, mtp_counted_all_.begin() + (mb + 1) * depth_);
    mtp.embeddings = mtp_embeddings;
  }
  return model_.stage_forward(tokens_.data<int32_t>() + at, targets_.data<int32_t>() + at, counted_[size_t(mb)], mbs_, T_,
                              x, true, {slot, slot + 1, slot + 1 + moe_layers_}, loss_scale, counted_all_[size_t(mb)],
                              1.0 / double(R), depth_ > 0 ? &mtp : nullptr, chunk);
}

// A forward's expert loads into the step's, and its routed rows off this rank and node.
void StageRunner::count_loads(const StepResult& r, StepLocal* local) {
  const ModelConfig& mc = cfg_.model;
  const Placement& place = model_.placement();
  for (size_t l = 0; l < r.expert_load.size(); ++l) {
    // MoE layer l is block first_dense_layers + l (the modules' blocks numbered on from n_layers)
    const bool again = recomputes_layer(cfg_.train.recompute, cfg_.train.recompute_layers, mc.first_dense_layers,
                                        mc.first_dense_layers + int(l));
    for (size_t e = 0; e < r.expert_load[l].size(); ++e) {
      load_flat_[l * r.expert_load[l].size() + e] += r.expert_load[l][e];
      const int owner = place.expert_owner(int(e));
      const double rows = double(r.expert_load[l][e]);
      if (owner == place.at().expert_rank) continue;
      local->rows_off_rank += rows, local->rows_off_rank_again += again ? rows : 0;
      if (model_.dispatcher()->same_node(owner)) continue;
      local->rows_off_node += rows, local->rows_off_node_again += again ? rows : 0;
    }
  }
}

void StageRunner::train_step(DataBlend& data, int64_t first_sample, float loss_scale, StepLocal* local) {
  const ModelConfig& mc = cfg_.model;
  const int M = cfg_.parallel.micro_batches, stage = g_.pipe->rank();
  model_.begin_step();
  be_.zero(model_.fp8_counts(), 2 * sizeof(uint64_t));
  losses_ = Tensor::zeros(be_, DType::f64, {M, slots()});
  load_flat_.assign(size_t(moe_layers_ * mc.moe.n_experts), 0);
  sample(data, uint64_t(cfg_.train.seed), first_sample, 0, M, true);
  upload_batches(M, true);
  *local = StepLocal{};
  if (v_shape_) {
    train_step_v(loss_scale, local);
    return;
  }
  std::vector<StageRun> runs(static_cast<size_t>(M));

  // Multi-token prediction: the first stage embeds the modules' tokens; the embeddings travel to
  // the last stage with the activations, one message per hop (a middle stage passes them on), and
  // their gradient comes back with the activations' gradients. The messages between two stages
  // stay one per micro-batch and direction, as without the modules: nothing new to match (the
  // NCCL communicator posts a stage's sends together with its next receive).
  const int64_t msg = (1 + depth_) * act_;
  std::vector<Tensor> sent(2 * size_t(M));  // the messages built here (send()), alive until sent
  Releaser releaser(*g_.pipe, runs, sent);
  // received: the op's input is in already (a pair receives both of its inputs first).
  auto forward = [&](int mb, bool received) {
    releaser.poll();
    if (!first_ && !received) recv(x_in_.f32(), msg, stage - 1, 2 * mb, local);
    const trace::Span span("forward", "compute", mb);
    runs[size_t(mb)] = forward_micro_batch(mb, first_ ? nullptr : x_in_.f32(),
                                           last_ && !first_ && depth_ > 0 ? x_in_.f32() + act_ : nullptr, loss_scale, 0);
    if (!last_) {
      const float* emb = depth_ == 0 ? nullptr : first_ ? runs[size_t(mb)].mtp_output() : x_in_.f32() + act_;
      releaser.sending(send(sent[2 * size_t(mb)], runs[size_t(mb)].output(), emb, depth_ * act_, stage + 1, 2 * mb),
                       size_t(mb), 2 * size_t(mb));
    }
    count_loads(runs[size_t(mb)].result(), local);
  };
  // The step's last backward on this stage makes each layer's gradients final as it passes it; under
  // ZB1P the last weight op (micro-batch M - 1's: they run in order), the backwards leaving their
  // weight gradients to them (Transformer::StageWeights, holding copies of what they read: the
  // micro-batch's state goes at its backward, as in 1F1B).
  const bool zb = cfg_.parallel.pipeline_schedule == PipelineSchedule::zb1p, paired = cfg_.parallel.pair_micro_batches;
  const int P = g_.pipe->size();
  const std::vector<PipelineOp> ops = zb       ? zb1p(P, stage, M, paired)
                                      : paired ? one_f_one_b_paired(P, stage, M)
                                               : one_f_one_b(P, stage, M);
  std::vector<StageWeights> weights(zb ? size_t(M) : 0);
  // The head's input gradient from a last stage of no block travels in FP32 (Placement::head_alone).
  const bool head_alone = model_.placement().head_alone(), full_in = head_alone && stage + 1 == P - 1;
  int last_backward = -1;
  for (const PipelineOp& op : ops)
    if (op.kind == PipeOpKind::backward || op.kind == PipeOpKind::forward_backward)
      last_backward = op.kind == PipeOpKind::backward ? op.micro_batch : op.backward_micro_batch;
  auto backward = [&](int mb, bool received) {
    releaser.poll();
    if (!last_ && !received) recv(dy_in_.f32(), msg, stage + 1, 2 * mb + 1, local, full_in);
    const bool mtp_in = depth_ > 0 && first_ && !last_;
    const bool final = sync_ && mb == last_backward && !zb;
    {
      const trace::Span span("backward", "compute", mb);
      model_.stage_backward(runs[size_t(mb)], last_ ? nullptr : dy_in_.f32(), mtp_in ? dy_in_.f32() + act_ : nullptr,
                            final ? post_layer_ : std::function<void(int)>{}, zb ? &weights[size_t(mb)] : nullptr);
    }
    if (final && !tied_) sync_->post_rest(model_.store());
    if (!first_) {
      const float* demb = depth_ == 0 ? nullptr : last_ ? runs[size_t(mb)].mtp_input_grad() : dy_in_.f32() + act_;
      releaser.sending(
          send(sent[2 * size_t(mb) + 1], runs[size_t(mb)].input_grad(), demb, depth_ * act_, stage - 1, 2 * mb + 1,
               false, last_ && head_alone),
          size_t(mb), 2 * size_t(mb) + 1);
    }
    releaser.backward_done(size_t(mb));
  };
  auto weight = [&](int mb) {
    releaser.poll();
    const bool last_weight = sync_ && mb == M - 1;
    {
      const trace::Span span("weight", "compute", mb);
      weights[size_t(mb)].run(last_weight ? post_layer_ : std::function<void(int)>{});
    }
    if (last_weight && !tied_) sync_->post_rest(model_.store());
  };
  // A pair (parallel.pair_micro_batches): both inputs received, then the forward on this thread and
  // the backward on a second one, switching at the expert exchanges (parallel/pass_pair.h).
  auto pair = [&](int fmb, int bmb) {
    releaser.poll();
    if (!first_) recv(x_in_.f32(), msg, stage - 1, 2 * fmb, local);
    if (!last_) recv(dy_in_.f32(), msg, stage + 1, 2 * bmb + 1, local, full_in);
    PassPair::run([&] { forward(fmb, true); }, [&] { backward(bmb, true); }, [this] { be_.enter_thread(); });
  };
  for (const PipelineOp& op : ops) {
    switch (op.kind) {
      case PipeOpKind::forward: forward(op.micro_batch, false); break;
      case PipeOpKind::backward: backward(op.micro_batch, false); break;
      case PipeOpKind::weight: weight(op.micro_batch); break;
      case PipeOpKind::forward_backward: pair(op.micro_batch, op.backward_micro_batch); break;
    }
  }
  wait_sends();
  tie_head();
}

// Once both gradients of the tied head are final (the pipeline's messages all delivered).
void StageRunner::tie_head() {
  if (!tied_) return;
  model_.tie_head_gradient();  // (the pipeline group's send and receive, traced as its others)
  if (sync_) sync_->post_rest(model_.store());
}

// DualPipeV (parallel/pipeline_schedule.h) on rank r of P: phase 0 runs chunk 0 of the rank (the
// V's way down: from rank r - 1 to r + 1), phase 1 its chunk 1 (the way back: from r + 1 to
// r - 1). Rank P - 1 turns the V: its phase-1 forward reads its own phase-0 output, its phase-0
// backward its own phase-1 input gradient; rank 0 embeds (phase 0) and ends the model (phase 1:
// the head, the loss and the multi-token prediction modules, whose embeddings stay on the rank;
// with parallel.mtp_own_stage the modules alone, the head and the loss on rank 1's phase 1).
// The ops are dualpipev_as_run's: an F&B its backward, then its forward (not overlapped), every
// backward whole (the weight gradient not split from it) and no weight op.
void StageRunner::train_step_v(float loss_scale, StepLocal* local) {
  const int M = cfg_.parallel.micro_batches, P = g_.pipe->size(), r = g_.pipe->rank();
  // A micro-batch's two states (phase 0's chunk, phase 1's), [phase x M + mb]; phase 1's is kept
  // until phase 0's backward, which on the turn reads its input gradient and on rank 0 its
  // modules' embeddings' gradient.
  std::vector<StageRun> runs(2 * size_t(M));
  auto run_of = [&](int phase, int mb) -> StageRun& { return runs[size_t(phase * M + mb)]; };
  std::vector<Tensor> sent(4 * size_t(M));
  Releaser releaser(*g_.pipe, runs, sent);
  // One tag per micro-batch, phase and direction (and one `sent` slot).
  auto tag = [](int mb, int phase, bool back) { return 4 * mb + 2 * phase + (back ? 1 : 0); };
  // The V's messages: phase 0's forward and phase 1's backward go up the ranks (from r - 1 to
  // r + 1), the others down; a peer outside [0, P) is an end of the V (the turn, the embedding,
  // the loss). take: the op's input from its peer into buf, or `at_end` there; give: its output
  // to its peer.
  auto way = [](int phase, bool back) { return (phase == 0) != back ? 1 : -1; };
  // The last chunk's input gradient where it holds no block: FP32 (Placement::head_alone).
  const bool head_alone = model_.placement().head_alone();
  auto take = [&](Tensor& buf, int phase, int mb, bool back, const float* at_end) -> const float* {
    const int from = r - way(phase, back);
    if (from < 0 || from >= P) return at_end;
    recv(buf.f32(), act_, from, tag(mb, phase, back), local, back && phase == 1 && from == 0 && head_alone);
    return buf.f32();
  };
  // (The head's chunk before the modules' sends its hf, which its backward frees: a copy.)
  auto give = [&](const float* a, int phase, int mb, bool back) {
    const int to = r + way(phase, back);
    if (to < 0 || to >= P) return;
    const size_t slot = size_t(tag(mb, phase, back));
    const bool hf = !back && model_.placement().chunk_head(phase) && !model_.placement().chunk_last(phase);
    const bool full = back && phase == 1 && r == 0 && head_alone;  // (rank 0's phase 1: the last chunk)
    releaser.sending(send(sent[slot], a, nullptr, 0, to, tag(mb, phase, back), hf, full), size_t(phase * M + mb), slot);
  };
  // An op's input: received from its peer, or this rank's own at the V's ends.
  auto forward_input = [&](int phase, int mb) {
    return take(x_in_, phase, mb, false, phase == 1 && r == P - 1 ? run_of(0, mb).output() : nullptr);
  };
  auto backward_input = [&](int phase, int mb) {
    return take(dy_in_, phase, mb, true, phase == 0 && r == P - 1 ? run_of(1, mb).input_grad() : nullptr);
  };
  auto forward = [&](int phase, int mb, const float* x) {
    releaser.poll();
    const trace::Span span("forward", "compute", mb);  // (either phase: scripts/trace.py reads the names)
    StageRun& run = run_of(phase, mb);
    if (phase == 1) releaser.pin(size_t(M + mb));
    run = forward_micro_batch(mb, x, phase == 1 && r == 0 && depth_ > 0 ? run_of(0, mb).mtp_output() : nullptr,
                              loss_scale, phase);
    give(run.output(), phase, mb, false);
    count_loads(run.result(), local);
  };
  // The data-parallel reduction: each chunk's layers are final after its phase's last backward
  // (micro-batch M - 1), the rest after the step's last backward.
  int backwards_left = 2 * M;
  auto backward = [&](int phase, int mb, const float* dy) {
    releaser.poll();
    const float* d_mtp = phase == 0 && r == 0 && depth_ > 0 ? run_of(1, mb).mtp_input_grad() : nullptr;
    const bool final = sync_ && mb == M - 1;
    StageRun& run = run_of(phase, mb);
    {
      const trace::Span span("backward", "compute", mb);
      model_.stage_backward(run, dy, d_mtp, final ? post_layer_ : std::function<void(int)>{});
    }
    if (sync_ && --backwards_left == 0 && !tied_) sync_->post_rest(model_.store());
    give(run.input_grad(), phase, mb, true);
    releaser.backward_done(size_t(phase * M + mb));
    if (phase == 0) releaser.unpin(size_t(M + mb));
  };
  for (const DualOp& op : dualpipev_as_run(P, r, M, cfg_.parallel.pair_micro_batches)) {
    if (op.kind == DualOpKind::forward) {
      forward(op.phase, op.micro_batch, forward_input(op.phase, op.micro_batch));
    } else if (op.kind == DualOpKind::backward) {
      backward(op.phase, op.micro_batch, backward_input(op.phase, op.micro_batch));
    } else {  // an F&B as a pair (parallel.pair_micro_batches): both inputs first, then the two passes
      const int fph = op.phase, bph = 1 - op.phase, fmb = op.micro_batch, bmb = op.backward_micro_batch;
      const float* dy = backward_input(bph, bmb);
      const float* x = forward_input(fph, fmb);
      PassPair::run([&] { forward(fph, fmb, x); }, [&] { backward(bph, bmb, dy); }, [this] { be_.enter_thread(); });
    }
  }
  wait_sends();
  tie_head();
}

StepTotals StageRunner::finish_step(const double* grad_sq) {
  const ModelConfig& mc = cfg_.model;
  const int M = cfg_.parallel.micro_batches;
  const double aux_weight = 1.0 / double(g_.data_host->size());
  if (losses_h_.size() < M * slots()) losses_h_ = HostBuffer<double>(be_, M * slots() + 1);
  double* losses = losses_h_.data();
  double* sq = losses + M * slots();
  uint64_t* counts = counts_h_.data();
  be_.download(losses, losses_.raw(), losses_.bytes());
  be_.download(counts, model_.fp8_counts(), 2 * sizeof(uint64_t));
  be_.download(sq, grad_sq, sizeof(double));
  be_.sync();  // the step's one synchronisation

  // Each micro-batch's loss as the model defines it (model/transformer.h, StepResult): the head
  // stage's mean cross-entropy plus the weighted aux losses of this stage's MoE layers.
  double loss_sum = 0, mtp_sum = 0, fp8[2] = {double(counts[0]), double(counts[1])};
  for (int mb = 0; mb < M; ++mb) {
    const double* s = losses + mb * slots();
    const int64_t denom = counted_all_[size_t(mb)];
    const double ce = head_ && denom > 0 ? s[0] / double(denom) : 0.0;
    double aux = 0;
    for (int64_t l = 0; l < moe_layers_; ++l) aux += s[1 + l];
    aux *= aux_weight;
    loss_sum += (ce + aux) / double(M);
    for (int k = 0; last_ && k < depth_; ++k) {
      const int64_t d = mtp_counted_all_[size_t(mb * depth_ + k)];
      mtp_sum += d > 0 ? s[1 + moe_layers_ + k] / double(d) / double(depth_ * M) : 0.0;
    }
  }
  g_.data_host->allreduce_sum(&mtp_sum, 1);
  g_.pipe_host->allreduce_sum(&mtp_sum, 1);
  // The loss (the head stage's; aux losses from every stage) and expert loads: summed over the replicas
  // and the stages; FP8 counts and the gradient norm over every rank.
  StepTotals t;
  g_.data_host->allreduce_sum(&loss_sum, 1);
  g_.pipe_host->allreduce_sum(&loss_sum, 1);
  g_.world_host->allreduce_sum(fp8, 2);
  g_.data_host->allreduce_sum(load_flat_.data(), int64_t(load_flat_.size()));
  g_.pipe_host->allreduce_sum(load_flat_.data(), int64_t(load_flat_.size()));
  t.grad_sq = sq[0];
  g_.world_host->allreduce_sum(&t.grad_sq, 1);
  t.loss = loss_sum, t.fp8_saturated = int64_t(fp8[0]), t.fp8_underflowed = int64_t(fp8[1]);
  t.mtp_loss = depth_ > 0 ? mtp_sum : NAN;
  t.expert_load.resize(static_cast<size_t>(moe_layers_));
  for (int64_t l = 0; l < moe_layers_; ++l)
    t.expert_load[size_t(l)].assign(load_flat_.begin() + l * mc.moe.n_experts, load_flat_.begin() + (l + 1) * mc.moe.n_experts);
  return t;
}

double StageRunner::validation_loss(DataBlend& data) {
  const int stage = g_.pipe->rank();
  const int64_t B = cfg_.eval.batches;
  sample(data, uint64_t(cfg_.train.seed) ^ 0x76616cull, 0, 0, B, false);  // fixed sequences, their own seed
  upload_batches(B, false);
  Tensor ce = Tensor::zeros(be_, DType::f64, {B});
  std::vector<int64_t> tokens(static_cast<size_t>(B), 0);
  const int P = g_.pipe->size();
  for (int64_t b = 0; v_shape_ && b < B; ++b) {  // down the V and back, one batch at a time
    const int64_t at = b * mbs_ * T_;
    const LossSlots slots{ce.data<double>() + b, nullptr};
    if (stage > 0) recv(x_in_.f32(), act_, stage - 1, 0, nullptr);
    const StageRun down = model_.stage_forward(tokens_.data<int32_t>() + at, targets_.data<int32_t>() + at,
                                               counted_[size_t(b)], mbs_, T_, stage > 0 ? x_in_.f32() : nullptr, false,
                                               slots, 1.0f, 0, 1.0, nullptr, 0);
    Tensor keep;
    if (stage < P - 1) {
      send(keep, down.output(), nullptr, 0, stage + 1, 0);
      wait_sends();
      recv(x_in_.f32(), act_, stage + 1, 1, nullptr);
    }
    const StageRun back = model_.stage_forward(tokens_.data<int32_t>() + at, targets_.data<int32_t>() + at,
                                               counted_[size_t(b)], mbs_, T_, stage < P - 1 ? x_in_.f32() : down.output(),
                                               false, slots, 1.0f, 0, 1.0, nullptr, 1);
    if (stage > 0) {
      send(keep, back.output(), nullptr, 0, stage - 1, 1);
      wait_sends();
    }
    if (head_) tokens[size_t(b)] = back.result().tokens;
  }
  for (int64_t b = 0; !v_shape_ && b < B; ++b) {
    if (!first_) recv(x_in_.f32(), act_, stage - 1, 0, nullptr);
    const int64_t at = b * mbs_ * T_;
    const StageRun run = model_.stage_forward(tokens_.data<int32_t>() + at, targets_.data<int32_t>() + at,
                                              counted_[size_t(b)], mbs_, T_, first_ ? nullptr : x_in_.f32(), false,
                                              {ce.data<double>() + b, nullptr});
    if (!last_) {
      Tensor keep;
      send(keep, run.output(), nullptr, 0, stage + 1, 0);
      wait_sends();
    }
    if (head_) tokens[size_t(b)] = run.result().tokens;
  }
  double sums[2] = {0, 0};  // sum of CE over tokens, tokens (the head stage's)
  if (head_) {
    const std::vector<double> h = to_host<double>(ce);  // the evaluation's one synchronisation
    for (int64_t b = 0; b < B; ++b) {
      const double mean = tokens[size_t(b)] > 0 ? h[size_t(b)] / double(tokens[size_t(b)]) : 0.0;
      sums[0] += mean * double(tokens[size_t(b)]), sums[1] += double(tokens[size_t(b)]);
    }
  } else {
    be_.sync();  // the uploaded batches are read before the host samples again
  }
  g_.data_host->allreduce_sum(sums, 2);
  g_.pipe_host->allreduce_sum(sums, 2);
  return sums[1] > 0 ? sums[0] / sums[1] : NAN;
}

}  // namespace fp8moe
