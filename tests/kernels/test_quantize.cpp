// Quantization (kernels/quantize.h). The CPU recipes: scales against their formula (computed
// here with log2/floor, not the bit trick of compute_scale), round-trip error within the format's
// half-ulp, saturation and underflow counts, zero / all-equal / NaN tensors, tile layouts with
// partial edge tiles, the delayed-scaling history, and the amax reduction hook. Then amax, the
// scales, per-tensor and tiled quantization, the delayed-scaling history and dequantization through
// each device backend against the CPU backend and the host library (backend_cases.h), bitwise; and
// the GPU's hardware FP8 conversion against the CPU encoder.
#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <random>
#include <utility>
#include <vector>

#include "kernels/quantize.h"
#include "tests/kernels/backend_cases.h"
#include "tests/test_random.h"
#if FP8MOE_HAVE_CUDA
#include "kernels/cuda/backend.h"
#include "kernels/cuda/quantize.h"
#endif

namespace fp8moe::test {
namespace {

int mant_bits(Fp8Dtype f) { return f == Fp8Dtype::e4m3 ? 3 : 2; }
double min_normal(Fp8Dtype f) { return f == Fp8Dtype::e4m3 ? std::ldexp(1.0, -6) : std::ldexp(1.0, -14); }
double min_subnormal(Fp8Dtype f) { return f == Fp8Dtype::e4m3 ? std::ldexp(1.0, -9) : std::ldexp(1.0, -16); }

// The reference scale: fmax / amax / 2^margin, rounded down to a power of two if asked.
double reference_scale(double amax, Fp8Dtype f, int margin, bool pow2) {
  if (!(amax > 0) || !std::isfinite(amax)) return 1.0;
  double s = fp8_max(f) / amax / std::ldexp(1.0, margin);
  if (s > FLT_MAX) s = FLT_MAX;
  if (pow2) s = std::ldexp(1.0, int(std::floor(std::log2(s))));
  return float(s);
}

// |decode(q) - x * scale| within half an FP8 ulp of x * scale (or of the subnormal spacing).
void expect_within_half_ulp(const QuantTensor& q, const std::vector<float>& x) {
  for (int64_t r = 0; r < q.rows; ++r)
    for (int64_t c = 0; c < q.cols; ++c) {
      const double scale = 1.0 / q.scale_inv[q.scale_index(r, c)];
      const double y = double(x[r * q.cols + c]) * scale;  // what was encoded
      const double got = fp8_decode(q.data[r * q.cols + c], q.dtype);
      const double ay = std::abs(y);
      const double half_ulp = ay >= min_normal(q.dtype) ? std::ldexp(1.0, int(std::floor(std::log2(ay))) - mant_bits(q.dtype) - 1)
                                                        : min_subnormal(q.dtype) / 2;
      // NOTE: y is x * scale in FP64; the encoder saw its FP32 rounding, which moves it by at
      // most 2^-24 |y|: allow that on top of the half ulp.
      ASSERT_LE(std::abs(got - y), half_ulp + ay * 0x1p-24) << "(" << r << ", " << c << ") x = " << x[r * q.cols + c];
    }
}

TEST(ComputeScale, MatchesTheFormula) {
  for (Fp8Dtype f : {Fp8Dtype::e4m3, Fp8Dtype::e5m2})
    for (double amax : {448.0, 1.0, 3.0, 1e-3, 1e-20, 57344.0, 1e30, 0.7})
      for (int margin : {0, 1, 3})
        for (bool pow2 : {false, true})
          EXPECT_EQ(compute_scale(float(amax), fp8_max(f), margin, pow2), float(reference_scale(float(amax), f, margin, pow2)))
              << to_string(f) << " amax " << amax << " margin " << margin << " pow2 " << pow2;
}

TEST(ComputeScale, EdgeAmaxValues) {
  EXPECT_EQ(compute_scale(0.0f, 448.0f, 0, true), 1.0f);
  EXPECT_EQ(compute_scale(NAN, 448.0f, 0, true), 1.0f);
  EXPECT_EQ(compute_scale(INFINITY, 448.0f, 0, false), 1.0f);
  EXPECT_EQ(compute_scale(1e-40f, 448.0f, 0, false), FLT_MAX);             // would overflow
  EXPECT_EQ(compute_scale(1e-40f, 448.0f, 0, true), std::ldexp(1.0f, 127));  // largest power of two
  // A huge amax with a large margin would fall below FP32's normal range: clamped, never 0.
  const float tiny = compute_scale(1e25f, 448.0f, 64, true);
  EXPECT_GT(tiny, 0.0f);
  EXPECT_TRUE(std::isfinite(1.0f / tiny));
}

TEST(Amax, AbsoluteMaxAndNaN) {
  std::vector<float> x = normal_vector(100001, 3);
  x[777] = -9.5f;
  EXPECT_EQ(amax(x.data(), int64_t(x.size())), 9.5f);
  EXPECT_EQ(amax(x.data(), 0), 0.0f);
  x[5] = NAN;
  EXPECT_TRUE(std::isnan(amax(x.data(), int64_t(x.size()))));
}

struct RecipeCase {
  const char* name;
  Tiling tiling;
  int tile;
  Fp8Dtype dtype;
  bool pow2;
};

class QuantizeRoundTrip : public testing::TestWithParam<RecipeCase> {};

TEST_P(QuantizeRoundTrip, ErrorWithinHalfUlpAndScalesFromTileAmax) {
  const RecipeCase rc = GetParam();
  for (auto [rows, cols] : {std::pair<int64_t, int64_t>{1, 1}, {1, 300}, {37, 129}, {130, 64}, {256, 256}}) {
    SCOPED_TRACE(testing::Message() << rows << " x " << cols);
    // Rows of very different magnitudes, so per-tile scales differ.
    std::vector<float> x = normal_vector(rows * cols, 100 + rows * 7 + cols);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) x[r * cols + c] *= std::ldexp(1.0f, int((r * 5 + c / 17) % 20) - 10);
    QuantTensor q;
    const ScaleOptions opt{0, rc.pow2};
    if (rc.tiling == Tiling::per_tensor)
      quantize_current(x.data(), rows, cols, rc.dtype, opt, {}, &q);
    else
      quantize_tiled(x.data(), rows, cols, rc.tiling, rc.tile, rc.dtype, opt, &q);
    ASSERT_EQ(q.rows, rows);
    ASSERT_EQ(q.cols, cols);
    EXPECT_EQ(q.saturated, 0);  // current / blockwise scaling never saturates
    // Each scale from its own tile's amax, found here by a plain loop over the tile.
    std::vector<double> tile_amax(q.scale_inv.size(), 0.0);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) {
        double& m = tile_amax[q.scale_index(r, c)];
        m = std::max(m, double(std::abs(x[r * cols + c])));
      }
    const int64_t expect_scales = rc.tiling == Tiling::per_tensor ? 1
                                  : rc.tiling == Tiling::rows_1xT ? rows * ((cols + rc.tile - 1) / rc.tile)
                                  : rc.tiling == Tiling::cols_Tx1 ? ((rows + rc.tile - 1) / rc.tile) * cols
                                                                  : ((rows + rc.tile - 1) / rc.tile) * ((cols + rc.tile - 1) / rc.tile);
    ASSERT_EQ(int64_t(q.scale_inv.size()), expect_scales);
    for (size_t i = 0; i < tile_amax.size(); ++i)
      ASSERT_EQ(q.scale_inv[i], float(1.0 / float(reference_scale(tile_amax[i], rc.dtype, 0, rc.pow2)))) << "scale " << i;
    expect_within_half_ulp(q, x);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Recipes, QuantizeRoundTrip,
    testing::Values(RecipeCase{"per_tensor_e4m3", Tiling::per_tensor, 1, Fp8Dtype::e4m3, true},
                    RecipeCase{"per_tensor_e4m3_any_scale", Tiling::per_tensor, 1, Fp8Dtype::e4m3, false},
                    RecipeCase{"per_tensor_e5m2", Tiling::per_tensor, 1, Fp8Dtype::e5m2, true},
                    RecipeCase{"rows_1x128", Tiling::rows_1xT, 128, Fp8Dtype::e4m3, true},
                    RecipeCase{"rows_1x32_any_scale", Tiling::rows_1xT, 32, Fp8Dtype::e4m3, false},
                    RecipeCase{"cols_128x1", Tiling::cols_Tx1, 128, Fp8Dtype::e4m3, true},
                    RecipeCase{"cols_32x1_e5m2", Tiling::cols_Tx1, 32, Fp8Dtype::e5m2, true},
                    RecipeCase{"blocks_128", Tiling::blocks_TxT, 128, Fp8Dtype::e4m3, true},
                    RecipeCase{"blocks_48_any_scale", Tiling::blocks_TxT, 48, Fp8Dtype::e4m3, false}),
    [](const auto& i) { return std::string(i.param.name); });

TEST(Quantize, TxOneTilingIsTheTransposeOfOneByT) {
  const int64_t rows = 200, cols = 77;
  const std::vector<float> x = normal_vector(rows * cols, 9);
  std::vector<float> xt(x.size());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) xt[c * rows + r] = x[r * cols + c];
  QuantTensor a, b;
  quantize_tiled(x.data(), rows, cols, Tiling::cols_Tx1, 64, Fp8Dtype::e4m3, {}, &a);
  quantize_tiled(xt.data(), cols, rows, Tiling::rows_1xT, 64, Fp8Dtype::e4m3, {}, &b);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      ASSERT_EQ(a.data[r * cols + c], b.data[c * rows + r]);
      ASSERT_EQ(a.scale_inv[a.scale_index(r, c)], b.scale_inv[b.scale_index(c, r)]);
    }
}

