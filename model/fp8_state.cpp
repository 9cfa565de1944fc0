#include "model/fp8_state.h"

#include "kernels/check.h"

namespace fp8moe {

Fp8State::Fp8State(Backend& be, const Fp8Config& cfg, ParamStore& store, const Fp8Groups& groups)
    : be_(be), cfg_(cfg), store_(store), groups_(groups) {
  if (groups_.tensor && groups_.tensor->size() == 1) groups_.tensor = nullptr;
  scaling_.resize(store.table().params.size());
  weights_.resize(store.table().params.size());
  counts_ = Tensor::zeros(be, DType::u64, {2});
}

Weight Fp8State::weight(const std::string& name) const {
  const int64_t i = store_.table().index_of(name);
  FP8MOE_ASSERT(i >= 0, "no parameter named ", name);
  return {store_.param(size_t(i)), store_.grad(size_t(i))};
}

LinearWeight Fp8State::linear(const std::string& name) const {
  LinearWeight l;
  static_cast<Weight&>(l) = weight(name);
  l.slot = size_t(store_.table().index_of(name));
  l.cls = store_.table().params[l.slot].linear;
  return l;
}

bool Fp8State::enabled(LinearClass cls) const {
  const Fp8Layers& on = cfg_.layers;
  const bool layer_on = (cls == LinearClass::attention && on.attention) || (cls == LinearClass::mlp && on.mlp) ||
                        (cls == LinearClass::experts && on.experts) ||
                        (cls == LinearClass::shared_experts && on.shared_experts);
  return layer_on && cfg_.recipe != Fp8Recipe::off;
}

LinearFp8 Fp8State::context(const LinearWeight& w, const Pass& pass) {
  LinearFp8 f;
  if (enabled(w.cls)) {
    f.cfg = &cfg_;
    f.state = &scaling_[w.slot];
    f.counts = counts();
    // A training pass and its recomputation use the step's FP8 weight; an evaluation quantizes
    // the current weights afresh and leaves the cache alone.
    if (pass.record || pass.recompute) f.weight = &weights_[w.slot], f.step = step_;
    // Per-tensor amax: over the tensor group (a split tensor's amax is the whole tensor's; the
    // quantization then does not depend on tp), and for delayed scaling also over the replicas.
    Communicator* tp = groups_.tensor;
    Communicator* g = w.cls == LinearClass::experts ? groups_.expert_data : groups_.data;
    if (!(cfg_.recipe == Fp8Recipe::delayed && g && g->size() > 1 && pass.record)) g = nullptr;
    if (tp || g)
      f.reduce = [tp, g](float* amax, int64_t n) {
        if (tp) tp->allreduce_max(amax, n);
        if (g) g->allreduce_max(amax, n);
      };
  }
  f.record = pass.record;
  f.reuse_last_scale = !pass.record && pass.recompute;
  f.backward_follows = pass.saving;
  return f;
}

std::map<std::string, HostLinearScaling> Fp8State::to_host() const {
  std::map<std::string, HostLinearScaling> out;
  const ParamTable& table = store_.table();
  for (size_t i = 0; i < table.params.size(); ++i) {
    if (!store_.holds(i) || !enabled(table.params[i].linear)) continue;
    const LinearScaling& s = scaling_[i];
    out[table.params[i].name] = {delayed_to_host(be_, s.x), delayed_to_host(be_, s.w), delayed_to_host(be_, s.dy)};
  }
  return out;
}

void Fp8State::from_host(const std::map<std::string, HostLinearScaling>& scaling) {
  for (LinearScaling& s : scaling_) s = LinearScaling{};
  for (const auto& [name, s] : scaling) {
    const int64_t i = store_.table().index_of(name);
    if (i < 0 || !store_.holds(size_t(i))) continue;
    scaling_[size_t(i)] = {delayed_from_host(be_, s.x), delayed_from_host(be_, s.w), delayed_from_host(be_, s.dy)};
  }
}

}  // namespace fp8moe
