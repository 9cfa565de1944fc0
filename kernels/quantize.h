// FP8 quantization: scales, the three recipes (current, delayed, blockwise) and QuantTensor.
//
// Convention (Transformer Engine's): q = fp8(x * scale), x ~= decode(q) * scale_inv,
// scale_inv = 1 / scale. Scales are FP32; with power_of_two scales, scale_inv is exact and the
// dequantized values are exact in FP32 and in BF16 (the CPU GEMM's fast path relies on that).
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "kernels/fp8.h"
#include "kernels/hd.h"

namespace fp8moe {

// How the scales of a tensor of shape (rows, cols) are laid out.
enum class Tiling : uint8_t {
  per_tensor,  // one scale
  rows_1xT,    // one scale per row per T consecutive columns (activations, gradients; K = cols)
  cols_Tx1,    // one scale per column per T consecutive rows (their transposed use; K = rows)
  blocks_TxT,  // one scale per T x T block (weights)
};
const char* to_string(Tiling t);

// The scale layout of a (rows, cols) tensor of tiling t with tile T (see QuantTensor below).
FP8MOE_HD inline int64_t tiling_scale_rows(Tiling t, int tile, int64_t rows) {
  return t == Tiling::per_tensor ? 1 : t == Tiling::rows_1xT ? rows : (rows + tile - 1) / tile;
}
FP8MOE_HD inline int64_t tiling_scale_cols(Tiling t, int tile, int64_t cols) {
  return t == Tiling::per_tensor ? 1 : t == Tiling::cols_Tx1 ? cols : (cols + tile - 1) / tile;
}

// An FP8 tensor's memory, not owned: bytes and scales wherever they live (host, or a backend's
// device memory: QTensor in kernels/tensor.h). The layout is QuantTensor's.
struct QuantView {
  uint8_t* data = nullptr;      // (rows, cols)
  float* scale_inv = nullptr;   // (scale_rows, scale_cols)
  int64_t rows = 0, cols = 0;
  Fp8Dtype dtype = Fp8Dtype::e4m3;
  Tiling tiling = Tiling::per_tensor;
  int tile = 1;
  FP8MOE_HD int64_t scale_rows() const { return tiling_scale_rows(tiling, tile, rows); }
  FP8MOE_HD int64_t scale_cols() const { return tiling_scale_cols(tiling, tile, cols); }
  FP8MOE_HD int64_t scale_count() const { return scale_rows() * scale_cols(); }
  FP8MOE_HD int64_t scale_index(int64_t r, int64_t c) const {
    switch (tiling) {
      case Tiling::per_tensor: return 0;
      case Tiling::rows_1xT: return r * scale_cols() + c / tile;
      case Tiling::cols_Tx1: return (r / tile) * cols + c;
      default: return (r / tile) * scale_cols() + c / tile;
    }
  }
  // Calls fn(c0, c1, scale_inv) for the runs of row r that share one scale, left to right (host).
  template <class Fn>
  void for_each_scale_run(int64_t r, Fn&& fn) const {
    const int64_t run = tiling == Tiling::cols_Tx1 ? 1 : tiling == Tiling::per_tensor ? cols : tile;
    for (int64_t c0 = 0; c0 < cols; c0 += run) fn(c0, c0 + run < cols ? c0 + run : cols, scale_inv[scale_index(r, c0)]);
  }
};

// An FP8 tensor: row-major bytes plus FP32 dequantization scales.
//   x[r][c] ~= decode(data[r * cols + c]) * scale_inv[scale_index(r, c)]
// scale_inv layout, row-major, with R = ceil(rows / T), C = ceil(cols / T) (edge tiles are partial):
//   per_tensor (1)   rows_1xT (rows, C)   cols_Tx1 (R, cols)   blocks_TxT (R, C)
struct QuantTensor {
  int64_t rows = 0, cols = 0;
  Fp8Dtype dtype = Fp8Dtype::e4m3;
  Tiling tiling = Tiling::per_tensor;
  int tile = 1;                  // T (1 for per_tensor)
  std::vector<uint8_t> data;     // (rows, cols)
  std::vector<float> scale_inv;  // see above
  int64_t saturated = 0;         // elements whose |x * scale| overflowed the format (clamped to max)
  int64_t underflowed = 0;       // non-zero elements that became +-0