TEST(Quantize, ZeroTensorGivesZerosAndScaleOne) {
  const std::vector<float> x(64 * 40, 0.0f);
  for (Tiling t : {Tiling::per_tensor, Tiling::rows_1xT, Tiling::cols_Tx1, Tiling::blocks_TxT}) {
    QuantTensor q;
    if (t == Tiling::per_tensor)
      quantize_current(x.data(), 64, 40, Fp8Dtype::e4m3, {}, {}, &q);
    else
      quantize_tiled(x.data(), 64, 40, t, 16, Fp8Dtype::e4m3, {}, &q);
    for (uint8_t b : q.data) ASSERT_EQ(b, 0);
    for (float s : q.scale_inv) ASSERT_EQ(s, 1.0f);
    EXPECT_EQ(q.underflowed, 0);
  }
}

TEST(Quantize, AllEqualTensor) {
  for (float v : {1.1f, -3.0e-5f, 1000.0f}) {
    const std::vector<float> x(50 * 30, v);
    for (bool pow2 : {false, true}) {
      QuantTensor q;
      quantize_current(x.data(), 50, 30, Fp8Dtype::e4m3, {0, pow2}, {}, &q);
      for (uint8_t b : q.data) ASSERT_EQ(b, q.data[0]);
      std::vector<float> back(x.size());
      dequantize(q, back.data());
      // amax * scale lands in (224, 448]: E4M3 keeps it within a relative half ulp of 2^-4.
      EXPECT_NEAR(back[0], v, std::abs(v) * 0.0625) << v << " pow2 " << pow2;
      if (!pow2) {
        EXPECT_NEAR(back[0], v, std::abs(v) * 1e-6) << "amax maps exactly to 448";
      }
    }
  }
}

