#include "model/data_parallel.h"

#include <algorithm>

namespace fp8moe {

DataParallel::DataParallel(const ParamTable& table, Communicator& group, bool zero, std::vector<bool> include)
    : table_(table), group_(group), zero_(zero && group.size() > 1), include_(std::move(include)) {
  for (size_t i = 0; i < table.params.size(); ++i) include_[i] = include_[i] && table.params[i].trainable;
  const int R = group.size();
  counts_.assign(size_t(R), 0);
  for (int r = 0; r < R; ++r)
    for (size_t i = 0; i < table.params.size(); ++i)
      if (include_[i]) {
        const ParamSpec& p = table.params[i];
        const RowRange o = zero_ ? replica_rows(p.rows, r, R) : RowRange{0, p.rows};
        counts_[size_t(r)] += (o.end - o.begin) * p.cols;
      }
}

RowRange DataParallel::owned(size_t i) const {
  const ParamSpec& p = table_.params[i];
  return zero_ ? replica_rows(p.rows, group_.rank(), group_.size()) : RowRange{0, p.rows};
}

// Bucket layout with ZeRO: replica 0's rows of every trainable parameter (table order), then
// replica 1's, ...; without: every trainable parameter whole, in table order. Calls
// fn(parameter, rows) for each block in that order: every replica's, or this replica's only.
template <class Fn>
void DataParallel::for_each_block(bool all_replicas, Fn&& fn) const {
  const int R = group_.size();
  for (int r = 0; r < (zero_ ? R : 1); ++r) {
    if (!all_replicas && zero_ && r != group_.rank()) continue;
    for (size_t i = 0; i < table_.params.size(); ++i)
      if (include_[i]) fn(i, zero_ ? replica_rows(table_.params[i].rows, r, R) : RowRange{0, table_.params[i].rows});
  }
}

void DataParallel::pack(const std::vector<std::vector<float>>& t, bool all_replicas) {
  std::vector<float>& buf = all_replicas ? bucket_ : mine_;
  int64_t total = 0;
  for (int64_t c : counts_) total += c;
  buf.resize(size_t(all_replicas && zero_ ? total : counts_[size_t(zero_ ? group_.rank() : 0)]));
  float* out = buf.data();
  for_each_block(all_replicas, [&](size_t i, RowRange o) {
    const int64_t cols = table_.params[i].cols;
    out = std::copy_n(t[i].data() + o.begin * cols, (o.end - o.begin) * cols, out);
  });
}

void DataParallel::unpack(std::vector<std::vector<float>>& t, bool all_replicas) {
  const float* in = all_replicas ? bucket_.data() : mine_.data();
  for_each_block(all_replicas, [&](size_t i, RowRange o) {
    const int64_t cols = table_.params[i].cols, n = (o.end - o.begin) * cols;
    std::copy_n(in, n, t[i].data() + o.begin * cols);
    in += n;
  });
}

void DataParallel::reduce_gradients(std::vector<std::vector<float>>& grads) {
  if (group_.size() == 1) return;
  pack(grads, true);
  if (zero_) {
    mine_.resize(size_t(counts_[size_t(group_.rank())]) + 1);
    group_.reduce_scatterv_sum(bucket_.data(), mine_.data(), counts_.data());
    unpack(grads, false);
  } else {
    group_.allreduce_sum(bucket_.data(), int64_t(bucket_.size()));
    unpack(grads, true);
  }
}

void DataParallel::gather_weights(std::vector<std::vector<float>>& params) {
  if (!zero_) return;
  pack(params, false);
  int64_t total = 0;
  for (int64_t c : counts_) total += c;
  bucket_.resize(size_t(total) + 1);  // + 1: never a null buffer
  group_.allgatherv(mine_.data(), bucket_.data(), counts_.data());
  unpack(params, true);
}


}  // namespace fp8moe

namespace fp8moe {
namespace {
std::vector<bool> select(const ParamTable& t, const std::vector<Shard>& shards, bool experts) {
  std::vector<bool> v(t.params.size());
  for (size_t i = 0; i < v.size(); ++i) v[i] = shards[i].held() && ((t.params[i].expert >= 0) == experts);
  return v;
}
ParamTable localise(ParamTable t, const std::vector<Shard>& shards) {
  for (size_t i = 0; i < t.params.size(); ++i) t.params[i].rows = shards[i].rows, t.params[i].cols = shards[i].cols;
  return t;
}
}  // namespace

ReplicaSync::ReplicaSync(const ParamTable& table, const std::vector<Shard>& shards, Communicator& data,
                         Communicator& expert_data, Communicator& world, int tensor_rank, bool zero)
    : table_(table),
      shards_(shards),
      local_(localise(table, shards)),
      world_(world),
      tensor_rank_(tensor_rank),
      dense_(local_, data, zero, select(table, shards, false)),
      experts_(local_, expert_data, zero, select(table, shards, true)) {}

std::vector<RowRange> ReplicaSync::owned() const {
  std::vector<RowRange> o;
  for (size_t i = 0; i < table_.params.size(); ++i)
    o.push_back(!shards_[i].held() ? RowRange{0, 0}
                : dense_.includes(i) ? dense_.owned(i)
                : experts_.includes(i) ? experts_.owned(i)
                                       : RowRange{0, shards_[i].rows});
  return o;
}

std::vector<RowRange> ReplicaSync::write_rows() const {
  std::vector<RowRange> w;
  for (size_t i = 0; i < table_.params.size(); ++i) {
    const Shard& sh = shards_[i];
    const Communicator& g = table_.params[i].expert >= 0 ? experts_.group() : dense_.group();
    const RowRange r = replica_rows(sh.rows, g.rank(), g.size());
    w.push_back(writes(i) ? RowRange{sh.r0 + r.begin, sh.r0 + r.end} : RowRange{0, 0});
  }
  return w;
}

bool ReplicaSync::writes(size_t i) const {
  // The tensor group holds identical copies of a parameter it does not split: rank 0 writes it.
  return shards_[i].held() && (table_.params[i].tp != TpSplit::none || tensor_rank_ == 0);
}

std::vector<RowRange> ReplicaSync::moment_write_rows() const {
  if (!zero()) return write_rows();
  std::vector<RowRange> w = owned();
  for (size_t i = 0; i < w.size(); ++i)
    w[i] = writes(i) ? RowRange{shards_[i].r0 + w[i].begin, shards_[i].r0 + w[i].end} : RowRange{0, 0};
  return w;
}

void ReplicaSync::reduce_gradients(std::vector<std::vector<float>>& grads) {
  dense_.reduce_gradients(grads);
  experts_.reduce_gradients(grads);
}

void ReplicaSync::gather_weights(std::vector<std::vector<float>>& params) {
  dense_.gather_weights(params);
  experts_.gather_weights(params);
}

AdamW::NormReduce ReplicaSync::norm() {
  return [this](const std::vector<double>& sq) {
    double total = 0;
    for (size_t i = 0; i < sq.size(); ++i)
      if ((dense_.counts_in_norm(i) || experts_.counts_in_norm(i)) &&
          (table_.params[i].tp != TpSplit::none || tensor_rank_ == 0))  // tp-replicated: counted once
        total += sq[i];
    world_.allreduce_sum(&total, 1);
    return total;
  };
}

}  // namespace fp8moe