  int64_t scale_rows() const { return tiling_scale_rows(tiling, tile, rows); }
  int64_t scale_cols() const { return tiling_scale_cols(tiling, tile, cols); }
  int64_t scale_index(int64_t r, int64_t c) const { return view().scale_index(r, c); }
  float dequant(int64_t r, int64_t c) const {
    return fp8_decode(data[r * cols + c], dtype) * scale_inv[scale_index(r, c)];
  }
  // The same memory as a view (valid while this tensor is unchanged).
  QuantView view() const {
    return {const_cast<uint8_t*>(data.data()), const_cast<float*>(scale_inv.data()), rows, cols, dtype, tiling, tile};
  }
};

// scale = fmax / amax / 2^margin, optionally rounded down to a power of two (so that amax * scale
// still fits). amax == 0 or non-finite gives 1 (nothing to scale; a non-finite amax is the
// caller's to report); a scale that would overflow FP32 is clamped to FLT_MAX.
// IEEE round-to-nearest division on both sides (nvcc would otherwise follow -prec-div).
FP8MOE_HD inline float div_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

FP8MOE_HD inline float compute_scale(float amax, float fmax, int margin, bool power_of_two) {
  if (!(amax > 0.0f) || !(amax <= 3.402823466e38f)) return 1.0f;
  float s = div_rn(fmax, amax);
  if (s > 3.402823466e38f) s = 3.402823466e38f;
  if (margin > 0) s *= bits_float(uint32_t(127 - (margin < 126 ? margin : 126)) << 23);  // exact 2^-margin
  if (s < 1.17549435e-38f) s = 1.17549435e-38f;  // a huge amax with a margin: stay a normal float, never 0
  if (power_of_two) s = bits_float(float_bits(s) & 0xFF800000u);  // 2^floor(log2(s)), s normal
  return s;
}

// max |x|; NaN if any element is NaN (FP32 bit order: NaN > inf > finite), 0 for n == 0.
float amax(const float* x, int64_t n);

// In-place element-wise max of `n` amax values over a group of ranks (e.g. the tensor-parallel
// group), supplied by the caller so that kernels/ stays free of MPI. Empty: no reduction.
using AmaxReduce = std::function<void(float* amax, int64_t n)>;

// Which amax of the history a delayed scale is computed from.
enum class DelayedScalingCompute { max, most_recent };

struct ScaleOptions {
  int margin = 0;
  bool power_of_two = true;
};

// The cores of the functions below, into caller-provided memory of the right size (out's bytes
// and scales), counts added to *saturated and *underflowed. The CPU backend's ops are these.
namespace cpu {
// q = fp8(x * scale) for the rows x cols elements; out.scale_inv[0] = 1 / scale. out per-tensor.
// amax (may be null): *amax = max |x| (amax()'s), from the same pass over x.
void quantize_scaled(const float* x, float scale, QuantView out, int64_t* saturated, int64_t* underflowed,
                     float* amax = nullptr);
// One scale per tile of out.tiling (not per_tensor), from the tile's own amax.
void quantize_tiled(const float* x, const ScaleOptions& opt, QuantView out, int64_t* saturated, int64_t* underflowed);
void dequantize(const QuantView& q, float* out);
// Delayed scaling after a quantization with *scale: amax enters history[steps % len] (steps =
// the amax values recorded before it), and *scale becomes compute_scale of the history's max or
// newest entry, unless that amax is 0 or not finite (then the scale is kept).
void delayed_update(float* history, int64_t len, int64_t steps, float amax, DelayedScalingCompute compute,
                    Fp8Dtype dtype, const ScaleOptions& opt, float* scale);
float delayed_amax(const float* history, int64_t len, int64_t steps, DelayedScalingCompute compute);
}  // namespace cpu

// Per-tensor quantization with a given scale (scale_inv = 1 / scale).
void quantize_with_scale(const float* x, int64_t rows, int64_t cols, Fp8Dtype dtype, float scale, QuantTensor* out);

// Current scaling: scale from this tensor's amax (reduced over `reduce` first). Returns the amax.
float quantize_current(const float* x, int64_t rows, int64_t cols, Fp8Dtype dtype, const ScaleOptions& opt,
                       const AmaxReduce& reduce, QuantTensor* out);

// Blockwise (DeepSeek-V3): one scale per tile of the given tiling, from the tile's own amax.
// tiling != per_tensor. No reduction: a tile never straddles ranks (checked by the config).
void quantize_tiled(const float* x, int64_t rows, int64_t cols, Tiling tiling, int tile, Fp8Dtype dtype,
                    const ScaleOptions& opt, QuantTensor* out);

// Delayed scaling (Transformer Engine's DelayedScaling) for one tensor: quantize with the scale
// derived from the amax history of earlier steps; then this step's amax (reduced) enters the
// history and the scale for the next step is recomputed from it (kept as it was when the
// history's amax is 0 or not finite). This is checkpointed state.
struct DelayedScaling {
  using Compute = DelayedScalingCompute;
  std::vector<float> history;  // (history_len) amax ring buffer, zeros at start
  int64_t steps = 0;           // amax values recorded so far; the newest is history[(steps-1) % len]
  float scale = 1.0f;          // the scale the next quantization uses
  float last_used = 1.0f;      // the scale the last quantization used (recomputation reuses it)
  bool operator==(const DelayedScaling&) const = default;
};
DelayedScaling make_delayed_scaling(int history_len);
// Returns this step's (reduced) amax.
float quantize_delayed(const float* x, int64_t rows, int64_t cols, Fp8Dtype dtype, DelayedScaling& state,
                       DelayedScaling::Compute compute, const ScaleOptions& opt, const AmaxReduce& reduce,
                       QuantTensor* out);
// The amax the next scale is computed from (the history's max, or its newest entry).
float delayed_amax(const DelayedScaling& state, DelayedScaling::Compute compute);

// Dequantization to FP32: decode(q) * scale_inv, one FP32 rounding (none for power-of-two scales,
// where the result is exact unless it leaves FP32's normal range).
void dequantize(const QuantTensor& q, float* out);  // out: (rows, cols)

// The amax of a whole tensor (max |x|), written where the backend's ops want it. CPU core.
namespace cpu {
inline float amax(const float* x, int64_t n) { return fp8moe::amax(x, n); }
}  // namespace cpu

}  // namespace fp8moe