TEST(Quantize, SaturationAndUnderflowAreCounted) {
  // A stale (delayed) scale: 2 * 448 / 100 maps values above 50 beyond 448.
  std::vector<float> x = normal_vector(10000, 11, 30.0f);
  x[10] = 1e-9f;  // far below the smallest subnormal after scaling
  const float scale = 448.0f / 50.0f;
  int64_t want_sat = 0, want_under = 0;
  for (float v : x) {
    const float y = v * scale;  // what the encoder sees
    want_sat += std::abs(y) > 464.0f;  // beyond max + half ulp: clamped, not rounded
    want_under += v != 0 && std::abs(y) <= 0x1p-10f;  // at most half the min subnormal: rounds to 0
  }
  QuantTensor q;
  quantize_with_scale(x.data(), 100, 100, Fp8Dtype::e4m3, scale, &q);
  ASSERT_GT(want_sat, 0);
  EXPECT_EQ(q.saturated, want_sat);
  EXPECT_EQ(q.underflowed, want_under);
  EXPECT_GE(want_under, 1);
  for (size_t i = 0; i < x.size(); ++i)
    if (std::abs(x[i] * scale) > 448.0f) {
      ASSERT_EQ(q.data[i] & 0x7F, 0x7E) << "saturates to max finite";
    }
}

TEST(Quantize, NaNInputGivesNaNByteAndScaleOne) {
  std::vector<float> x = normal_vector(256, 12);
  x[3] = NAN;
  QuantTensor q;
  const float a = quantize_current(x.data(), 16, 16, Fp8Dtype::e4m3, {}, {}, &q);
  EXPECT_TRUE(std::isnan(a));
  EXPECT_EQ(q.scale_inv[0], 1.0f);
  EXPECT_EQ(q.data[3], 0x7F);
}

