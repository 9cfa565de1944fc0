// The routings the router and MoE op cases share (test_router.cpp, test_moe_ops.cpp): router
// configurations that switch code paths, logits without near-ties, and a routing's buffers in a
// backend's memory and on the host.
#pragma once

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include "kernels/router.h"
#include "tests/kernels/backend_cases.h"

namespace fp8moe::test {

struct RouterCase {
  int64_t N, E, k;
  bool sigmoid;
  int64_t groups, topk_group;
  bool normalise;
  double scaling;
  int64_t capacity;
};

inline RouterRule rule_of(const RouterCase& s) {
  RouterRule r;
  r.top_k = s.k, r.sigmoid = s.sigmoid, r.n_group = s.groups, r.topk_group = s.topk_group;
  r.normalise = s.normalise, r.scaling = s.scaling, r.capacity = s.capacity;
  return r;
}

inline const RouterCase kRouterCases[] = {
    {1, 8, 2, true, 1, 1, true, 1.0, 1 << 30},         // one token
    {333, 16, 4, true, 4, 2, true, 2.5, 1 << 30},      // node-limited groups, scaled gates
    {500, 32, 8, true, 8, 4, false, 1.0, 100},         // capacity drops, gates not normalised
    {64, 8, 2, false, 1, 1, false, 1.0, 20},           // softmax, drops
    {64, 8, 2, false, 2, 1, true, 1.0, 1 << 30},       // softmax with groups
    {200, 256, 8, true, 8, 4, true, 2.5, 200 * 8},     // DeepSeek-V3's router
    {100, 1024, 8, false, 1, 1, true, 1.0, 50},        // the most experts the CUDA router takes
    {700, 64, 6, true, 1, 1, true, 1.0, 0},            // capacity 0: every assignment dropped
    {0, 8, 2, true, 1, 1, true, 1.0, 1 << 30},         // no tokens
};

// The buffers of one routing in a backend's memory (poisoned until an op writes them).
struct Routing {
  int64_t N, E, k;
  Tensor prob, expert, gate, kept, load, offsets, row_token, row_slot, slot_row;
  Routing(Backend& be, int64_t N_, int64_t E_, int64_t k_) : N(N_), E(E_), k(k_) {
    prob = poisoned(be, DType::f32, N * E), expert = poisoned(be, DType::i32, N * k);
    gate = poisoned(be, DType::f32, N * k), kept = poisoned(be, DType::u8, N * k), load = poisoned(be, DType::i64, E);
    offsets = poisoned(be, DType::i64, E + 1), row_token = poisoned(be, DType::i64, N * k);
    row_slot = poisoned(be, DType::i32, N * k), slot_row = poisoned(be, DType::i32, N * k);
  }
  RoutingBuffers buffers() {
    return {N, E, k, prob.f32(), expert.data<int32_t>(), gate.f32(), kept.data<uint8_t>(), load.data<int64_t>(),
            offsets.data<int64_t>(), row_token.data<int64_t>(), row_slot.data<int32_t>(), slot_row.data<int32_t>()};
  }
};

// A routing's buffers on the host (row_token, row_slot: the R rows in use).
struct HostRouting {
  int64_t N = 0, E = 0, k = 0;
  std::vector<float> prob, gate;
  std::vector<int32_t> expert, row_slot, slot_row;
  std::vector<uint8_t> kept;
  std::vector<int64_t> load, offsets, row_token;
  int64_t R = 0;
  explicit HostRouting(const Routing& r) : N(r.N), E(r.E), k(r.k) {
    prob = down<float>(r.prob), gate = down<float>(r.gate), expert = down<int32_t>(r.expert);
    kept = down<uint8_t>(r.kept), load = down<int64_t>(r.load), offsets = down<int64_t>(r.offsets);
    slot_row = down<int32_t>(r.slot_row);
    R = offsets.back();
    row_token = down<int64_t>(r.row_token), row_slot = down<int32_t>(r.row_slot);
    row_token.resize(size_t(R)), row_slot.resize(size_t(R));
  }
  // Views of these vectors for the CPU kernels called directly (row_token, row_slot: R rows).
  RoutingBuffers buffers() {
    return {N, E, k, prob.data(), expert.data(), gate.data(), kept.data(), load.data(), offsets.data(),
            row_token.data(), row_slot.data(), slot_row.data()};
  }
};

// The same routing in another backend's memory.
inline Routing copy_routing(const HostRouting& h, Backend& be) {
  Routing r(be, h.N, h.E, h.k);
  to_device(be, h.prob, r.prob.f32()), to_device(be, h.gate, r.gate.f32()), to_device(be, h.expert, r.expert.data<int32_t>());
  to_device(be, h.kept, r.kept.data<uint8_t>()), to_device(be, h.load, r.load.data<int64_t>());
  to_device(be, h.offsets, r.offsets.data<int64_t>()), to_device(be, h.slot_row, r.slot_row.data<int32_t>());
  to_device(be, h.row_token, r.row_token.data<int64_t>()), to_device(be, h.row_slot, r.row_slot.data<int32_t>());
  return r;
}

// Router logits whose keys have no near-ties, so that the device expf vs the CPU's exponential cannot flip a choice: per
// token a random order of the groups and, inside each, of the experts, on a grid of 8 / E in
// [-4, 4): every expert of a better-placed group scores above every expert of a worse one, so the
// group scores are strictly ordered too.
inline std::vector<float> router_logits(const RouterCase& s, uint64_t seed) {
  std::vector<float> z(static_cast<size_t>(s.N * s.E));
  std::mt19937_64 rng(seed);
  const int64_t pg = s.E / s.groups;
  for (int64_t n = 0; n < s.N; ++n) {
    std::vector<int64_t> gorder(static_cast<size_t>(s.groups)), eorder(static_cast<size_t>(pg));
    std::iota(gorder.begin(), gorder.end(), 0);
    std::shuffle(gorder.begin(), gorder.end(), rng);
    for (int64_t g = 0; g < s.groups; ++g) {
      std::iota(eorder.begin(), eorder.end(), 0);
      std::shuffle(eorder.begin(), eorder.end(), rng);
      for (int64_t i = 0; i < pg; ++i)
        z[n * s.E + g * pg + i] = float(gorder[g] * pg + eorder[i] - s.E / 2) * (8.0f / float(s.E));
    }
  }
  return z;
}

}  // namespace fp8moe::test
