#include "model/linear.h"

#include <cstring>

#include "kernels/check.h"
#include "kernels/dispatch.h"

namespace fp8moe {
namespace {

Fp8Dtype grad_dtype(const Fp8Config& c) { return c.format == Fp8Format::hybrid ? Fp8Dtype::e5m2 : Fp8Dtype::e4m3; }
ScaleOptions scale_options(const Fp8Config& c) { return {c.margin, c.power_of_two_scales}; }

// One scale for the whole tensor, by the current or the delayed recipe.
void quantize_per_tensor(const float* x, int64_t rows, int64_t cols, Fp8Dtype dt, const LinearFp8& f, DelayedScaling* st,
                         QuantTensor* out) {
  const Fp8Config& c = *f.cfg;
  if (c.recipe == Fp8Recipe::delayed) {
    FP8MOE_ASSERT(st, "delayed scaling needs the layer's LinearScaling state");
    if (st->history.empty()) *st = make_delayed_scaling(c.amax_history_len);
    const auto compute = c.amax_compute == AmaxCompute::max ? DelayedScaling::Compute::max
                                                            : DelayedScaling::Compute::most_recent;
    if (f.record)
      quantize_delayed(x, rows, cols, dt, *st, compute, scale_options(c), f.reduce, out);
    else  // recomputation: the forward's scale; evaluation: the current one; no history step either way
      quantize_with_scale(x, rows, cols, dt, f.reuse_last_scale ? st->last_used : st->scale, out);
  } else {
    quantize_current(x, rows, cols, dt, scale_options(c), f.reduce, out);
  }
}

}  // namespace

void linear_forward(const float* x, int64_t M, int64_t K, const float* W, int64_t N, const LinearFp8& fp8, float* y,
                    LinearSaved* saved) {
  LinearSaved local;
  LinearSaved& s = saved ? *saved : local;
  s.M = M, s.K = K, s.N = N;
  s.x = x;
  if (!fp8.enabled()) {
    dev::sgemm(false, true, M, N, K, 1.0f, x, K, W, K, 0.0f, y, N);
    return;
  }
  const Fp8Config& c = *fp8.cfg;
  if (c.recipe == Fp8Recipe::blockwise) {
    quantize_tiled(x, M, K, Tiling::rows_1xT, c.tile, Fp8Dtype::e4m3, scale_options(c), &s.xq);
    quantize_tiled(W, N, K, Tiling::blocks_TxT, c.tile, Fp8Dtype::e4m3, scale_options(c), &s.wq);
  } else {
    quantize_per_tensor(x, M, K, Fp8Dtype::e4m3, fp8, fp8.state ? &fp8.state->x : nullptr, &s.xq);
    quantize_per_tensor(W, N, K, Fp8Dtype::e4m3, fp8, fp8.state ? &fp8.state->w : nullptr, &s.wq);
  }
  if (fp8.saturated && !fp8.reuse_last_scale) *fp8.saturated += s.xq.saturated + s.wq.saturated;
  if (fp8.underflowed && !fp8.reuse_last_scale) *fp8.underflowed += s.xq.underflowed + s.wq.underflowed;
  dev::gemm_fp8(dev::GemmRole::fprop, s.xq, false, s.wq, true, 1.0f, 0.0f, y, N);
  // What backward reads: per-tensor wgrad uses this FP8 input as it is, so the FP32 one is never
  // needed; blockwise wgrad re-tiles x to T x 1, from FP32 or (cache_activations) from this copy.
  if (c.recipe != Fp8Recipe::blockwise || c.cache_activations)
    s.x = nullptr;
  else
    s.xq = QuantTensor{};
}

void linear_backward(const LinearSaved& s, const float* W, const float* dy, const LinearFp8& fp8, float* dx, float* dW) {
  const int64_t M = s.M, K = s.K, N = s.N;
  if (!fp8.enabled()) {
    if (dx) dev::sgemm(false, false, M, K, N, 1.0f, dy, N, W, K, 0.0f, dx, K);
    dev::sgemm(true, false, N, K, M, 1.0f, dy, N, s.x, K, 1.0f, dW, K);
    return;
  }
  const Fp8Config& c = *fp8.cfg;
  if (c.recipe == Fp8Recipe::blockwise) {
    const ScaleOptions opt = scale_options(c);
    if (dx) {
      QuantTensor dyq;
      quantize_tiled(dy, M, N, Tiling::rows_1xT, c.tile, Fp8Dtype::e4m3, opt, &dyq);
      if (fp8.saturated) *fp8.saturated += dyq.saturated;
      if (fp8.underflowed) *fp8.underflowed += dyq.underflowed;
      dev::gemm_fp8(dev::GemmRole::dgrad, dyq, false, s.wq, false, 1.0f, 0.0f, dx, K);
    }
    // The weight gradient reduces over tokens: both operands re-tiled T x 1 from FP32 (x from its
    // FP8 cache when the FP32 input was not kept: 1 x T values re-tiled, as DeepSeek-V3 does).
    QuantTensor dyt, xt;
    quantize_tiled(dy, M, N, Tiling::cols_Tx1, c.tile, Fp8Dtype::e4m3, opt, &dyt);
    std::vector<float> x_from_cache;
    const float* x = s.x;
    if (!x && M * K > 0) {
      x_from_cache.resize(static_cast<size_t>(M * K));
      dequantize(s.xq, x_from_cache.data());
      x = x_from_cache.data();
    }
    quantize_tiled(x, M, K, Tiling::cols_Tx1, c.tile, Fp8Dtype::e4m3, opt, &xt);
    dev::gemm_fp8(dev::GemmRole::wgrad, dyt, true, xt, false, 1.0f, 1.0f, dW, K);
    return;
  }
  QuantTensor dyq;
  quantize_per_tensor(dy, M, N, grad_dtype(c), fp8, fp8.state ? &fp8.state->dy : nullptr, &dyq);
  if (fp8.saturated) *fp8.saturated += dyq.saturated;
  if (fp8.underflowed) *fp8.underflowed += dyq.underflowed;
  if (dx) dev::gemm_fp8(dev::GemmRole::dgrad, dyq, false, s.wq, false, 1.0f, 0.0f, dx, K);
  dev::gemm_fp8(dev::GemmRole::wgrad, dyq, true, s.xq, false, 1.0f, 1.0f, dW, K);
}

}  // namespace fp8moe