TEST(Quantize, AmaxReductionIsApplied) {
  const std::vector<float> x = normal_vector(1000, 13);
  const float local = amax(x.data(), 1000);
  int calls = 0;
  QuantTensor q;
  const AmaxReduce reduce = [&](float* v, int64_t n) {
    ++calls;
    ASSERT_EQ(n, 1);
    *v = 100.0f;  // as if another tensor-parallel rank had seen 100
  };
  const float used = quantize_current(x.data(), 10, 100, Fp8Dtype::e4m3, {}, reduce, &q);
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(used, 100.0f);
  EXPECT_LT(local, 100.0f);
  EXPECT_EQ(q.scale_inv[0], 1.0f / float(reference_scale(100.0, Fp8Dtype::e4m3, 0, true)));
}

TEST(Quantize, EmptyTensor) {
  QuantTensor q;
  quantize_tiled(nullptr, 0, 256, Tiling::rows_1xT, 128, Fp8Dtype::e4m3, {}, &q);
  EXPECT_TRUE(q.data.empty());
  EXPECT_TRUE(q.scale_inv.empty());
  quantize_current(nullptr, 0, 64, Fp8Dtype::e4m3, {}, {}, &q);
  EXPECT_TRUE(q.data.empty());
}

TEST(DelayedScaling, HistoryWindowMaxAndMostRecent) {
  // Step amaxes and the history each step sees, checked against a plain model of the window.
  const std::vector<float> step_amax = {2.0f, 50.0f, 3.0f, 4.0f, 1.0f, 0.5f, 7.0f};
  for (auto compute : {DelayedScaling::Compute::max, DelayedScaling::Compute::most_recent})
    for (int margin : {0, 2}) {
      DelayedScaling st = make_delayed_scaling(3);
      EXPECT_EQ(st.scale, 1.0f);  // no history yet
      for (size_t s = 0; s < step_amax.size(); ++s) {
        std::vector<float> x = normal_vector(64, 20 + s);
        for (float& v : x) v = std::clamp(v, -1.0f, 1.0f) * step_amax[s] * 0.5f;
        x[s] = step_amax[s];
        const float scale_used = st.scale;
        QuantTensor q;
        const float a = quantize_delayed(x.data(), 8, 8, Fp8Dtype::e4m3, st, compute, {margin, true}, {}, &q);
        EXPECT_EQ(a, step_amax[s]);
        EXPECT_EQ(q.scale_inv[0], 1.0f / scale_used) << "quantized with the scale of earlier steps";
        double window = 0;  // the last 3 amaxes, or the newest
        for (size_t j = (s >= 2 ? s - 2 : 0); j <= s; ++j) window = std::max(window, double(step_amax[j]));
        const double want_amax = compute == DelayedScaling::Compute::max ? window : step_amax[s];
        EXPECT_EQ(delayed_amax(st, compute), float(want_amax)) << "step " << s;
        EXPECT_EQ(st.scale, float(reference_scale(want_amax, Fp8Dtype::e4m3, margin, true))) << "step " << s;
      }
      EXPECT_EQ(st.steps, int64_t(step_amax.size()));
    }
}

TEST(DelayedScaling, ZeroOrNonFiniteAmaxKeepsTheScale) {
  for (auto compute : {DelayedScaling::Compute::max, DelayedScaling::Compute::most_recent}) {
    DelayedScaling st = make_delayed_scaling(3);
    std::vector<float> x(64, 3.0f), zeros(64, 0.0f), nan(64, 1.0f);
    nan[7] = NAN;
    QuantTensor q;
    quantize_delayed(x.data(), 8, 8, Fp8Dtype::e5m2, st, compute, {}, {}, &q);
    const float scale = st.scale;
    EXPECT_EQ(scale, float(reference_scale(3.0, Fp8Dtype::e5m2, 0, true)));
    quantize_delayed(zeros.data(), 8, 8, Fp8Dtype::e5m2, st, compute, {}, {}, &q);  // an expert with no tokens
    if (compute == DelayedScaling::Compute::most_recent) {
      EXPECT_EQ(st.scale, scale) << "amax 0 keeps the previous scale";
    }
    quantize_delayed(nan.data(), 8, 8, Fp8Dtype::e5m2, st, compute, {}, {}, &q);
    EXPECT_EQ(st.scale, scale) << "a NaN step keeps the previous scale";
    // Then amax 6 (another scale than 3's): most_recent takes it at once; max keeps the scale while
    // the NaN is in its window of 3 (two more steps), then takes it.
    std::vector<float> x6(64, 6.0f);
    const float scale6 = float(reference_scale(6.0, Fp8Dtype::e5m2, 0, true));
    ASSERT_NE(scale6, scale);
    for (int step = 1; step <= 3; ++step) {
      quantize_delayed(x6.data(), 8, 8, Fp8Dtype::e5m2, st, compute, {}, {}, &q);
      if (compute == DelayedScaling::Compute::max && step < 3) {
        EXPECT_EQ(st.scale, scale) << "the NaN is still in the window, step " << step;
      } else {
        EXPECT_EQ(st.scale, scale6) << "step " << step;
      }
    }
  }
}

