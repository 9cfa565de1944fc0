#include "app/stage_runner.h"

#include <algorithm>
#include <chrono>
#include <cmath>

#include "parallel/pipeline_schedule.h"

namespace fp8moe {

StageRunner::StageRunner(const Config& cfg, Transformer& model, Communicator& pipe, Communicator& data,
                         Communicator& world)
    : cfg_(cfg), model_(model), pipe_(pipe), data_(data), world_(world) {
  T_ = cfg.train.seq_len;
  mbs_ = cfg.train.global_batch / (cfg.parallel.micro_batches * data.size());
  act_ = mbs_ * T_ * cfg.model.d_model;
  first_ = model.placement().first_stage(), last_ = model.placement().last_stage();
  tokens_.resize(size_t(mbs_ * T_)), targets_.resize(size_t(mbs_ * T_));
  x_in_.resize(first_ ? 0 : size_t(act_)), dy_in_.resize(last_ ? 0 : size_t(act_));
}

// Each step's global batch is micro_batches micro-batches; the data-parallel replicas split each
// micro-batch: replica r computes its sequences [r * mbs, (r + 1) * mbs). Sample positions are
// global, so the step sees the same sequences on any number of replicas.
void StageRunner::sample(DataBlend& data, uint64_t seed, int64_t first_sample, int64_t mb) {
  const int64_t R = data_.size();
  for (int64_t i = 0; i < mbs_; ++i)
    data.sample(seed, first_sample + (mb * R + data_.rank()) * mbs_ + i, T_, &tokens_[i * T_], &targets_[i * T_]);
}

// Receives block; the time they block is the stage's share of the pipeline bubble. Sends are
// non-blocking, collected once a step.
void StageRunner::recv(float* buf, int peer, int tag, StepLocal* local) {
  const auto t0 = std::chrono::steady_clock::now();
  pipe_.recv(buf, act_, peer, tag);
  if (local) local->waited_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

StepTotals StageRunner::train_step(DataBlend& data, int64_t first_sample, float loss_scale, StepLocal* local) {
  const ModelConfig& mc = cfg_.model;
  const int M = cfg_.parallel.micro_batches, stage = pipe_.rank();
  const int64_t R = data_.size();
  const Placement& place = model_.placement();
  const int moe_layers = mc.n_layers - mc.first_dense_layers;
  double loss_sum = 0, fp8[2] = {0, 0};  // loss; FP8 saturated, underflowed
  std::vector<int64_t> load_flat(static_cast<size_t>(moe_layers * mc.moe.n_experts), 0);
  std::vector<StageRun> runs(static_cast<size_t>(M));
  *local = StepLocal{};

  auto forward = [&](int mb) {
    sample(data, uint64_t(cfg_.train.seed), first_sample, mb);
    // The micro-batch's counted tokens over all replicas: each replica's loss is its share of the
    // micro-batch's mean, so gradients have the 1-rank magnitudes and sum over the replicas.
    int64_t counted = std::count_if(targets_.begin(), targets_.end(), [&](int32_t t) { return t != mc.pad_id; });
    if (R > 1) data_.allreduce_sum(&counted, 1);
    if (!first_) recv(x_in_.data(), stage - 1, 2 * mb, local);
    runs[size_t(mb)] = model_.stage_forward(tokens_.data(), targets_.data(), mbs_, T_, first_ ? nullptr : x_in_.data(),
                                            true, loss_scale, counted, 1.0 / double(R));
    if (!last_) pipe_.isend(runs[size_t(mb)].output(), act_, stage + 1, 2 * mb);
    const StepResult& r = runs[size_t(mb)].result();
    loss_sum += r.loss / double(M);
    for (size_t l = 0; l < r.expert_load.size(); ++l)
      for (size_t e = 0; e < r.expert_load[l].size(); ++e) {
        load_flat[l * r.expert_load[l].size() + e] += r.expert_load[l][e];
        if (place.expert_owner(int(e)) != place.at().expert_rank) local->rows_off_rank += double(r.expert_load[l][e]);
      }
  };
  auto backward = [&](int mb) {
    if (!last_) recv(dy_in_.data(), stage + 1, 2 * mb + 1, local);
    model_.stage_backward(runs[size_t(mb)], last_ ? nullptr : dy_in_.data());
    if (!first_) pipe_.isend(runs[size_t(mb)].input_grad(), act_, stage - 1, 2 * mb + 1);
    fp8[0] += double(runs[size_t(mb)].result().fp8_saturated), fp8[1] += double(runs[size_t(mb)].result().fp8_underflowed);
  };
  for (const PipelineOp& op : one_f_one_b(pipe_.size(), stage, M)) op.forward ? forward(op.micro_batch) : backward(op.micro_batch);
  pipe_.wait_sends();
  runs.clear();

  // The loss (last stage; aux losses from every stage) and expert loads: summed over the replicas
  // and the stages; FP8 counts over every rank.
  StepTotals t;
  data_.allreduce_sum(&loss_sum, 1);
  pipe_.allreduce_sum(&loss_sum, 1);
  world_.allreduce_sum(fp8, 2);
  data_.allreduce_sum(load_flat.data(), int64_t(load_flat.size()));
  pipe_.allreduce_sum(load_flat.data(), int64_t(load_flat.size()));
  t.loss = loss_sum, t.fp8_saturated = int64_t(fp8[0]), t.fp8_underflowed = int64_t(fp8[1]);
  t.expert_load.resize(static_cast<size_t>(moe_layers));
  for (int l = 0; l < moe_layers; ++l)
    t.expert_load[size_t(l)].assign(load_flat.begin() + l * mc.moe.n_experts, load_flat.begin() + (l + 1) * mc.moe.n_experts);
  return t;
}

double StageRunner::validation_loss(DataBlend& data) {
  const int stage = pipe_.rank();
  double sums[2] = {0, 0};  // sum of CE over tokens, tokens (the last stage's)
  for (int b = 0; b < cfg_.eval.batches; ++b) {
    sample(data, uint64_t(cfg_.train.seed) ^ 0x76616cull, 0, b);  // fixed sequences, their own seed
    if (!first_) recv(x_in_.data(), stage - 1, 0, nullptr);
    const StageRun run = model_.stage_forward(tokens_.data(), targets_.data(), mbs_, T_, first_ ? nullptr : x_in_.data(), false);
    if (!last_) {
      pipe_.isend(run.output(), act_, stage + 1, 0);
      pipe_.wait_sends();
    } else {
      sums[0] += run.result().ce * double(run.result().tokens), sums[1] += double(run.result().tokens);
    }
  }
  data_.allreduce_sum(sums, 2);
  pipe_.allreduce_sum(sums, 2);
  return sums[1] > 0 ? sums[0] / sums[1] : NAN;
}

}  // namespace fp8moe
