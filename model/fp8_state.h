// The FP8 state of a rank's linear layers and the rule that turns it into each GEMM call's
// LinearFp8 (model/linear.h). Per linear weight the rank holds: its delayed-scaling state and its
// FP8 copy of the optimizer step (WeightCache); for the rank: the step, and the device
// [saturated, underflowed] counters every quantization of a training pass adds to.
//
// What a call quantizes depends on the pass it belongs to (Pass below), which every forward and
// backward takes as an argument: nothing here is toggled by hand.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "model/linear.h"
#include "model/param_store.h"
#include "parallel/communicator.h"

namespace fp8moe {

// What a forward (or backward) pass is for, as the FP8 linear layers see it.
struct Pass {
  // A training forward or a backward: delayed-scaling histories advance (their amax reduced over
  // the replicas), and the step's FP8 weights are used (quantized at their first use).
  bool record = false;
  // The recomputation of a block before its backward: the forward's scales and FP8 weights,
  // advancing nothing and counting nothing new.
  bool recompute = false;
  // A backward reads this forward's state (LinearFp8::backward_follows: blockwise FP8 keeps the
  // inputs' T x 1 copies for wgrad only then).
  bool saving = false;

  // A training forward; `kept`: its state is kept for the backward (the block is not recomputed).
  static Pass training(bool kept) { return {true, false, kept}; }
  static Pass recomputation() { return {false, true, true}; }
  // An evaluation or generation: the current scales, the weights quantized afresh, no cache.
  static Pass evaluation() { return {false, false, false}; }
  static Pass backward() { return {true, false, false}; }
  // train.recompute selective: a kept block's backward makes one of its layers' outputs again (MLA's
  // per-head queries, keys and values): the forward's scales and FP8 weights, nothing kept.
  static Pass rebuild() { return {false, true, false}; }
};

// A parameter's shard and its gradient (backend memory; nullptr where the rank does not hold it),
// resolved from its name once, when a layer is built.
struct Weight {
  const float* w = nullptr;
  float* g = nullptr;
};
// A linear layer's weight, and where its FP8 state is kept (its ParamTable index) and which
// fp8.layers class it belongs to.
struct LinearWeight : Weight {
  size_t slot = 0;
  LinearClass cls = LinearClass::none;
};

// The groups an FP8 amax is reduced over (not owned; nullptr: none).
struct Fp8Groups {
  Communicator* tensor = nullptr;       // per-tensor amax of a split tensor: over its shards
  Communicator* data = nullptr;         // delayed scaling: over the dense parameters' replicas
  Communicator* expert_data = nullptr;  // and over the routed experts' replicas
};

class Fp8State {
 public:
  Fp8State(Backend& be, const Fp8Config& cfg, ParamStore& store, const Fp8Groups& groups);

  // The views of parameter `name` (asserted to exist), and of a linear layer's weight.
  Weight weight(const std::string& name) const;
  LinearWeight linear(const std::string& name) const;

  // The next training pass belongs to a new optimizer step: every FP8 weight is quantized anew at
  // its first use and reused by the step's other micro-batches, its recomputations and dgrad.
  void begin_step() { ++step_; }
  uint64_t* counts() { return counts_.data<uint64_t>(); }  // device (2)

  // What linear layer `w`'s GEMMs of a `pass` need (FP32 GEMMs where FP8 is off for its class).
  LinearFp8 context(const LinearWeight& w, const Pass& pass);

  // The delayed-scaling states in host form by weight name (checkpoints): one entry per FP8
  // linear weight this rank holds (empty states where nothing was recorded yet). from_host
  // replaces every state; entries of weights this rank does not hold are ignored.
  std::map<std::string, HostLinearScaling> to_host() const;
  void from_host(const std::map<std::string, HostLinearScaling>& scaling);

 private:
  bool enabled(LinearClass cls) const;

  Backend& be_;
  const Fp8Config& cfg_;
  ParamStore& store_;
  Fp8Groups groups_;
  std::vector<LinearScaling> scaling_;  // per table index: the delayed-scaling state
  std::vector<WeightCache> weights_;    // per table index: the FP8 copy of the step
  int64_t step_ = 0;
  Tensor counts_;                       // (2) uint64
};

}  // namespace fp8moe