TEST(DelayedScaling, StaleScaleSaturatesAndIsCounted) {
  DelayedScaling st = make_delayed_scaling(4);
  std::vector<float> small(100, 0.01f), big(100, 5.0f);
  QuantTensor q;
  quantize_delayed(small.data(), 10, 10, Fp8Dtype::e4m3, st, DelayedScaling::Compute::max, {}, {}, &q);
  quantize_delayed(big.data(), 10, 10, Fp8Dtype::e4m3, st, DelayedScaling::Compute::max, {}, {}, &q);
  EXPECT_EQ(q.saturated, 100);  // the scale came from amax 0.01
  for (uint8_t b : q.data) EXPECT_EQ(b, 0x7E);
}

// ---- each device backend against the CPU backend ------------------------------------------------

std::vector<float> scaled_normal(int64_t rows, int64_t cols, uint64_t seed) {
  std::vector<float> x = normal_vector(rows * cols, seed);
  for (int64_t i = 0; i < rows * cols; ++i) x[i] *= std::ldexp(1.0f, int(i % 23) - 11);
  return x;
}

std::vector<float> host_dequantize(const QuantTensor& q) {
  std::vector<float> out = poisoned_f32(q.rows * q.cols);
  dequantize(q, out.data());
  return out;
}

TEST_P(DeviceOps, AmaxAndPerTensorQuantizeMatchCpuBitwise) {
  for (Fp8Dtype f : {Fp8Dtype::e4m3, Fp8Dtype::e5m2})
    for (auto [rows, cols] : {std::pair<int64_t, int64_t>{0, 16}, {1, 1}, {333, 129}, {2048, 1024}}) {
      SCOPED_TRACE(testing::Message() << to_string(f) << " " << rows << "x" << cols);
      const std::vector<float> x = scaled_normal(rows, cols, 5 + rows);
      const ScaleOptions opt{1, true};
      // Current scaling (amax -> scale -> quantize, on the device), and a fixed scale of 2^4 that
      // saturates the largest values and underflows the smallest (both counters).
      const float fixed = 16.0f;
      struct Out {
        std::vector<float> amax, scale, scale_inv, deq, fixed_scale_inv;
        std::vector<uint8_t> q, fixed_q;
        std::vector<uint64_t> counts, fixed_counts;
        std::vector<float> fused_amax;
      };
      auto [c, g] = both([&](Backend& be) {
        Tensor gx = up(be, x), amax = poisoned(be, DType::f32, 1), scale = poisoned(be, DType::f32, 1),
               fs = up(be, std::vector<float>{fixed}), fused_amax = poisoned(be, DType::f32, 1);
        Tensor counts = Tensor::zeros(be, DType::u64, {2}), fixed_counts = Tensor::zeros(be, DType::u64, {2});
        Tensor deq = poisoned(be, DType::f32, rows * cols);
        QTensor q = poisoned(be, rows, cols, f, Tiling::per_tensor, 1), fq = poisoned(be, rows, cols, f, Tiling::per_tensor, 1);
        be.amax(gx.f32(), rows * cols, amax.f32());
        be.scale_from_amax(amax.f32(), f, opt, scale.f32());
        be.quantize_scaled(gx.f32(), scale.f32(), q.view(), counts.data<uint64_t>());
        be.dequantize(q.view(), deq.f32());
        // Twice: the counters accumulate. The second also gives x's amax from the same pass.
        for (int i = 0; i < 2; ++i)
          be.quantize_scaled(gx.f32(), fs.f32(), fq.view(), fixed_counts.data<uint64_t>(), i ? fused_amax.f32() : nullptr);
        expect_unchanged(gx, x, "x");
        return Out{down<float>(amax), down<float>(scale), down<float>(q.scale_inv), down<float>(deq),
                   down<float>(fq.scale_inv), down<uint8_t>(q.data), down<uint8_t>(fq.data), down<uint64_t>(counts),
                   down<uint64_t>(fixed_counts), down<float>(fused_amax)};
      });
      // The CPU backend against the host library (quantize_current, quantize_with_scale).
      QuantTensor ref, ref_fixed;
      const float ref_amax = quantize_current(x.data(), rows, cols, f, opt, {}, &ref);
      quantize_with_scale(x.data(), rows, cols, f, fixed, &ref_fixed);
      EXPECT_EQ(float_bits(c.amax[0]), float_bits(ref_amax));
      EXPECT_EQ(float_bits(c.scale[0]), float_bits(compute_scale(ref_amax, fp8_max(f), opt.margin, opt.power_of_two)));
      expect_bitwise(c.q, ref.data, "cpu backend bytes vs quantize_current");
      expect_bitwise(c.scale_inv, ref.scale_inv, "cpu backend scale_inv vs quantize_current");
      expect_bitwise(c.deq, host_dequantize(ref), "cpu backend dequantize vs dequantize");
      EXPECT_EQ(c.counts[0], uint64_t(ref.saturated));
      EXPECT_EQ(c.counts[1], uint64_t(ref.underflowed));
      expect_bitwise(c.fixed_q, ref_fixed.data, "cpu backend bytes vs quantize_with_scale");
      expect_bitwise(c.fixed_scale_inv, ref_fixed.scale_inv, "cpu backend scale_inv vs quantize_with_scale");
      EXPECT_EQ(c.fixed_counts[0], uint64_t(2 * ref_fixed.saturated));
      EXPECT_EQ(c.fixed_counts[1], uint64_t(2 * ref_fixed.underflowed));
      EXPECT_EQ(float_bits(c.fused_amax[0]), float_bits(ref_amax)) << "quantize_scaled's amax vs quantize_current's";
      if (rows * cols > 1000) {
        EXPECT_GT(ref_fixed.saturated, 0) << "the fixed scale saturates some values";
      }
      if (rows * cols > 1000000) {
        EXPECT_GT(ref_fixed.underflowed, 0) << "the fixed scale underflows some values";
      }
      expect_bitwise(g.amax, c.amax, "amax");
      expect_bitwise(g.scale, c.scale, "scale");
      expect_bitwise(g.scale_inv, c.scale_inv, "scale_inv");
      expect_bitwise(g.fixed_scale_inv, c.fixed_scale_inv, "scale_inv (fixed scale)");
      expect_bitwise(g.q, c.q, "bytes");
      expect_bitwise(g.fixed_q, c.fixed_q, "bytes (fixed scale)");
      expect_bitwise(g.counts, c.counts, "counts");
      expect_bitwise(g.fixed_counts, c.fixed_counts, "counts (fixed scale)");
      expect_bitwise(g.deq, c.deq, "dequantize");
      expect_bitwise(g.fused_amax, c.fused_amax, "amax from quantize_scaled");
    }
}

