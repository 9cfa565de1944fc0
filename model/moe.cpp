#include "model/moe.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "kernels/check.h"
#include "kernels/moe_ops.h"
#include "parallel/pass_pair.h"

namespace fp8moe {

RouterRule router_rule(const MoeConfig& cfg, int64_t N) {
  RouterRule r;
  r.top_k = cfg.top_k;
  r.sigmoid = cfg.gating == Gating::sigmoid;
  r.n_group = cfg.n_group, r.topk_group = cfg.topk_group;
  r.normalise = cfg.normalises_gates();
  r.scaling = cfg.routed_scaling_factor;
  const int64_t k = cfg.top_k, E = cfg.n_experts;
  r.capacity = cfg.capacity_factor > 0 ? int64_t(std::ceil(cfg.capacity_factor * double(N * k) / double(E))) : N * k;
  return r;
}

namespace {
template <class T>
T* ptr(const Tensor& t) {
  return const_cast<T*>(t.data<T>());
}
}  // namespace

RoutingBuffers MoeRouting::buffers() const {
  return {N,
          E,
          k,
          ptr<float>(prob),
          ptr<int32_t>(expert),
          ptr<float>(gate),
          ptr<uint8_t>(kept),
          ptr<int64_t>(load),
          ptr<int64_t>(offsets),
          ptr<int64_t>(row_token),
          ptr<int32_t>(row_slot),
          ptr<int32_t>(slot_row)};
}

int64_t MoeRouting::bytes() const {
  return int64_t(prob.bytes() + expert.bytes() + gate.bytes() + kept.bytes() + load.bytes() + offsets.bytes() +
                 row_token.bytes() + row_slot.bytes() + slot_row.bytes() + wire_scale.bytes());
}

Routing route(const float* z, const float* bias, int64_t N, int64_t E, const MoeConfig& cfg, std::vector<float>* prob) {
  const int64_t k = cfg.top_k;
  Routing r;
  r.N = N, r.E = E, r.k = k;
  r.expert.assign(size_t(N * k), -1);
  r.gate.assign(size_t(N * k), 0.0f);
  r.kept.assign(size_t(N * k), 1);
  r.load.assign(size_t(E), 0);
  r.offsets.assign(size_t(E + 1), 0);
  r.row_token.assign(size_t(N * k), 0);
  r.row_slot.assign(size_t(N * k), 0);
  std::vector<int32_t> slot_row(size_t(N * k));
  prob->resize(size_t(N * E));
  RoutingBuffers b{N, E, k, prob->data(), r.expert.data(), r.gate.data(), r.kept.data(), r.load.data(),
                   r.offsets.data(), r.row_token.data(), r.row_slot.data(), slot_row.data()};
  cpu::route(z, bias, router_rule(cfg, N), b);
  const int64_t R = r.offsets[size_t(E)];
  r.row_token.resize(size_t(R)), r.row_slot.resize(size_t(R));
  r.dropped = N * k - R;
  return r;
}

namespace {
RoutingBuffers host_buffers(const Routing& r) {
  auto& m = const_cast<Routing&>(r);
  return {r.N, r.E, r.k, nullptr, m.expert.data(), m.gate.data(), m.kept.data(), m.load.data(), m.offsets.data(),
          m.row_token.data(), m.row_slot.data(), nullptr};
}
}  // namespace

void permute(const Routing& r, const float* x, int64_t D, float* rows) {
  cpu::permute(x, r.row_token.data(), r.offsets.back(), D, rows);
}

void unpermute_add(const Routing& r, const float* rows, int64_t D, float* out) {
  cpu::unpermute_add(host_buffers(r), r.offsets.back(), rows, D, true, out);
}

MoeWire moe_wire(const MoeFp8& fp8, ActivationDtype activations) {
  MoeWire w;
  if (activations != ActivationDtype::bf16) return w;
  w.bf16 = true;
  if (fp8.experts.empty()) return w;
  const FfnFp8& e = fp8.experts.front();  // every expert's layers have one configuration
  w.fp8_in = e.w1.enabled() && e.w3.enabled();
  w.fp8_grad = e.w2.enabled();
  return w;
}

namespace {
bool has_shared(const MoeWeights& w) { return w.shared.w1 != nullptr; }

// rows (R, D) FP32 -> the 1 x T FP8 copy a blockwise layer's GEMM reads (its tile and scale options).
QTensor quantize_rows(Backend& be, const float* rows, int64_t R, int64_t D, const LinearFp8& layer) {
  // A recomputation quantizes again what its forward counted already.
  return quantize_1xT(be, rows, R, D, *layer.cfg, layer.reuse_last_scale ? nullptr : layer.counts);
}

// rows (R, D) FP32 -> the FP8 rows of an exchange (MoeWire): a blockwise layer's 1 x T copy, or for
// a per-tensor one every row at one scale, *scale (1 value): from the amax over the expert group's
// rows (ep; else this rank's), or as given (not empty: a recomputation's, the forward's scale).
QTensor quantize_wire(Backend& be, const float* rows, int64_t R, int64_t D, const LinearFp8& layer, Fp8Dtype dt,
                      ExpertDispatcher* ep, Tensor* scale) {
  if (layer.cfg->recipe == Fp8Recipe::blockwise) return quantize_rows(be, rows, R, D, layer);
  AmaxReduce over_experts;
  if (ep) over_experts = [ep](float* amax, int64_t) { ep->reduce_amax(amax); };
  QTensor q(be, R, D, dt, Tiling::per_tensor, 1);
  quantize_current(be, rows, *layer.cfg, over_experts, layer.reuse_last_scale ? nullptr : layer.counts, scale, &q);
  return q;
}

// Rows [r0, r0 + rows) of an FP8 tensor of 1 x T tiles or one scale.
QuantView row_slice(const QTensor& q, int64_t r0, int64_t rows) {
  QuantView v = q.view();
  if (v.data) v.data += r0 * v.cols;
  if (v.data && v.tiling == Tiling::rows_1xT) v.scale_inv += r0 * v.scale_cols();
  v.rows = rows;
  return v;
}

// BF16 rows (R, D) sent to the experts' ranks and widened there into *out (plan.received rows), the
// FP32 rows the experts read. per_token: the rows are the same for each of a token's experts
// (ExpertDispatcher::dispatch). later: posted; *out holds the rows once later->finish() has run.
void bf16_dispatch(Backend& be, ExpertDispatcher& ep, const DispatchPlan& plan, std::shared_ptr<Tensor> r16, int64_t D,
                   Tensor* out, bool per_token, ExchangeLater* later = nullptr) {
  auto l16 = std::make_shared<Tensor>();
  ep.dispatch(plan, r16->data<uint16_t>(), D, l16.get(), per_token, later);
  *out = Tensor(be, DType::f32, {plan.received, D});
  auto widen_rows = [&be, l16, out, n = plan.received * D] {
    be.from_bf16(l16->data<uint16_t>(), out->f32(), n);
    l16->reset();
  };
  if (later)
    later->keep(r16), later->then(widen_rows);
  else
    widen_rows();
}

// The experts' rows (rows_in, D) FP32 -> BF16, brought back to their senders (R rows) in BF16.
// summed: the caller only sums each token's rows (ExpertDispatcher::combine). later: posted; the
// rows are there once later->finish() has run.
Tensor bf16_combine(Backend& be, ExpertDispatcher* ep, const DispatchPlan& plan, const float* rows, int64_t rows_in,
                    int64_t R, int64_t D, bool summed, ExchangeLater* later = nullptr) {
  auto r16 = std::make_shared<Tensor>(be, DType::bf16, Shape{rows_in, D});
  be.to_bf16(rows, r16->data<uint16_t>(), rows_in * D);
  if (!ep) return std::move(*r16);
  Tensor out(be, DType::bf16, {R, D});
  ep->combine(plan, r16->data<uint16_t>(), D, out.data<uint16_t>(), summed, later);
  if (later) later->keep(r16);
  return out;
}

// Routes the N tokens on the device and reads the loads back (the layer's one synchronisation);
// with expert parallelism, exchanges them into the plan.
void route_tokens(Backend& be, const float* x, int64_t N, int64_t D, const MoeConfig& cfg, const MoeWeights& w,
                  ExpertDispatcher* ep, HostBuffer<int64_t>* staging, MoeRouting* r) {
  const int64_t E = cfg.n_experts, k = cfg.top_k;
  r->N = N, r->E = E, r->k = k;
  r->wire_scale.reset();  // this forward's, made at its dispatch
  Tensor z(be, DType::f32, {N, E});
  hp_forward(be, w.router_gemm, x, N, D, w.router, E, z.f32());  // FP32 or BF16 router
  r->prob = Tensor(be, DType::f32, {N, E});
  r->expert = Tensor(be, DType::i32, {N, k});
  r->gate = Tensor(be, DType::f32, {N, k});
  r->kept = Tensor(be, DType::u8, {N, k});
  r->load = Tensor(be, DType::i64, {E});
  r->offsets = Tensor(be, DType::i64, {E + 1});
  r->row_token = Tensor(be, DType::i64, {N * k});
  r->row_slot = Tensor(be, DType::i32, {N * k});
  r->slot_row = Tensor(be, DType::i32, {N, k});
  be.route(z.f32(), w.router_bias, router_rule(cfg, N), r->buffers());
  // The caller's pinned buffer (a fresh one per routing would be a pinned allocation, which CUDA may
  // synchronise on, in every MoE layer of every micro-batch); grown once where the relay across
  // nodes also reads each row's token back, in the same synchronisation.
  const bool tokens = ep && ep->relays();
  const int64_t need = E + (tokens ? N * k : 0);
  HostBuffer<int64_t> local;
  if (!staging) staging = &local;
  if (staging->size() < need) *staging = HostBuffer<int64_t>(be, need);
  be.download(staging->data(), r->load.data<int64_t>(), size_t(E) * sizeof(int64_t));
  if (tokens && N * k > 0)  // (the first rows, sum of the loads, are the permuted ones)
    be.download(staging->data() + E, r->row_token.data<int64_t>(), size_t(N * k) * sizeof(int64_t));
  be.sync();
  r->load_host.assign(staging->data(), staging->data() + E);
  r->rows = std::accumulate(r->load_host.begin(), r->load_host.end(), int64_t(0));
  if (ep) {
    r->plan = ep->plan(r->load_host.data(), tokens ? staging->data() + E : nullptr);
    r->local_rows = r->plan.local_rows;
  } else {
    r->local_rows = r->load_host;
  }
}
}  // namespace

void moe_forward(Backend& be, const float* x, int64_t N, int64_t D, const MoeConfig& cfg, const MoeWeights& w,
                 const MoeFp8& fp8, float* out, MoeSaved* saved, ExpertDispatcher* ep, double* aux,
                 HostBuffer<int64_t>* load_staging, ActivationDtype activations, bool rebuild_a) {
  MoeSaved local;
  MoeSaved& s = saved ? *saved : local;
  const int64_t F = cfg.d_expert;
  s.x = x;
  const bool routed_here = s.routing.empty();
  if (routed_here) route_tokens(be, x, N, D, cfg, w, ep, load_staging, &s.routing);
  const MoeRouting& r = s.routing;
  const RoutingBuffers rb = r.buffers();

  // Shared experts see every token. With expert parallelism and runtime.overlap_expert_comm they
  // run while the routed rows travel (posted below, done at `later`); else first, before the routed
  // rows exist.
  auto shared_forward = [&] {
    if (has_shared(w))
      ffn_forward(be, x, N, D, int64_t(cfg.n_shared_experts) * F, w.shared, fp8.shared, out, &s.shared, activations,
                  rebuild_a);
    else
      be.zero(out, size_t(N * D) * sizeof(float));
  };
  ExchangeLater posted;
  ExchangeLater* later = ep && ep->overlap() ? &posted : nullptr;
  if (!later) shared_forward();

  // Routed experts: permute, (expert parallelism: send each row to its expert's rank,) one FFN per
  // expert on its rows (possibly none), (bring the outputs back,) unpermute with gates.
  const int64_t R = r.rows;
  const MoeWire wire = moe_wire(fp8, activations);
  const int64_t L = int64_t(r.local_rows.size());
  FP8MOE_ASSERT(int64_t(w.experts.size()) == L && int64_t(fp8.experts.size()) == L, "MoE: ", w.experts.size(),
                " expert weights for ", L, " experts");
  s.xq = QTensor{};
  s.xr.reset();
  bool xr_sent = false;  // the experts read what was sent: xr is done with once it is
  const float* xin = nullptr;
  if (wire.bf16 && !wire.fp8_in && ep) {  // gathered into BF16 rows as they are sent, no FP32 copy
    auto r16 = std::make_shared<Tensor>(be, DType::bf16, Shape{R, D});
    be.permute_bf16(x, r.row_token.data<int64_t>(), R, D, r16->data<uint16_t>());
    bf16_dispatch(be, *ep, r.plan, r16, D, &s.xl, true, later);
    xin = s.xl.f32();
  } else {
    s.xr = Tensor(be, DType::f32, {R, D});
    be.permute(x, r.row_token.data<int64_t>(), R, D, s.xr.f32());
    xin = s.xr.f32();
  }
  if (wire.fp8_in) {  // quantized once, here; the experts' first GEMM reads these bytes
    QTensor q = quantize_wire(be, s.xr.f32(), R, D, fp8.experts.front().w1, Fp8Dtype::e4m3, ep, &s.routing.wire_scale);
    s.xr.reset();
    if (ep) {
      auto sent = std::make_shared<QTensor>(std::move(q));
      ep->dispatch(r.plan, *sent, &s.xq, true, later);
      if (later) later->keep(sent);
    } else {
      s.xq = std::move(q);
    }
    xin = nullptr;
  } else if (wire.bf16) {
    if (!ep) be.round_bf16(xin, s.xr.f32(), R * D);  // (the rows stay here: rounded as if sent)
  } else if (ep) {
    ep->dispatch(r.plan, s.xr.f32(), D, &s.xl, true, later);
    xr_sent = true;
    xin = s.xl.f32();
  }
  const int64_t rows_in = std::accumulate(r.local_rows.begin(), r.local_rows.end(), int64_t(0));
  // train.moe_gates expert: each row's gate goes with it. A recomputation's are kept with its
  // routing (BlockSaved::finish), and must not be sent again: a rank whose experts received no row
  // holds an empty tensor, and an exchange of its own would pair with its partners' next one.
  const bool gated = w.gates == GateSite::expert;
  FP8MOE_ASSERT(!gated || routed_here || s.gate_rows.backend(), "MoE: a recomputation without its rows' gates");
  if (gated && routed_here) {
    auto g = std::make_shared<Tensor>(be, DType::f32, Shape{R});
    be.row_gates(rb, R, g->f32());
    if (ep) {
      ep->dispatch(r.plan, g->f32(), 1, &s.gate_rows, false, later);
      if (later) later->keep(g);
    } else {
      s.gate_rows = std::move(*g);
    }
  }
  if (later) {
    shared_forward();
    PassPair::yield_point();  // a pair's other pass computes while the rows travel (parallel/pass_pair.h)
    later->finish();
  }
  if (xr_sent) s.xr.reset();  // the experts read xl
  Tensor y(be, DType::f32, {rows_in, D});
  s.experts.clear();
  s.experts.resize(static_cast<size_t>(L));
  std::vector<FfnGroup> groups;  // one FFN per local expert, their GEMMs grouped
  std::vector<QuantView> xq(static_cast<size_t>(L));  // FP8 wire: each expert's rows of s.xq
  for (int64_t e = 0, r0 = 0; e < L; r0 += r.local_rows[size_t(e)], ++e) {
    const int64_t M = r.local_rows[size_t(e)];
    groups.push_back({xin ? xin + r0 * D : nullptr, M, &w.experts[size_t(e)], &fp8.experts[size_t(e)],
                      y.f32() + r0 * D, &s.experts[size_t(e)], nullptr, gated ? s.gate_rows.f32() + r0 : nullptr});
    if (wire.fp8_in) xq[size_t(e)] = row_slice(s.xq, r0, M), groups.back().xq = &xq[size_t(e)];
  }
  ffn_forward_grouped(be, D, F, groups, activations, rebuild_a);
  // Combine; the experts' outputs kept for the gates' gradient where combine applies the gates.
  // Inside a pair of passes it is posted too, the other pass computing while it travels; else in
  // line (nothing of this pass is left to compute behind it).
  s.expert_out.reset(), s.expert_out16.reset();
  ExchangeLater combined;
  ExchangeLater* back = later && PassPair::active() ? &combined : nullptr;
  auto arrived = [&] {
    if (!back) return;
    PassPair::yield_point();
    back->finish();
  };
  if (wire.bf16) {  // combine in BF16
    Tensor e16 = bf16_combine(be, ep, r.plan, y.f32(), rows_in, R, D, gated, back);
    arrived();
    y.reset();
    be.unpermute_add_bf16(rb, R, e16.data<uint16_t>(), D, !gated, out);  // read as they came
    if (!gated) s.expert_out16 = std::move(e16);
  } else {
    Tensor e32;
    if (ep) {
      e32 = Tensor(be, DType::f32, {R, D});
      ep->combine(r.plan, y.f32(), D, e32.f32(), gated, back);
      arrived();
    } else {
      e32 = std::move(y);
    }
    be.unpermute_add(rb, R, e32.f32(), D, !gated, out);
    if (!gated) s.expert_out = std::move(e32);
  }
  const bool inputs_cached = std::none_of(s.experts.begin(), s.experts.end(), [](const FfnSaved& e) {
    return e.l1.needs_fp32_input() || e.l3.needs_fp32_input();
  });
  if (inputs_cached) s.xr.reset(), s.xl.reset();  // the experts keep their inputs in FP8
  // The FP8 rows stay only where the layers kept them as their input (fp8.cache_activations).
  const bool xq_read = std::any_of(s.experts.begin(), s.experts.end(), [](const FfnSaved& e) {
    return e.l1.has_xq_ext || e.l3.has_xq_ext;
  });
  if (!xq_read) s.xq = QTensor{};

  if (aux) be.aux_loss(rb, cfg.aux_loss_coef, cfg.gating == Gating::sigmoid, aux);
}

void moe_backward(Backend& be, const MoeSaved& s, int64_t D, const MoeConfig& cfg, const MoeWeights& w,
                  const float* dout, float aux_grad_scale, const MoeFp8& fp8, float* dx, const MoeGrads& g,
                  ExpertDispatcher* ep, Communicator* tp, ActivationDtype activations,
                  const std::function<const float*(Tensor*)>& router_input, LaterWork* weights) {
  const MoeRouting& r = s.routing;
  const RoutingBuffers rb = r.buffers();
  const int64_t N = r.N, E = r.E, k = r.k, R = r.rows;
  // The shared experts' backward: with expert parallelism and runtime.overlap_expert_comm while the
  // output gradients' rows travel to the experts (posted below, done at `later`); else first,
  // before those rows exist.
  // The experts' weight gradients go to `weights` only where no exchange is posted for them to hide.
  LaterWork* left = ep && ep->overlap() ? nullptr : weights;
  auto shared_backward = [&] {
    if (has_shared(w))
      ffn_backward(be, s.shared, w.shared, dout, fp8.shared, dx, g.shared, left);
    else
      be.zero(dx, size_t(N * D) * sizeof(float));
  };
  ExchangeLater posted;
  ExchangeLater* later = ep && ep->overlap() ? &posted : nullptr;
  if (!later) shared_backward();

  // Per permuted row: the gradient of the expert's output (gate x dout) and of the gate; with the
  // gates in the experts (train.moe_gates expert), dout's rows, the gates' gradient made there.
  const MoeWire wire = moe_wire(fp8, activations);
  const bool gated = w.gates == GateSite::expert;
  // With the gates in the experts, BF16 rows (not FP8) sent to other ranks are gathered straight
  // into BF16, with no FP32 copy of them (as the forward's).
  const bool gather16 = gated && wire.bf16 && !wire.fp8_grad && ep;
  Tensor dgate(be, DType::f64, {N, k}), dye(be, DType::f32, {gather16 ? 0 : R, D});
  std::shared_ptr<Tensor> dye16;
  if (gather16) {
    dye16 = std::make_shared<Tensor>(be, DType::bf16, Shape{R, D});
    be.permute_bf16(dout, r.row_token.data<int64_t>(), R, D, dye16->data<uint16_t>());
  } else if (gated) {
    be.permute(dout, r.row_token.data<int64_t>(), R, D, dye.f32());
  } else if (wire.bf16) {  // the experts' outputs read as kept, in BF16
    be.gate_grad_bf16(rb, R, dout, s.expert_out16.data<uint16_t>(), D, dye.f32(), dgate.data<double>());
  } else {
    be.gate_grad(rb, R, dout, s.expert_out.f32(), D, dye.f32(), dgate.data<double>());
  }
  // (Expert parallelism: to the experts' ranks and back.)
  Tensor dyl;
  QTensor dyq;
  const float* dyin = dye.f32();
  if (wire.fp8_grad) {  // quantized once, here; the down-projection's dgrad reads these bytes
    const LinearFp8& w2 = fp8.experts.front().w2;
    Tensor scale;
    QTensor q = quantize_wire(be, dye.f32(), R, D, w2, grad_dtype(*w2.cfg), ep, &scale);
    dye.reset();
    if (ep) {
      auto sent = std::make_shared<QTensor>(std::move(q));
      ep->dispatch(r.plan, *sent, &dyq, gated, later);
      if (later) later->keep(sent);
    } else {
      dyq = std::move(q);
    }
    dyin = nullptr;
  } else if (wire.bf16) {
    if (ep) {
      if (!dye16) {
        dye16 = std::make_shared<Tensor>(be, DType::bf16, Shape{R, D});
        be.to_bf16(dye.f32(), dye16->data<uint16_t>(), R * D);
        dye.reset();
      }
      bf16_dispatch(be, *ep, r.plan, dye16, D, &dyl, gated, later);
      dye16.reset();  // (a posted exchange keeps its own reference)
      dyin = dyl.f32();
    } else {
      be.round_bf16(dye.f32(), dye.f32(), R * D);  // (as if sent)
    }
  } else if (ep) {
    ep->dispatch(r.plan, dye.f32(), D, &dyl, gated, later);
    dyin = dyl.f32();
  }
  if (later) {
    shared_backward();
    PassPair::yield_point();  // (as in the forward)
    later->finish();
  }
  const int64_t L = int64_t(r.local_rows.size());
  const int64_t rows_in = std::accumulate(r.local_rows.begin(), r.local_rows.end(), int64_t(0));
  Tensor dxl(be, DType::f32, {rows_in, D});
  Tensor dgate_rows(be, DType::f64, {gated ? rows_in : 0});  // the experts' rows' gates' gradients
  std::vector<FfnGradGroup> groups;  // one FFN per local expert, their GEMMs grouped
  std::vector<QuantView> dq(static_cast<size_t>(L));  // FP8 wire: each expert's rows of dyq
  for (int64_t e = 0, r0 = 0; e < L; r0 += r.local_rows[size_t(e)], ++e) {
    groups.push_back({&s.experts[size_t(e)], &w.experts[size_t(e)], dyin ? dyin + r0 * D : nullptr,
                      &fp8.experts[size_t(e)], dxl.f32() + r0 * D, &g.experts[size_t(e)]});
    if (wire.fp8_grad) dq[size_t(e)] = row_slice(dyq, r0, r.local_rows[size_t(e)]), groups.back().dyq = &dq[size_t(e)];
    if (gated) groups.back().dgate = dgate_rows.data<double>() + r0;
  }
  // The experts' weight gradients run while their input gradients travel back (the combines
  // posted, done after them), or are left to `weights`; else in line, as the layers run them.
  LaterWork wgrad;
  ffn_backward_grouped(be, groups, later ? &wgrad : left);
  Tensor back;  // the gates' gradients, back to their (token, slot)
  if (gated && ep) {
    back = Tensor(be, DType::f64, {R});
    ep->combine(r.plan, dgate_rows.data<double>(), 1, back.data<double>(), later);
  } else if (gated) {
    back = std::move(dgate_rows);
  }
  if (!later) dyq = QTensor{}, dyl.reset();  // (read no more: no weight gradient waits for them)
  Tensor dxe, dx16;
  if (wire.bf16) {  // combine's backward in BF16 too
    dx16 = bf16_combine(be, ep, r.plan, dxl.f32(), rows_in, R, D, true, later);
  } else if (ep) {
    dxe = Tensor(be, DType::f32, {R, D});
    ep->combine(r.plan, dxl.f32(), D, dxe.f32(), true, later);
  } else {
    dxe = std::move(dxl);
  }
  wgrad.run();
  if (later) {
    PassPair::yield_point();
    later->finish();
  }
  dyq = QTensor{}, dyl.reset(), dxl.reset();
  if (gated) be.slot_grads(rb, R, back.data<double>(), dgate.data<double>());
  // a token's k rows add into one row, in row order (BF16 rows read as they came)
  if (wire.bf16)
    be.unpermute_add_bf16(rb, R, dx16.data<uint16_t>(), D, false, dx), dx16.reset();
  else
    be.unpermute_add(rb, R, dxe.f32(), D, false, dx);
  if (tp) {  // each rank holds a slice of every expert's width: partial sums so far
    tp->allreduce_sum(dx, N * D);
    tp->allreduce_sum(dgate.data<double>(), N * k);
  }

  // Gates -> router logits.
  Tensor dz(be, DType::f32, {N, E});
  RouterGradRule rule;
  rule.sigmoid = cfg.gating == Gating::sigmoid, rule.normalise = cfg.normalises_gates();
  rule.scaling = cfg.routed_scaling_factor, rule.aux_coef = cfg.aux_loss_coef, rule.aux_grad_scale = aux_grad_scale;
  be.router_grad(rb, dgate.data<double>(), rule, dz.f32());
  // Router: dWr += dz^T x, dx += dz Wr; x made by the caller only now, the layer's last op.
  Tensor x_tmp;
  const float* x = router_input ? router_input(&x_tmp) : s.x;
  hp_backward(be, w.router_gemm, dz.f32(), N, E, x, D, w.router, dx, 1.0f, g.router);
}

void update_router_bias(float* bias, const std::vector<int64_t>& load, double rate) {
  cpu::bias_update(bias, load.data(), int64_t(load.size()), rate);
}

}  // namespace fp8moe
