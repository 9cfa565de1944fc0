// The parameters and gradients of this rank's share of the model, in backend memory: one flat
// buffer of each, and a view per parameter into it (docs/ARCHITECTURE.md, "Tensors and backends").
//
// Layout: the trainable dense parameters this rank holds, in table order; then the trainable
// routed-expert parameters; then the rest (the router biases, which a rule updates). So the
// parameters one data-parallel group synchronises are one contiguous range (a Segment) of both
// buffers: the gradient reduction and the ZeRO-1 weight all-gather run on that range as it is,
// with no packing. A parameter's view is its shard (Placement::shard), row-major (rows, cols).
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/backend.h"
#include "model/param_table.h"

namespace fp8moe {

struct Segment {
  int64_t begin = 0, end = 0;  // element range of the flat buffers
  int64_t size() const { return end - begin; }
};

class ParamStore {
 public:
  // Allocates both buffers (gradients zeroed) and initialises this rank's shard of every parameter
  // from (seed, name, element index) (model/param_table.h), uploaded parameter by parameter.
  ParamStore(Backend& be, const ParamTable& table, const std::vector<Shard>& shards, uint64_t seed);

  Backend& backend() const { return *be_; }
  const ParamTable& table() const { return *table_; }
  bool holds(size_t i) const { return offset_[i] >= 0; }
  const Shard& shard(size_t i) const { return shards_[i]; }
  int64_t offset(size_t i) const { return offset_[i]; }  // into the flat buffers; -1 when not held
  // The shard of parameter i and its gradient (device memory; nullptr when not held).
  float* param(size_t i) { return holds(i) ? params_.f32() + offset_[i] : nullptr; }
  const float* param(size_t i) const { return holds(i) ? params_.f32() + offset_[i] : nullptr; }
  float* grad(size_t i) { return holds(i) ? grads_.f32() + offset_[i] : nullptr; }
  const float* grad(size_t i) const { return holds(i) ? grads_.f32() + offset_[i] : nullptr; }
  TensorView param_view(size_t i) const;

  Tensor& params() { return params_; }
  Tensor& grads() { return grads_; }
  // The trainable dense and the trainable expert parameters this rank holds.
  Segment dense() const { return dense_; }
  Segment experts() const { return experts_; }
  // Parameter indices of a segment, in layout order.
  const std::vector<size_t>& dense_members() const { return dense_members_; }
  const std::vector<size_t>& expert_members() const { return expert_members_; }

  void zero_grads();

  // Host copies (tests, tools, generation): one download and synchronisation each.
  std::vector<float> param_to_host(size_t i) const;
  std::vector<float> grad_to_host(size_t i) const;
  std::vector<std::vector<float>> params_to_host() const;
  std::vector<std::vector<float>> grads_to_host() const;
  // Replaces parameter i's shard (values.size() == its numel), or its gradient.
  void param_from_host(size_t i, const std::vector<float>& values);
  void grad_from_host(size_t i, const std::vector<float>& values);

 private:
  Backend* be_;
  const ParamTable* table_;
  std::vector<Shard> shards_;
  std::vector<int64_t> offset_;
  Tensor params_, grads_;
  Segment dense_, experts_;
  std::vector<size_t> dense_members_, expert_members_;
};

}  // namespace fp8moe