// The formats and scale options the tiled quantization tests run.
struct TiledVariant {
  Fp8Dtype dtype;
  ScaleOptions opt;
};
const TiledVariant kTiledVariants[] = {{Fp8Dtype::e4m3, {0, true}}, {Fp8Dtype::e5m2, {0, true}},
                                       {Fp8Dtype::e4m3, {0, false}}, {Fp8Dtype::e4m3, {3, true}}};

TEST_P(DeviceOps, TiledQuantizeMatchesCpuBitwise) {
  for (const TiledVariant& v : kTiledVariants)
    for (Tiling t : {Tiling::rows_1xT, Tiling::cols_Tx1, Tiling::blocks_TxT})
      for (int tile : {128, 32})
        for (auto [rows, cols] : {std::pair<int64_t, int64_t>{0, 300}, {1, 300}, {257, 130}, {1024, 512}}) {
          SCOPED_TRACE(testing::Message() << to_string(v.dtype) << " pow2 " << v.opt.power_of_two << " margin "
                                          << v.opt.margin << " " << to_string(t) << " T" << tile << " " << rows << "x" << cols);
          std::vector<float> x = scaled_normal(rows, cols, 7 + rows + tile);
          // An all-zero first tile, a NaN, and a denormal-only region (amax near FLT_MIN: the clamp).
          for (int64_t c = 0; c < std::min<int64_t>(cols, tile) && rows > 0; ++c) x[c] = 0.0f;
          if (rows * cols > 400) x[400] = NAN;
          if (rows > 40)
            for (int64_t c = 0; c < cols; ++c) x[40 * cols + c] = 1e-39f * float(c % 3);
          struct Out {
            std::vector<uint8_t> q;
            std::vector<float> scale_inv, deq;
            std::vector<uint64_t> counts;
          };
          auto [c, g] = both([&](Backend& be) {
            Tensor gx = up(be, x), counts = Tensor::zeros(be, DType::u64, {2}), deq = poisoned(be, DType::f32, rows * cols);
            QTensor q = poisoned(be, rows, cols, v.dtype, t, tile);
            be.quantize_tiled(gx.f32(), v.opt, q.view(), counts.data<uint64_t>());
            be.dequantize(q.view(), deq.f32());
            expect_unchanged(gx, x, "x");
            return Out{down<uint8_t>(q.data), down<float>(q.scale_inv), down<float>(deq), down<uint64_t>(counts)};
          });
          QuantTensor ref;
          quantize_tiled(x.data(), rows, cols, t, tile, v.dtype, v.opt, &ref);
          expect_bitwise(c.q, ref.data, "cpu backend bytes vs quantize_tiled");
          expect_bitwise(c.scale_inv, ref.scale_inv, "cpu backend scale_inv vs quantize_tiled");
          expect_bitwise(c.deq, host_dequantize(ref), "cpu backend dequantize vs dequantize");
          EXPECT_EQ(c.counts[0], uint64_t(ref.saturated));
          EXPECT_EQ(c.counts[1], uint64_t(ref.underflowed));
          expect_bitwise(g.q, c.q, "bytes");
          expect_bitwise(g.scale_inv, c.scale_inv, "scale_inv");
          expect_bitwise(g.counts, c.counts, "counts");
          expect_bitwise(g.deq, c.deq, "dequantize");
        }
}

