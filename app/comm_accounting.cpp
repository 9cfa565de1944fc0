#include "app/comm_accounting.h"

#include <cmath>
#include <cstdio>

namespace fp8moe {

CommAccounting::CommAccounting(const Config& cfg, const Transformer& model, ExpertDispatcher* dispatcher,
                               const TrainGroups& groups, int64_t sequences)
    : cfg_(cfg), model_(model), g_(groups),
      counted_{groups.tensor, groups.expert, groups.data, groups.expert_data, groups.pipeline}, sequences_(sequences) {
  for (size_t i = 0; i < model.table().params.size(); ++i)
    if (model.holds(i) && model.table().params[i].trainable)
      (model.table().params[i].expert >= 0 ? expert_bytes_ : dense_bytes_) += double(model.shard(i).numel()) * 4;
  dispatcher_ = dispatcher;
}

void CommAccounting::start_step() {
  for (const GroupPair& c : counted_) c.reset_bytes_sent();
  if (dispatcher_) dispatcher_->reset_node_bytes();
}

// The analytical count, per step: model/plan_model.h's analytic_comm_bytes (README
// "Communication"), which `fp8moe plan` also prints; here for this rank's stage, summed over the ranks.
void CommAccounting::end_step(const StepLocal& step) {
  const double rows_off = step.rows_off_rank, rows_off_node = step.rows_off_node;
  const Placement& place = model_.placement();
  CommShape shape;
  shape.model = &cfg_.model;
  shape.tensor = g_.tensor.size(), shape.expert = g_.expert.size(), shape.data = g_.data.size();
  shape.expert_data = g_.expert_data.size(), shape.pipeline = g_.pipeline.size();
  shape.tokens = double(sequences_ * cfg_.train.seq_len), shape.micro_batches = cfg_.parallel.micro_batches;
  shape.first = place.first_stage(), shape.last = place.last_stage();
  shape.mtp_alone = place.mtp_alone(), shape.head = place.head_stage(), shape.head_alone = place.head_alone();
  shape.layer_begin = place.layer_begin(), shape.layer_end = place.layer_end();
  if (place.chunks() == 2) {
    shape.v_shape = true, shape.turn = place.at().stage == place.at().stages - 1;
    shape.layer_begin2 = place.layer_begin(1), shape.layer_end2 = place.layer_end(1);
  }
  shape.local_experts = place.local_experts();
  shape.dense_bytes = dense_bytes_, shape.expert_bytes = expert_bytes_, shape.rows_off_rank = rows_off;
  shape.fp8 = cfg_.fp8.recipe == Fp8Recipe::off ? nullptr : &cfg_.fp8, shape.activations = cfg_.train.activations;
  shape.moe_gates = cfg_.train.moe_gates, shape.recompute = cfg_.train.recompute;
  shape.recompute_layers = &cfg_.train.recompute_layers;
  shape.grad_reduce = cfg_.optim.grad_reduce, shape.rows_off_node = rows_off_node;
  shape.rows_off_rank_again = step.rows_off_rank_again, shape.rows_off_node_again = step.rows_off_node_again;
  // The relay's rows, as this rank's plans of the step counted them (parallel/expert_dispatch.h).
  const bool relay = dispatcher_ && dispatcher_->relays();
  if (relay) {
    const ExpertDispatcher::RelayRows& y = dispatcher_->relay_rows();
    shape.relay = true;
    shape.relay_across = double(y.across), shape.relay_forwarded = double(y.relayed);
    const ExpertDispatcher::RelayRows& again = model_.relay_rows_again();
    shape.relay_across_again = double(again.across), shape.relay_forwarded_again = double(again.relayed);
    shape.remote_ranks = dispatcher_->remote_ranks();
  }
  const std::array<double, 5> expected = analytic_comm_bytes(shape);
  double local[18] = {};
  for (int g = 0; g < 5; ++g) local[g] = double(counted_[size_t(g)].bytes_sent()), local[5 + g] = expected[size_t(g)];
  // The rows by node (model/plan_model.h expert_rows_by_node).
  if (dispatcher_) {
    const std::array<double, 2> by_node = expert_rows_by_node(shape);
    local[10] = double(dispatcher_->node_bytes().in_node), local[11] = double(dispatcher_->node_bytes().across);
    local[12] = by_node[0], local[13] = by_node[1];
    local[14] = dispatcher_->spans_nodes() ? 1 : 0;
    if (relay) {  // (each plan routes this micro-batch's tokens once)
      local[15] = shape.relay_across, local[16] = shape.relay_forwarded;
      local[17] = double(dispatcher_->relay_rows().plans) * shape.tokens;
    }
  }
  g_.world->allreduce_sum(local, 18);
  for (int g = 0; g < 5; ++g) measured_[size_t(g)] = local[g], expected_[size_t(g)] = local[5 + g];
  node_measured_ = {local[10], local[11]}, node_expected_ = {local[12], local[13]};
  spans_nodes_ = local[14] > 0;
  relay_ = {local[15], local[16], local[17]};
}

void CommAccounting::print() const {
  std::printf("communication of the last step, bytes summed over the ranks (README \"Communication\"):\n"
              "  group      measured    analytical  ratio\n");
  for (size_t g = 0; g < 5; ++g)
    if (expected_[g] > 0 || measured_[g] > 0)
      std::printf("  %-5s  %12.0f  %12.0f  %5.3f\n", kCommGroupNames[g], measured_[g], expected_[g],
                  expected_[g] > 0 ? measured_[g] / expected_[g] : NAN);
  if (!spans_nodes_) return;
  std::printf("  the expert rows of ep (runtime.ranks_per_node), in the same node and across nodes:\n");
  const char* names[2] = {"ep-in", "ep-x"};
  for (size_t k = 0; k < 2; ++k)
    std::printf("  %-5s  %12.0f  %12.0f  %5.3f\n", names[k], node_measured_[k], node_expected_[k],
                node_expected_[k] > 0 ? node_measured_[k] / node_expected_[k] : NAN);
  if (relay_[2] > 0)
    std::printf("  relay (runtime.node_dedup), per exchange: %.0f token rows across nodes for %.0f routed tokens "
                "(%.3f per token), %.0f rows forwarded in the nodes\n",
                relay_[0], relay_[2], relay_[0] / relay_[2], relay_[1]);
}

}  // namespace fp8moe
