#include "model/param_store.h"

namespace fp8moe {

ParamStore::ParamStore(Backend& be, const ParamTable& table, const std::vector<Shard>& shards, uint64_t seed)
    : be_(&be), table_(&table), shards_(shards), offset_(table.params.size(), -1) {
  FP8MOE_ASSERT(shards.size() == table.params.size(), "ParamStore: ", shards.size(), " shards for ",
                table.params.size(), " parameters");
  int64_t off = 0;
  auto place = [&](auto&& select, std::vector<size_t>* members) {
    const int64_t begin = off;
    for (size_t i = 0; i < table.params.size(); ++i)
      if (shards[i].held() && select(table.params[i])) {
        offset_[i] = off, off += shards[i].numel();
        if (members) members->push_back(i);
      }
    return Segment{begin, off};
  };
  dense_ = place([](const ParamSpec& p) { return p.trainable && p.expert < 0; }, &dense_members_);
  experts_ = place([](const ParamSpec& p) { return p.trainable && p.expert >= 0; }, &expert_members_);
  place([](const ParamSpec& p) { return !p.trainable; }, nullptr);
  params_ = Tensor(be, DType::f32, {off});
  grads_ = Tensor::zeros(be, DType::f32, {off});
  std::vector<float> host;
  for (size_t i = 0; i < table.params.size(); ++i) {
    if (!holds(i)) continue;
    host.resize(size_t(shards[i].numel()));
    init_shard(table.params[i], seed, shards[i], host.data());
    to_device(be, host, param(i));  // from pageable memory: `host` may be reused when it returns
  }
}

TensorView ParamStore::param_view(size_t i) const {
  return {const_cast<float*>(param(i)), DType::f32, {shards_[i].rows, shards_[i].cols}, be_->kind()};
}

void ParamStore::zero_grads() {
  if (grads_.bytes() > 0) be_->zero(grads_.raw(), grads_.bytes());
}

std::vector<float> ParamStore::param_to_host(size_t i) const {
  return holds(i) ? to_host(*be_, param(i), shards_[i].numel()) : std::vector<float>();
}

std::vector<float> ParamStore::grad_to_host(size_t i) const {
  return holds(i) ? to_host(*be_, grad(i), shards_[i].numel()) : std::vector<float>();
}

std::vector<std::vector<float>> ParamStore::params_to_host() const {
  std::vector<std::vector<float>> out;
  for (size_t i = 0; i < shards_.size(); ++i) out.push_back(param_to_host(i));
  return out;
}

std::vector<std::vector<float>> ParamStore::grads_to_host() const {
  std::vector<std::vector<float>> out;
  for (size_t i = 0; i < shards_.size(); ++i) out.push_back(grad_to_host(i));
  return out;
}

void ParamStore::param_from_host(size_t i, const std::vector<float>& values) {
  FP8MOE_ASSERT(int64_t(values.size()) == (holds(i) ? shards_[i].numel() : 0), table_->params[i].name, ": ",
                values.size(), " values for a shard of ", shards_[i].numel());
  if (holds(i)) to_device(*be_, values, param(i));
}

void ParamStore::grad_from_host(size_t i, const std::vector<float>& values) {
  FP8MOE_ASSERT(int64_t(values.size()) == (holds(i) ? shards_[i].numel() : 0), table_->params[i].name, ": ",
                values.size(), " gradients for a shard of ", shards_[i].numel());
  if (holds(i)) to_device(*be_, values, grad(i));
}

}  // namespace fp8moe