TEST_P(DeviceOps, TiledQuantizePairIsTheTwoTilings) {
  // quantize_tiled_pair (the 1 x T and T x 1 copies of one tensor from one read: fused on CUDA)
  // against the host quantize_tiled of each tiling, bitwise, with their own counters: tiles of
  // 128 (the staged 64 KiB region) and 16, partial regions on both edges, a region of zeros, a
  // NaN (its tiles' scales), denormals (underflow counts), with and without a margin.
  for (const TiledVariant& v : kTiledVariants)
    for (int tile : {128, 16})
      for (auto [rows, cols] : {std::pair<int64_t, int64_t>{0, 300}, {1, 300}, {257, 130}, {1024, 512}, {300, 7}}) {
        SCOPED_TRACE(testing::Message() << to_string(v.dtype) << " pow2 " << v.opt.power_of_two << " margin "
                                        << v.opt.margin << " T" << tile << " " << rows << "x" << cols);
        std::vector<float> x = scaled_normal(rows, cols, 11 + rows + tile);
        for (int64_t r = 0; r < std::min<int64_t>(rows, tile); ++r)
          for (int64_t c = 0; c < std::min<int64_t>(cols, tile); ++c) x[r * cols + c] = 0.0f;
        if (rows * cols > 2000) x[2000] = NAN;
        if (rows > 40)
          for (int64_t c = 0; c < cols; ++c) x[40 * cols + c] = 1e-39f * float(c % 3);
        struct Out {
          std::vector<uint8_t> qr, qc;
          std::vector<float> sr, sc;
          std::vector<uint64_t> counts;
        };
        auto [c, g] = both([&](Backend& be) {
          Tensor gx = up(be, x), counts = Tensor::zeros(be, DType::u64, {4});
          QTensor qr = poisoned(be, rows, cols, v.dtype, Tiling::rows_1xT, tile);
          QTensor qc = poisoned(be, rows, cols, v.dtype, Tiling::cols_Tx1, tile);
          be.quantize_tiled_pair(gx.f32(), v.opt, qr.view(), counts.data<uint64_t>(), qc.view(),
                                 counts.data<uint64_t>() + 2);
          expect_unchanged(gx, x, "x");
          return Out{down<uint8_t>(qr.data), down<uint8_t>(qc.data), down<float>(qr.scale_inv), down<float>(qc.scale_inv),
                     down<uint64_t>(counts)};
        });
        QuantTensor rr, rc;
        quantize_tiled(x.data(), rows, cols, Tiling::rows_1xT, tile, v.dtype, v.opt, &rr);
        quantize_tiled(x.data(), rows, cols, Tiling::cols_Tx1, tile, v.dtype, v.opt, &rc);
        const std::vector<uint64_t> ref_counts = {uint64_t(rr.saturated), uint64_t(rr.underflowed),
                                                  uint64_t(rc.saturated), uint64_t(rc.underflowed)};
        for (const Out* o : {&c, &g}) {
          expect_bitwise(o->qr, rr.data, "1 x T bytes");
          expect_bitwise(o->sr, rr.scale_inv, "1 x T scale_inv");
          expect_bitwise(o->qc, rc.data, "T x 1 bytes");
          expect_bitwise(o->sc, rc.scale_inv, "T x 1 scale_inv");
          expect_bitwise(o->counts, ref_counts, "counts");
        }
      }
}

