// CPU quantization: OpenMP loops over the vectorized spans of kernels/cpu/fp8_simd.h, which give
// the bytes of the FP8MOE_HD element functions of kernels/fp8.h.
#include "kernels/quantize.h"

#include <algorithm>
#include <cmath>

#include "kernels/check.h"
#include "kernels/cpu/fp8_simd.h"

namespace fp8moe {

const char* to_string(Tiling t) {
  switch (t) {
    case Tiling::per_tensor: return "per_tensor";
    case Tiling::rows_1xT: return "1xT";
    case Tiling::cols_Tx1: return "Tx1";
    default: return "TxT";
  }
}

float amax(const float* x, int64_t n) {
  uint32_t m = 0;
#pragma omp parallel for reduction(max : m) schedule(static)
  for (int64_t c0 = 0; c0 < n; c0 += (1 << 14)) m = std::max(m, cpu::abs_bits_max(x + c0, std::min<int64_t>(1 << 14, n - c0)));
  return bits_float(m);
}

namespace {

void prepare(QuantTensor* out, int64_t rows, int64_t cols, Fp8Dtype dtype, Tiling tiling, int tile) {
  FP8MOE_ASSERT(rows >= 0 && cols >= 0, "negative shape ", rows, " x ", cols);
  FP8MOE_ASSERT(tiling == Tiling::per_tensor || tile >= 1, "tile ", tile);
  out->rows = rows;
  out->cols = cols;
  out->dtype = dtype;
  out->tiling = tiling;
  out->tile = tiling == Tiling::per_tensor ? 1 : tile;
  out->data.resize(static_cast<size_t>(rows * cols));
  out->scale_inv.assign(static_cast<size_t>(out->scale_rows() * out->scale_cols()), 1.0f);
  out->saturated = 0;
  out->underflowed = 0;
}

}  // namespace

namespace cpu {

void quantize_scaled(const float* x, float scale, QuantView out, int64_t* saturated, int64_t* underflowed,
                     float* amax) {
  FP8MOE_ASSERT(out.tiling == Tiling::per_tensor, "quantize_scaled into a ", to_string(out.tiling), " tensor");
  out.scale_inv[0] = div_rn(1.0f, scale);
  const int64_t n = out.rows * out.cols;
  constexpr int64_t kChunk = 1 << 14;
  int64_t sat = 0, under = 0;
  uint32_t m = 0;
#pragma omp parallel for reduction(+ : sat, under) reduction(max : m) schedule(static)
  for (int64_t c0 = 0; c0 < n; c0 += kChunk) {
    EncodeStats st;
    encode_span(out.dtype, x + c0, out.data + c0, std::min(kChunk, n - c0), &scale, false, amax != nullptr, &st);
    sat += st.saturated;
    under += st.underflowed;
    m = std::max(m, st.amax_bits);
  }
  *saturated += sat;
  *underflowed += under;
  if (amax) *amax = bits_float(m);
}

// Columns per task of the column-tiled (T x 1) quantization.
constexpr int64_t kColChunk = 128;

void quantize_tiled(const float* x, const ScaleOptions& opt, QuantView out, int64_t* saturated, int64_t* underflowed) {
  const Tiling tiling = out.tiling;
  const int tile = out.tile;
  const int64_t rows = out.rows, cols = out.cols;
  FP8MOE_ASSERT(tiling != Tiling::per_tensor, "quantize_tiled needs a tiling");
  const int64_t sr = out.scale_rows(), sc = out.scale_cols();
  // Tile (i, j) of the scale grid covers rows [r0, r1) x cols [c0, c1).
  const int64_t tile_h = tiling == Tiling::rows_1xT ? 1 : tile;
  const int64_t tile_w = tiling == Tiling::cols_Tx1 ? 1 : tile;
  const float fmax = fp8_max(out.dtype);
  const Fp8Dtype dtype = out.dtype;
  uint8_t* q = out.data;
  float* scale_inv = out.scale_inv;
  int64_t sat = 0, under = 0;
  if (tiling == Tiling::cols_Tx1) {
    // Column tiles: each band of T rows in chunks of kColChunk columns, walked once for one amax
    // per column and once to encode (cache friendly). The chunks share the band among the threads:
    // an expert's tokens are often a single band.
    const int64_t chunks = (cols + kColChunk - 1) / kColChunk;
#pragma omp parallel for collapse(2) reduction(+ : sat, under) schedule(static)
    for (int64_t i = 0; i < sr; ++i)
      for (int64_t j = 0; j < chunks; ++j) {
        const int64_t r0 = i * tile, r1 = std::min(rows, r0 + tile);
        const int64_t c0 = j * kColChunk, w = std::min(cols, c0 + kColChunk) - c0;
        uint32_t m[kColChunk] = {};
        for (int64_t r = r0; r < r1; ++r) abs_bits_max_into(m, &x[r * cols + c0], w);
        float scale[kColChunk];
        for (int64_t c = 0; c < w; ++c) {
          scale[c] = compute_scale(bits_float(m[c]), fmax, opt.margin, opt.power_of_two);
          scale_inv[i * cols + c0 + c] = div_rn(1.0f, scale[c]);
        }
        EncodeStats st;
        for (int64_t r = r0; r < r1; ++r) encode_span(dtype, &x[r * cols + c0], &q[r * cols + c0], w, scale, true, false, &st);
        sat += st.saturated;
        under += st.underflowed;
      }
  } else {
    // Row and block tiles: each tile's amax, then its bytes, while the tile is in cache.
#pragma omp parallel for collapse(2) reduction(+ : sat, under) schedule(static)
    for (int64_t i = 0; i < sr; ++i)
      for (int64_t j = 0; j < sc; ++j) {
        const int64_t r0 = i * tile_h, r1 = std::min(rows, r0 + tile_h);
        const int64_t c0 = j * tile_w, c1 = std::min(cols, c0 + tile_w);
        uint32_t m = 0;
        for (int64_t r = r0; r < r1; ++r) m = std::max(m, abs_bits_max(&x[r * cols + c0], c1 - c0));
        const float scale = compute_scale(bits_float(m), fmax, opt.margin, opt.power_of_two);
        scale_inv[i * sc + j] = div_rn(1.0f, scale);
        EncodeStats st;
        for (int64_t r = r0; r < r1; ++r) encode_span(dtype, &x[r * cols + c0], &q[r * cols + c0], c1 - c0, &scale, false, false, &st);
        sat += st.saturated;
        under += st.underflowed;
      }
  }
  *saturated += sat;
  *underflowed += under;
}

void dequantize(const QuantView& q, float* out) {
  const float* table = fp8_decode_table(q.dtype);
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < q.rows; ++r) {
    const uint8_t* src = q.data + r * q.cols;
    float* dst = &out[r * q.cols];
    q.for_each_scale_run(r, [&](int64_t c0, int64_t c1, float s) {
      for (int64_t c = c0; c < c1; ++c) dst[c] = table[src[c]] * s;
    });
  }
}

float delayed_amax(const float* history, int64_t len, int64_t steps, DelayedScalingCompute compute) {
  if (steps == 0) return 0.0f;
  if (compute == DelayedScalingCompute::most_recent) return history[(steps - 1) % len];
  float m = 0.0f;
  for (int64_t i = 0; i < len; ++i) m = float_bits(history[i]) > float_bits(m) ? history[i] : m;  // NaN-propagating, as amax()
  return m;
}

void delayed_update(float* history, int64_t len, int64_t steps, float amax, DelayedScalingCompute compute,
                    Fp8Dtype dtype, const ScaleOptions& opt, float* scale) {
  history[steps % len] = amax;
  // NOTE: as Transformer Engine, keep the previous scale when the amax is 0 (an expert that got no
  // tokens) or not finite (a NaN / inf step, which the optimizer skips and reports).
  const float h = delayed_amax(history, len, steps + 1, compute);
  if (h > 0.0f && h <= 3.402823466e38f) *scale = compute_scale(h, fp8_max(dtype), opt.margin, opt.power_of_two);
}

}  // namespace cpu

