#include "model/data_parallel.h"

#include <algorithm>

namespace fp8moe {

DataParallel::DataParallel(const ParamTable& table, Communicator& group, bool zero)
    : table_(table), group_(group), zero_(zero && group.size() > 1) {
  const int R = group.size();
  counts_.assign(size_t(R), 0);
  for (int r = 0; r < R; ++r)
    for (const ParamSpec& p : table.params)
      if (p.trainable) {
        const RowRange o = zero_ ? replica_rows(p.rows, r, R) : RowRange{0, p.rows};
        counts_[size_t(r)] += (o.end - o.begin) * p.cols;
      }
}

std::vector<RowRange> DataParallel::owned() const {
  std::vector<RowRange> o;
  if (zero_)
    for (const ParamSpec& p : table_.params) o.push_back(replica_rows(p.rows, group_.rank(), group_.size()));
  return o;
}

// Bucket layout with ZeRO: replica 0's rows of every trainable parameter (table order), then
// replica 1's, ...; without: every trainable parameter whole, in table order.
void DataParallel::pack(const std::vector<std::vector<float>>& t, bool all_replicas) {
  const int R = group_.size();
  int64_t total = 0;
  for (int64_t c : counts_) total += c;
  float* out = nullptr;
  if (all_replicas) {
    bucket_.resize(size_t(zero_ ? total : counts_[0]));
    out = bucket_.data();
  } else {
    mine_.resize(size_t(counts_[size_t(group_.rank())]));
    out = mine_.data();
  }
  for (int r = 0; r < (zero_ ? R : 1); ++r) {
    if (!all_replicas && r != group_.rank()) continue;
    for (size_t i = 0; i < table_.params.size(); ++i) {
      const ParamSpec& p = table_.params[i];
      if (!p.trainable) continue;
      const RowRange o = zero_ ? replica_rows(p.rows, r, R) : RowRange{0, p.rows};
      out = std::copy_n(t[i].data() + o.begin * p.cols, (o.end - o.begin) * p.cols, out);
    }
  }
}

void DataParallel::unpack(std::vector<std::vector<float>>& t, bool all_replicas) {
  const int R = group_.size();
  const float* in = all_replicas ? bucket_.data() : mine_.data();
  for (int r = 0; r < (zero_ ? R : 1); ++r) {
    if (!all_replicas && r != group_.rank()) continue;
    for (size_t i = 0; i < table_.params.size(); ++i) {
      const ParamSpec& p = table_.params[i];
      if (!p.trainable) continue;
      const RowRange o = zero_ ? replica_rows(p.rows, r, R) : RowRange{0, p.rows};
      const int64_t n = (o.end - o.begin) * p.cols;
      std::copy_n(in, n, t[i].data() + o.begin * p.cols);
      in += n;
    }
  }
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

std::function<void(double*)> DataParallel::norm_reduce() {
  if (!zero_) return {};
  return [this](double* sq) { group_.allreduce_sum(sq, 1); };
}

}  // namespace fp8moe
