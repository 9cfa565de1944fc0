// What every layer of a rank's model reads besides its own parameters and saved state: the
// backend, this tensor-parallel rank's dims, the tensor group, the FP8 state of the linear layers,
// the RoPE tables and the expert exchange. The Transformer owns one and builds its layers with it.
#pragma once

#include <cstdint>

#include "kernels/backend.h"
#include "model/config.h"
#include "model/fp8_state.h"
#include "model/linear.h"
#include "model/placement.h"
#include "parallel/communicator.h"
#include "parallel/expert_dispatch.h"

namespace fp8moe {

// RoPE's cos / sin (T, rope_dim / 2), for the rotation and its inverse (the backward), in the
// backend's memory.
struct RopeTables {
  Tensor cs, sn, cs_inv, sn_inv;
  int64_t T = 0;
  // At least T positions: built once per length in double on the host (cpu::rope_table: the same
  // table on every backend); a longer sequence rebuilds them (generation beyond train.seq_len).
  void ensure(Backend& be, const ModelConfig& m, int64_t T);
};

struct ModelContext {
  Backend& be;
  const ModelConfig& model;     // the model as configured (its global dims: names, layer kinds)
  const Placement& placement;  // this rank's share: its stage's blocks, its experts, its slices
  const ModelConfig& local;    // this tensor-parallel rank's heads and widths (placement.local())
  Communicator* tp;          // the tensor group when it has several ranks, else nullptr
  Fp8State& fp8;
  RopeTables& rope;
  ExpertDispatcher* dispatcher;  // expert parallelism (ep > 1), else nullptr
  HostBuffer<int64_t>* loads;    // (n_experts) pinned: each MoE layer's loads, read back
  // train.activations: with bf16 the residual stream is rounded to BF16 between blocks and the
  // expert all-to-all sends FP8 / BF16 rows (model/moe.h, MoeWire).
  ActivationDtype activations = ActivationDtype::fp32;
  // train.recompute selective: a kept block's backward makes again what is cheap to make from what
  // it keeps (the FFN norm's output the router reads, MLA's per-head queries, keys and values, the
  // SwiGLU outputs, an FP8 wo's copy of its input) instead of keeping it.
  bool selective = false;
  // train.hp_gemm: the router, head and eh_proj GEMMs in FP32 or BF16 (model/linear.h hp_forward).
  GemmDtype hp_gemm = GemmDtype::fp32;
  // train.moe_gates: where the routed experts' gates multiply (model/moe.h MoeWeights::gates).
  GateSite moe_gates = GateSite::combine;

  bool bf16_activations() const { return activations == ActivationDtype::bf16; }
  // x rounded to BF16 in place under train.activations bf16 (a rounding point); nothing under fp32.
  void round_activation(float* x, int64_t n) const {
    if (bf16_activations()) be.round_bf16(x, x, n);
  }
  void round_activation(Tensor& t) const { round_activation(t.f32(), t.numel()); }
  // A tensor kept for the backward: under bf16 its FP32 values (rounded at a rounding point, so
  // BF16 exactly) are replaced by their BF16 copy, half the bytes and nothing lost; under fp32
  // nothing. Nothing may hold a pointer into the FP32 tensor afterwards.
  void stash(Tensor* t) const {
    if (bf16_activations()) stash_bf16(be, t);
  }
  // The FP32 values of a kept tensor: its own (FP32), or its BF16 copy widened into *tmp.
  const float* unstash(const Tensor& t, Tensor* tmp) const { return fp8moe::unstash(be, t, tmp); }
  // RMSNorm's forward of a kept input x (N, D): FP32, or BF16 read as it is (the same bits as
  // widened first, without the FP32 copy): a norm output made again in backward.
  void norm_forward(const Tensor& x, const float* w, int64_t N, int64_t D, float eps, float* y, float* rstd) const {
    if (x.dtype() == DType::bf16)
      be.rmsnorm_forward_bf16(x.data<uint16_t>(), w, N, D, eps, y, rstd);
    else
      be.rmsnorm_forward(x.f32(), w, N, D, eps, y, rstd);
  }
  // RMSNorm's backward of a kept input x (N, D): FP32, or BF16 read as it is (the same bits as
  // widened first, without the FP32 copy).
  void norm_backward(const Tensor& x, const float* w, const float* rstd, const float* dy, int64_t N, int64_t D,
                     float* dx, float* dw) const {
    if (x.dtype() == DType::bf16)
      be.rmsnorm_backward_bf16(x.data<uint16_t>(), w, rstd, dy, N, D, dx, dw);
    else
      be.rmsnorm_backward(x.f32(), w, rstd, dy, N, D, dx, dw);
  }

  // Sum over the tensor group (row-parallel outputs, column-parallel input gradients); nothing
  // without one.
  void tp_sum(float* x, int64_t n) const {
    if (tp) tp->allreduce_sum(x, n);
  }
};

}  // namespace fp8moe
