// cuBLASLt's FP8 operand layout ("TN": K contiguous) and its scale layouts, as FP8MOE_HD index
// functions: the CUDA backend packs QuantTensors with them on the device, and the CPU tests pack
// with the same functions on the host and check the packed operands against kernels/gemm_fp8.h's
// reference (tests/kernels/test_tn_layout.cpp), so the index math is tested without a GPU.
//
// A packed operand is row-major (outer_p, K_p) bytes (leading dimension K_p), zero beyond the
// source's (outer, K), with the scales of its mode (cuBLAS documentation; REFERENCES.md):
//   per_tensor  1 scale
//   vec128      (ceil(K_p / 128), outer_p), outer contiguous: one per row per 128 along K
//   blk128      (ceil(outer_p / 128), round_up(ceil(K_p / 128), 4)), K contiguous: one per 128 x 128
// Padded scale slots hold 1 (their data is 0).
#pragma once

#include <cstdint>

#include "kernels/hd.h"
#include "kernels/quantize.h"

namespace fp8moe {

enum class ScaleMode : uint8_t { per_tensor, vec128, blk128 };
inline constexpr int64_t kTnBlock = 128;

FP8MOE_HD inline int64_t tn_scale_ld(int64_t K_p) { return ((K_p + kTnBlock - 1) / kTnBlock + 3) / 4 * 4; }

FP8MOE_HD inline int64_t tn_scale_count(ScaleMode mode, int64_t outer_p, int64_t K_p) {
  const int64_t kb = (K_p + kTnBlock - 1) / kTnBlock;
  if (mode == ScaleMode::vec128) return kb * outer_p;
  if (mode == ScaleMode::blk128) return (outer_p + kTnBlock - 1) / kTnBlock * tn_scale_ld(K_p);
  return 1;
}

// The scale slot of packed element (o, k).
FP8MOE_HD inline int64_t tn_scale_slot(ScaleMode mode, int64_t outer_p, int64_t K_p, int64_t o, int64_t k) {
  if (mode == ScaleMode::vec128) return (k / kTnBlock) * outer_p + o;
  if (mode == ScaleMode::blk128) return (o / kTnBlock) * tn_scale_ld(K_p) + k / kTnBlock;
  return 0;
}

// Index into QuantTensor::scale_inv of source element (r, c) (kernels/quantize.h's layout).
FP8MOE_HD inline int64_t qt_scale_index(Tiling t, int tile, int64_t cols, int64_t r, int64_t c) {
  switch (t) {
    case Tiling::per_tensor: return 0;
    case Tiling::rows_1xT: return r * ((cols + tile - 1) / tile) + c / tile;
    case Tiling::cols_Tx1: return (r / tile) * cols + c;
    default: return (r / tile) * ((cols + tile - 1) / tile) + c / tile;
  }
}

// Packed byte e of a source (rows, cols) whose K runs along its rows (k_along_rows) or columns.
FP8MOE_HD inline uint8_t tn_packed_byte(const uint8_t* src, int64_t rows, int64_t cols, bool k_along_rows, int64_t K_p,
                                        int64_t e) {
  const int64_t outer = k_along_rows ? cols : rows, K = k_along_rows ? rows : cols;
  const int64_t o = e / K_p, k = e % K_p;
  if (o >= outer || k >= K) return 0;
  return k_along_rows ? src[k * cols + o] : src[o * cols + k];
}

// Packed scale slot e: the source scale of the first element the slot covers, 1 for padding.
FP8MOE_HD inline float tn_packed_scale(const float* scale_inv, Tiling t, int tile, int64_t rows, int64_t cols,
                                       bool k_along_rows, ScaleMode mode, int64_t outer_p, int64_t K_p, int64_t e) {
  const int64_t outer = k_along_rows ? cols : rows, K = k_along_rows ? rows : cols;
  int64_t o = 0, k = 0;
  if (mode == ScaleMode::vec128) {
    k = (e / outer_p) * kTnBlock, o = e % outer_p;
  } else if (mode == ScaleMode::blk128) {
    const int64_t ld = tn_scale_ld(K_p);
    o = (e / ld) * kTnBlock, k = (e % ld) * kTnBlock;
  }
  if (o >= outer || k >= K) return 1.0f;
  return scale_inv[qt_scale_index(t, tile, cols, k_along_rows ? k : o, k_along_rows ? o : k)];
}

// The mode a QuantTensor's tiling packs to (tile must be 128 for the block modes); false when its
// tiles do not run along K (a 1 x T tensor whose K runs along its rows, or a T x 1 one along columns).
inline bool tn_mode_of(const QuantTensor& q, bool k_along_rows, ScaleMode* mode) {
  switch (q.tiling) {
    case Tiling::per_tensor: *mode = ScaleMode::per_tensor; return true;
    case Tiling::rows_1xT: *mode = ScaleMode::vec128; return !k_along_rows && q.tile == kTnBlock;
    case Tiling::cols_Tx1: *mode = ScaleMode::vec128; return k_along_rows && q.tile == kTnBlock;
    default: *mode = ScaleMode::blk128; return q.tile == kTnBlock;
  }
}

}  // namespace fp8moe