void quantize_with_scale(const float* x, int64_t rows, int64_t cols, Fp8Dtype dtype, float scale, QuantTensor* out) {
  prepare(out, rows, cols, dtype, Tiling::per_tensor, 1);
  cpu::quantize_scaled(x, scale, out->view(), &out->saturated, &out->underflowed);
}

float quantize_current(const float* x, int64_t rows, int64_t cols, Fp8Dtype dtype, const ScaleOptions& opt,
                       const AmaxReduce& reduce, QuantTensor* out) {
  float a = amax(x, rows * cols);
  if (reduce) reduce(&a, 1);
  quantize_with_scale(x, rows, cols, dtype, compute_scale(a, fp8_max(dtype), opt.margin, opt.power_of_two), out);
  return a;
}

void quantize_tiled(const float* x, int64_t rows, int64_t cols, Tiling tiling, int tile, Fp8Dtype dtype,
                    const ScaleOptions& opt, QuantTensor* out) {
  FP8MOE_ASSERT(tiling != Tiling::per_tensor, "quantize_tiled needs a tiling");
  prepare(out, rows, cols, dtype, tiling, tile);
  cpu::quantize_tiled(x, opt, out->view(), &out->saturated, &out->underflowed);
}

DelayedScaling make_delayed_scaling(int history_len) {
  FP8MOE_ASSERT(history_len >= 1, "amax history length ", history_len);
  DelayedScaling s;
  s.history.assign(static_cast<size_t>(history_len), 0.0f);
  return s;
}

float delayed_amax(const DelayedScaling& state, DelayedScaling::Compute compute) {
  return cpu::delayed_amax(state.history.data(), int64_t(state.history.size()), state.steps, compute);
}

float quantize_delayed(const float* x, int64_t rows, int64_t cols, Fp8Dtype dtype, DelayedScaling& state,
                       DelayedScaling::Compute compute, const ScaleOptions& opt, const AmaxReduce& reduce,
                       QuantTensor* out) {
  FP8MOE_ASSERT(!state.history.empty(), "delayed scaling state not initialised");
  state.last_used = state.scale;
  prepare(out, rows, cols, dtype, Tiling::per_tensor, 1);
  float a = 0.0f;
  cpu::quantize_scaled(x, state.scale, out->view(), &out->saturated, &out->underflowed, &a);
  if (reduce) reduce(&a, 1);
  cpu::delayed_update(state.history.data(), int64_t(state.history.size()), state.steps, a, compute, dtype, opt,
                      &state.scale);
  ++state.steps;
  return a;
}

void dequantize(const QuantTensor& q, float* out) { cpu::dequantize(q.view(), out); }

}  // namespace fp8moe