TEST_P(DeviceOps, DeviceScalesMatchCpu) {
  // Current scaling and the delayed-scaling history, computed by each backend, against each other
  // and the host library's DelayedScaling.
  const std::vector<float> steps = {2.0f, 0.0f, 50.0f, NAN, 3.0f, 1e-30f, 7.0f};
  for (auto compute : {DelayedScalingCompute::max, DelayedScalingCompute::most_recent})
    for (Fp8Dtype f : {Fp8Dtype::e4m3, Fp8Dtype::e5m2}) {
      SCOPED_TRACE(testing::Message() << to_string(f) << (compute == DelayedScalingCompute::max ? " max" : " most recent"));
      const ScaleOptions opt{1, true};
      DelayedScaling ref = make_delayed_scaling(3);
      Backend* bes[2] = {&cpu(), &dev()};
      Tensor hist[2] = {Tensor::zeros(cpu(), DType::f32, {3}), Tensor::zeros(dev(), DType::f32, {3})};
      Tensor scale[2] = {up(cpu(), std::vector<float>{1.0f}), up(dev(), std::vector<float>{1.0f})};
      for (size_t s = 0; s < steps.size(); ++s) {
        std::vector<float> x(16, steps[s] * 0.5f);
        x[3] = steps[s];
        QuantTensor q;
        quantize_delayed(x.data(), 4, 4, f, ref, compute, opt, {}, &q);
        std::vector<float> got_scale[2], got_hist[2], current[2];
        for (int b = 0; b < 2; ++b) {
          Backend& be = *bes[b];
          Tensor amax = up(be, std::vector<float>{steps[s]}), cur = poisoned(be, DType::f32, 1);
          be.delayed_update(hist[b].f32(), 3, int64_t(s), amax.f32(), compute, f, opt, scale[b].f32());
          be.scale_from_amax(amax.f32(), f, opt, cur.f32());
          got_scale[b] = down<float>(scale[b]), got_hist[b] = down<float>(hist[b]), current[b] = down<float>(cur);
        }
        EXPECT_EQ(float_bits(got_scale[0][0]), float_bits(ref.scale)) << "step " << s;
        expect_bitwise(got_hist[0], ref.history, "cpu backend amax history vs DelayedScaling");
        expect_bitwise(got_scale[1], got_scale[0], "delayed scale");
        expect_bitwise(got_hist[1], got_hist[0], "amax history");
        EXPECT_EQ(float_bits(current[0][0]), float_bits(compute_scale(steps[s], fp8_max(f), 1, true))) << "step " << s;
        expect_bitwise(current[1], current[0], "current scale");
      }
    }
}

TEST_F(CudaOps, HardwareConversionMatchesEncoder) {
#if FP8MOE_HAVE_CUDA
  // cvt.rn.satfinite (sm_89+) for saturating mode; cuda_fp8.h's software path otherwise: both
  // against kernels/fp8.h on 2^24 random bit patterns and every boundary-heavy exponent.
  const int64_t n = int64_t(1) << 24;
  std::mt19937 rng(99);
  std::vector<float> x(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    uint32_t u = rng();
    if (i & 1) u = (u & 0x807FFFFFu) | ((100u + (u >> 23) % 60u) << 23);
    x[i] = bits_float(u);
  }
  Tensor dx = up(gpu(), x), dq = poisoned(gpu(), DType::u8, n);
  const cudaStream_t stream = cuda_backend(gpu()).compute_stream();
  for (Fp8Dtype f : {Fp8Dtype::e4m3, Fp8Dtype::e5m2})
    for (bool sat : {true, false}) {
      cuda::convert_hw(dx.f32(), n, f, sat, dq.data<uint8_t>(), stream);
      const std::vector<uint8_t> q = down<uint8_t>(dq);
      int64_t mismatches = 0;
      for (int64_t i = 0; i < n; ++i) mismatches += q[i] != fp8_encode(x[i], f, sat);
      EXPECT_EQ(mismatches, 0) << to_string(f) << (sat ? " satfinite" : " nosat");
    }
#endif
}

}  // namespace
}  // namespace fp8moe::test
