// cuBLASLt's TN operand and scale layouts (kernels/tn_layout.h), checked on the CPU: QuantTensors
// of each recipe's three GEMMs are packed with the same index functions the CUDA packing kernels
// run, a GEMM is evaluated from the packed bytes and the packed scales read at the slots the
// cuBLAS documentation gives (documented_slot, written here independently of tn_scale_slot), and
// the result must equal an FP64 GEMM of the
// unpacked QuantTensors' dequantized values. A wrong transpose, padding or scale slot changes the
// product. (Whether cuBLASLt reads the slots as documented is for DeviceOps.Fp8Gemm*/cuda on a GPU.)
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "kernels/quantize.h"
#include "kernels/tn_layout.h"
#include "tests/test_random.h"

namespace fp8moe {
namespace {

std::vector<float> randn(int64_t rows, int64_t cols, uint64_t seed) {
  std::vector<float> x = test::normal_vector(rows * cols, seed);
  // Row and column magnitudes spread over 2^-6..2^6 so that every tile gets its own scale.
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) x[r * cols + c] *= std::ldexp(1.0f, int((r * 7 + c / 128 * 5) % 13) - 6);
  return x;
}

QuantTensor quant(const std::vector<float>& x, int64_t rows, int64_t cols, Tiling t, Fp8Dtype dt = Fp8Dtype::e4m3) {
  QuantTensor q;
  if (t == Tiling::per_tensor)
    quantize_current(x.data(), rows, cols, dt, {}, {}, &q);
  else
    quantize_tiled(x.data(), rows, cols, t, 128, dt, {}, &q);
  return q;
}

// The scale of packed element (o, k) as cuBLASLt documents it, written here from the documentation
// and not through kernels/tn_layout.h: VEC128_32F scales are outer-major, one per 128 values of K
// ([outer x ceil(K/128)] with the outer index fastest); BLK128x128_32F scales are K-major, one per
// 128 x 128 block, the row of K-blocks padded to a multiple of 4.
int64_t documented_slot(ScaleMode mode, int64_t outer_p, int64_t K_p, int64_t o, int64_t k) {
  const int64_t k_blocks = (K_p + 127) / 128;
  switch (mode) {
    case ScaleMode::vec128: return (k / 128) * outer_p + o;
    case ScaleMode::blk128: return (o / 128) * ((k_blocks + 3) / 4 * 4) + k / 128;
    default: return 0;
  }
}

struct Packed {
  std::vector<uint8_t> data;
  std::vector<float> scale;
  ScaleMode mode;
  int64_t outer_p, K_p;
  Fp8Dtype dtype;
  float at(int64_t o, int64_t k) const {
    const int64_t slot = documented_slot(mode, outer_p, K_p, o, k);
    EXPECT_LT(slot, int64_t(scale.size()));  // tn_scale_count must cover every documented slot
    return fp8_decode(data[o * K_p + k], dtype) * scale[size_t(slot)];
  }
};

Packed pack(const QuantTensor& q, bool k_along_rows, int64_t outer_p, int64_t K_p) {
  Packed p;
  EXPECT_TRUE(tn_mode_of(q, k_along_rows, &p.mode));
  p.outer_p = outer_p, p.K_p = K_p, p.dtype = q.dtype;
  p.data.resize(static_cast<size_t>(outer_p * K_p));
  for (int64_t e = 0; e < outer_p * K_p; ++e) p.data[e] = tn_packed_byte(q.data.data(), q.rows, q.cols, k_along_rows, K_p, e);
  p.scale.resize(static_cast<size_t>(tn_scale_count(p.mode, outer_p, K_p)));
  for (int64_t e = 0; e < int64_t(p.scale.size()); ++e)
    p.scale[e] = tn_packed_scale(q.scale_inv.data(), q.tiling, q.tile, q.rows, q.cols, k_along_rows, p.mode, outer_p,
                                 K_p, e);
  return p;
}

int64_t round_up(int64_t a, int64_t b) { return (a + b - 1) / b * b; }

// C = op(A) op(B) from the packed operands vs from the QuantTensors' own dequantization.
void check(const QuantTensor& A, bool trans_a, const QuantTensor& B, bool trans_b) {
  const int64_t M = trans_a ? A.cols : A.rows, K = trans_a ? A.rows : A.cols, N = trans_b ? B.rows : B.cols;
  const bool block = A.tiling != Tiling::per_tensor;
  const int64_t Mp = round_up(M, 16), Np = round_up(N, 16), Kp = round_up(std::max<int64_t>(K, 1), block ? 128 : 16);
  const Packed a = pack(A, trans_a, Mp, Kp), b = pack(B, !trans_b, Np, Kp);
  for (int64_t m = 0; m < Mp; ++m)
    for (int64_t n = 0; n < Np; ++n) {
      double packed = 0, direct = 0;
      for (int64_t k = 0; k < Kp; ++k) packed += double(a.at(m, k)) * b.at(n, k);
      if (m < M && n < N)
        for (int64_t k = 0; k < K; ++k)
          direct += double(trans_a ? A.dequant(k, m) : A.dequant(m, k)) * (trans_b ? B.dequant(n, k) : B.dequant(k, n));
      // Products of FP8 values and power-of-two scales are exact in double; sums of <= 512 of them
      // round identically in the same order (padding adds exact zeros).
      ASSERT_EQ(packed, direct) << "C[" << m << "][" << n << "] of " << M << "x" << N << "x" << K;
    }
}

struct Shape {
  int64_t M, N, K;
};
const Shape kShapes[] = {{1, 16, 128}, {33, 300, 257}, {130, 64, 384}, {16, 1, 100}};

TEST(TnLayout, BlockwiseForwardPacksAsDocumented) {  // y = x W^T: x 1x128 (VEC128), W 128x128 (BLK)
  for (const Shape& s : kShapes) {
    SCOPED_TRACE(testing::Message() << s.M << "x" << s.N << "x" << s.K);
    check(quant(randn(s.M, s.K, 1), s.M, s.K, Tiling::rows_1xT), false,
          quant(randn(s.N, s.K, 2), s.N, s.K, Tiling::blocks_TxT), true);
  }
}

TEST(TnLayout, BlockwiseDgradPacksAsDocumented) {  // dx = dy W: W transposed on the device
  for (const Shape& s : kShapes) {
    SCOPED_TRACE(testing::Message() << s.M << "x" << s.N << "x" << s.K);
    // dy (M, N) 1x128 along N (the reduction); W (N, K) blocks, K output columns
    check(quant(randn(s.M, s.N, 3), s.M, s.N, Tiling::rows_1xT), false,
          quant(randn(s.N, s.K, 4), s.N, s.K, Tiling::blocks_TxT), false);
  }
}

TEST(TnLayout, BlockwiseWgradPacksAsDocumented) {  // dW = dy^T x: both 128x1 along tokens (VEC128 x VEC128)
  for (const Shape& s : kShapes) {
    SCOPED_TRACE(testing::Message() << s.M << "x" << s.N << "x" << s.K);
    check(quant(randn(s.K, s.M, 5), s.K, s.M, Tiling::cols_Tx1), true,
          quant(randn(s.K, s.N, 6), s.K, s.N, Tiling::cols_Tx1), false);
  }
}

TEST(TnLayout, PerTensorPacksWithBothFormats) {
  for (const Shape& s : kShapes) {
    SCOPED_TRACE(testing::Message() << s.M << "x" << s.N << "x" << s.K);
    const QuantTensor dy = quant(randn(s.M, s.N, 7), s.M, s.N, Tiling::per_tensor, Fp8Dtype::e5m2);
    const QuantTensor w = quant(randn(s.N, s.K, 8), s.N, s.K, Tiling::per_tensor);
    const QuantTensor x = quant(randn(s.M, s.K, 9), s.M, s.K, Tiling::per_tensor);
    check(x, false, w, true);   // forward
    check(dy, false, w, false);  // dgrad (hybrid: E5M2 x E4M3)
    check(dy, true, x, false);   // wgrad
  }
}

TEST(TnLayout, TilesAcrossKAreRefused) {
  // A 1x128 tensor whose reduction runs along its rows cannot be a VEC128 operand.
  ScaleMode mode;
  QuantTensor q = quant(randn(4, 256, 10), 4, 256, Tiling::rows_1xT);
  EXPECT_FALSE(tn_mode_of(q, true, &mode));
  EXPECT_TRUE(tn_mode_of(q, false, &mode));
  QuantTensor t32;
  const std::vector<float> x = randn(4, 256, 11);
  quantize_tiled(x.data(), 4, 256, Tiling::rows_1xT, 32, Fp8Dtype::e4m3, {}, &t32);
  EXPECT_FALSE(tn_mode_of(t32, false, &mode)) << "cuBLASLt's blocks are 128: tile 32 must be refused";
}

}  // namespace
}  // namespace fp8moe
