// Every op of the CUDA backend against the CPU backend (kernels/backend.h), both driven through the
// Backend interface from the same random inputs, at shapes that switch code paths (empty, one
// token, K not a multiple of 128, large): bitwise where the CUDA file says it is designed to be,
// within measured bounds elsewhere. The FP8 GEMMs also against an FP64 product of the unquantized
// inputs; the hardware FP8 conversion bit-exact against the CPU encoder. Needs a visible GPU;
// without one every test reports SKIPPED with the reason (it never passes). Needs no MPI, HDF5 or
// yaml-cpp.
#include <cublasLt.h>
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/backend.h"
#include "kernels/backend_info.h"
#include "kernels/check.h"
#include "kernels/cuda/backend.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/quantize.h"
#include "kernels/fp8.h"
#include "kernels/gemm_fp8.h"
#include "kernels/moe_ops.h"
#include "kernels/quantize.h"
#include "kernels/rope.h"
#include "kernels/router.h"
#include "kernels/tensor.h"
#include "tests/test_random.h"

namespace fp8moe {
namespace {

using test::normal_vector;

// The two backends, made once for the suite (the CUDA one holds streams, a cuBLASLt handle and its
// arena) and destroyed before the process exits.
class CudaOps : public testing::Test {
 protected:
  static void TearDownTestSuite() {
    gpu_.reset();
    cpu_.reset();
  }
  void SetUp() override {
    std::string why;
    if (cuda_device_count(&why) == 0) GTEST_SKIP() << "no CUDA device visible: " << why;
    if (!gpu_) gpu_ = make_backend(DeviceKind::cuda, 0);
    if (!cpu_) cpu_ = make_backend(DeviceKind::cpu);
  }
  static Backend& gpu() { return *gpu_; }
  static Backend& cpu() { return *cpu_; }
  // fn(be) on the CPU backend, then on the CUDA backend.
  template <class Fn>
  static auto both(Fn&& fn) {
    auto c = fn(cpu());
    auto g = fn(gpu());
    return std::make_pair(std::move(c), std::move(g));
  }

 private:
  static std::unique_ptr<Backend> cpu_, gpu_;
};
std::unique_ptr<Backend> CudaOps::cpu_, CudaOps::gpu_;

// ---- helpers ------------------------------------------------------------------------------------
template <class T>
Tensor up(Backend& be, const std::vector<T>& v) {
  return tensor_from(be, v, {int64_t(v.size())});
}
template <class T>
std::vector<T> down(const Tensor& t) {
  return to_host<T>(t);
}
// An FP8 tensor quantized on the host, in a backend's memory.
QTensor up(Backend& be, const QuantTensor& q) {
  QTensor t(be, q.rows, q.cols, q.dtype, q.tiling, q.tile);
  to_device(be, q.data, t.data.data<uint8_t>());
  to_device(be, q.scale_inv, t.scale_inv.f32());
  return t;
}

void expect_bitwise(const std::vector<float>& gpu, const std::vector<float>& cpu, const char* what) {
  ASSERT_EQ(gpu.size(), cpu.size()) << what;
  for (size_t i = 0; i < gpu.size(); ++i) ASSERT_EQ(float_bits(gpu[i]), float_bits(cpu[i])) << what << " element " << i;
}
void expect_bitwise(const std::vector<double>& gpu, const std::vector<double>& cpu, const char* what) {
  ASSERT_EQ(gpu.size(), cpu.size()) << what;
  for (size_t i = 0; i < gpu.size(); ++i) {
    uint64_t a, b;
    std::memcpy(&a, &gpu[i], 8), std::memcpy(&b, &cpu[i], 8);
    ASSERT_EQ(a, b) << what << " element " << i << ": " << gpu[i] << " vs " << cpu[i];
  }
}
// |gpu - cpu| <= tol max|cpu| + floor, element by element (floor: an absolute allowance for results
// that cancel to nothing, whose rounding is relative to their terms, not to themselves).
template <class T>
void expect_near_rel(const std::vector<T>& gpu, const std::vector<T>& cpu, double tol, const char* what,
                     double floor = 0) {
  ASSERT_EQ(gpu.size(), cpu.size()) << what;
  double scale = 0;
  for (T v : cpu) scale = std::max(scale, double(std::abs(v)));
  for (size_t i = 0; i < gpu.size(); ++i)
    ASSERT_LE(std::abs(double(gpu[i]) - double(cpu[i])), tol * scale + floor + 1e-30)
        << what << " element " << i << " of " << gpu.size();
}
double max_abs(const std::vector<float>& v) {
  double m = 0;
  for (float x : v) m = std::max(m, double(std::abs(x)));
  return m;
}
std::vector<float> scaled_normal(int64_t rows, int64_t cols, uint64_t seed) {
  std::vector<float> x = normal_vector(rows * cols, seed);
  for (int64_t i = 0; i < rows * cols; ++i) x[i] *= std::ldexp(1.0f, int(i % 23) - 11);
  return x;
}

// ---- element-wise ----------------------------------------------------------------------------------
// NOTE: the same source (kernels/swiglu.h) runs on both sides, but the device expf differs from
// glibc's by up to 2 ulp and nvcc fuses multiply-adds (1 + a * (1 - s) cancels near a = -1.28),
// so results agree to rounding relative to the size of the terms (`scale`), not bitwise.
void expect_close(const std::vector<float>& gpu, const std::vector<float>& cpu, const std::vector<float>& scale,
                  const char* what) {
  ASSERT_EQ(gpu.size(), cpu.size());
  for (size_t i = 0; i < gpu.size(); ++i)
    ASSERT_LE(std::abs(gpu[i] - cpu[i]), 1e-5f * (std::abs(cpu[i]) + scale[i])) << what << " element " << i;
}

TEST_F(CudaOps, SwigluMatchesCpu) {
  for (int64_t n : {int64_t(0), int64_t(1), int64_t(1000), int64_t(1 << 22) + 5}) {
    SCOPED_TRACE(n);
    std::mt19937_64 rng(42 + n);
    std::normal_distribution<float> normal(0.0f, 3.0f);
    std::vector<float> a(n), b(n), dy(n);
    for (int64_t i = 0; i < n; ++i) a[i] = normal(rng), b[i] = normal(rng), dy[i] = normal(rng);
    auto [c, g] = both([&](Backend& be) {
      Tensor ga = up(be, a), gb = up(be, b), gdy = up(be, dy), y(be, DType::f32, {n}), da(be, DType::f32, {n}),
             db(be, DType::f32, {n});
      be.swiglu_forward(ga.f32(), gb.f32(), y.f32(), n);
      be.swiglu_backward(ga.f32(), gb.f32(), gdy.f32(), da.f32(), db.f32(), n);
      return std::make_tuple(down<float>(y), down<float>(da), down<float>(db));
    });
    // Term sizes as in tests/kernels/test_swiglu.cpp: |a b|, |dy b| (1 + |a|), |dy a|.
    std::vector<float> sy(n), sda(n), sdb(n);
    for (int64_t i = 0; i < n; ++i)
      sy[i] = std::abs(a[i] * b[i]), sda[i] = std::abs(dy[i] * b[i]) * (1 + std::abs(a[i])), sdb[i] = std::abs(dy[i] * a[i]);
    expect_close(std::get<0>(g), std::get<0>(c), sy, "y");
    expect_close(std::get<1>(g), std::get<1>(c), sda, "da");
    expect_close(std::get<2>(g), std::get<2>(c), sdb, "db");
  }
}

TEST_F(CudaOps, ElementwiseAddMatchesCpuBitwise) {
  for (int64_t n : {int64_t(0), int64_t(1), int64_t(1000), int64_t(1 << 20) + 3}) {
    SCOPED_TRACE(n);
    const auto a = normal_vector(n, 1 + n), b = normal_vector(n, 2 + n);
    auto [c, g] = both([&](Backend& be) {
      Tensor ga = up(be, a), gb = up(be, b), out(be, DType::f32, {n});
      be.add(ga.f32(), gb.f32(), out.f32(), n);
      be.add(ga.f32(), out.f32(), ga.f32(), n);  // in place: a + (a + b)
      return std::make_pair(down<float>(out), down<float>(ga));
    });
    expect_bitwise(g.first, c.first, "a + b");
    expect_bitwise(g.second, c.second, "a += out");
  }
}

// ---- quantization ---------------------------------------------------------------------------------
TEST_F(CudaOps, AmaxAndPerTensorQuantizeMatchCpuBitwise) {
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
      };
      auto [c, g] = both([&](Backend& be) {
        Tensor gx = up(be, x), amax(be, DType::f32, {1}), scale(be, DType::f32, {1}), fs = up(be, std::vector<float>{fixed});
        Tensor counts = Tensor::zeros(be, DType::u64, {2}), fixed_counts = Tensor::zeros(be, DType::u64, {2});
        Tensor deq(be, DType::f32, {rows * cols});
        QTensor q(be, rows, cols, f, Tiling::per_tensor, 1), fq(be, rows, cols, f, Tiling::per_tensor, 1);
        be.amax(gx.f32(), rows * cols, amax.f32());
        be.scale_from_amax(amax.f32(), f, opt, scale.f32());
        be.quantize_scaled(gx.f32(), scale.f32(), q.view(), counts.data<uint64_t>());
        be.dequantize(q.view(), deq.f32());
        // Twice: the counters accumulate.
        for (int i = 0; i < 2; ++i) be.quantize_scaled(gx.f32(), fs.f32(), fq.view(), fixed_counts.data<uint64_t>());
        return Out{down<float>(amax), down<float>(scale), down<float>(q.scale_inv), down<float>(deq),
                   down<float>(fq.scale_inv), down<uint8_t>(q.data), down<uint8_t>(fq.data), down<uint64_t>(counts),
                   down<uint64_t>(fixed_counts)};
      });
      // The CPU backend against the host library (quantize_current, quantize_with_scale).
      QuantTensor ref, ref_fixed;
      const float ref_amax = quantize_current(x.data(), rows, cols, f, opt, {}, &ref);
      quantize_with_scale(x.data(), rows, cols, f, fixed, &ref_fixed);
      EXPECT_EQ(float_bits(c.amax[0]), float_bits(ref_amax));
      EXPECT_EQ(c.q, ref.data);
      EXPECT_EQ(c.counts[0], uint64_t(ref.saturated));
      EXPECT_EQ(c.counts[1], uint64_t(ref.underflowed));
      EXPECT_EQ(c.fixed_q, ref_fixed.data);
      EXPECT_EQ(c.fixed_counts[0], uint64_t(2 * ref_fixed.saturated));
      EXPECT_EQ(c.fixed_counts[1], uint64_t(2 * ref_fixed.underflowed));
      if (rows * cols > 1000) {
        EXPECT_GT(ref_fixed.saturated, 0) << "the fixed scale saturates some values";
      }
      expect_bitwise(g.amax, c.amax, "amax");
      expect_bitwise(g.scale, c.scale, "scale");
      expect_bitwise(g.scale_inv, c.scale_inv, "scale_inv");
      expect_bitwise(g.fixed_scale_inv, c.fixed_scale_inv, "scale_inv (fixed scale)");
      EXPECT_EQ(g.q, c.q);
      EXPECT_EQ(g.fixed_q, c.fixed_q);
      EXPECT_EQ(g.counts, c.counts);
      EXPECT_EQ(g.fixed_counts, c.fixed_counts);
      expect_bitwise(g.deq, c.deq, "dequantize");
    }
}

TEST_F(CudaOps, TiledQuantizeMatchesCpuBitwise) {
  struct Variant {
    Fp8Dtype dtype;
    ScaleOptions opt;
  };
  for (Variant v : {Variant{Fp8Dtype::e4m3, {0, true}}, Variant{Fp8Dtype::e5m2, {0, true}},
                    Variant{Fp8Dtype::e4m3, {0, false}}, Variant{Fp8Dtype::e4m3, {3, true}}})
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
            Tensor gx = up(be, x), counts = Tensor::zeros(be, DType::u64, {2}), deq(be, DType::f32, {rows * cols});
            QTensor q(be, rows, cols, v.dtype, t, tile);
            be.quantize_tiled(gx.f32(), v.opt, q.view(), counts.data<uint64_t>());
            be.dequantize(q.view(), deq.f32());
            return Out{down<uint8_t>(q.data), down<float>(q.scale_inv), down<float>(deq), down<uint64_t>(counts)};
          });
          QuantTensor ref;
          quantize_tiled(x.data(), rows, cols, t, tile, v.dtype, v.opt, &ref);
          EXPECT_EQ(c.q, ref.data);
          EXPECT_EQ(c.counts[0], uint64_t(ref.saturated));
          EXPECT_EQ(g.q, c.q);
          expect_bitwise(g.scale_inv, c.scale_inv, "scale_inv");
          EXPECT_EQ(g.counts, c.counts);
          expect_bitwise(g.deq, c.deq, "dequantize");
        }
}

TEST_F(CudaOps, DeviceScalesMatchCpu) {
  // Current scaling and the delayed-scaling history, computed by each backend, against each other
  // and the host library's DelayedScaling.
  const std::vector<float> steps = {2.0f, 0.0f, 50.0f, NAN, 3.0f, 1e-30f, 7.0f};
  for (auto compute : {DelayedScalingCompute::max, DelayedScalingCompute::most_recent})
    for (Fp8Dtype f : {Fp8Dtype::e4m3, Fp8Dtype::e5m2}) {
      SCOPED_TRACE(testing::Message() << to_string(f) << (compute == DelayedScalingCompute::max ? " max" : " most recent"));
      const ScaleOptions opt{1, true};
      DelayedScaling ref = make_delayed_scaling(3);
      Tensor hist[2] = {Tensor::zeros(cpu(), DType::f32, {3}), Tensor::zeros(gpu(), DType::f32, {3})};
      Tensor scale[2] = {up(cpu(), std::vector<float>{1.0f}), up(gpu(), std::vector<float>{1.0f})};
      for (size_t s = 0; s < steps.size(); ++s) {
        std::vector<float> x(16, steps[s] * 0.5f);
        x[3] = steps[s];
        QuantTensor q;
        quantize_delayed(x.data(), 4, 4, f, ref, compute, opt, {}, &q);
        std::vector<float> got_scale[2], got_hist[2], current[2];
        Backend* bes[2] = {&cpu(), &gpu()};
        for (int b = 0; b < 2; ++b) {
          Backend& be = *bes[b];
          Tensor amax = up(be, std::vector<float>{steps[s]}), cur(be, DType::f32, {1});
          be.delayed_update(hist[b].f32(), 3, int64_t(s), amax.f32(), compute, f, opt, scale[b].f32());
          be.scale_from_amax(amax.f32(), f, opt, cur.f32());
          got_scale[b] = down<float>(scale[b]), got_hist[b] = down<float>(hist[b]), current[b] = down<float>(cur);
        }
        EXPECT_EQ(float_bits(got_scale[0][0]), float_bits(ref.scale)) << "step " << s;
        expect_bitwise(got_scale[1], got_scale[0], "delayed scale");
        expect_bitwise(got_hist[1], got_hist[0], "amax history");
        EXPECT_EQ(float_bits(current[0][0]), float_bits(compute_scale(steps[s], fp8_max(f), 1, true))) << "step " << s;
        expect_bitwise(current[1], current[0], "current scale");
      }
    }
}

TEST_F(CudaOps, HardwareConversionMatchesEncoder) {
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
  Tensor dx = up(gpu(), x), dq(gpu(), DType::u8, {n});
  const cudaStream_t stream = cuda_backend(gpu()).compute_stream();
  for (Fp8Dtype f : {Fp8Dtype::e4m3, Fp8Dtype::e5m2})
    for (bool sat : {true, false}) {
      cuda::convert_hw(dx.f32(), n, f, sat, dq.data<uint8_t>(), stream);
      const std::vector<uint8_t> q = down<uint8_t>(dq);
      int64_t mismatches = 0;
      for (int64_t i = 0; i < n; ++i) mismatches += q[i] != fp8_encode(x[i], f, sat);
      EXPECT_EQ(mismatches, 0) << to_string(f) << (sat ? " satfinite" : " nosat");
    }
}

TEST_F(CudaOps, CublasLtHandleCanBeCreated) {
  cublasLtHandle_t handle = nullptr;
  CUBLAS_CHECK(cublasLtCreate(&handle));
  EXPECT_NE(handle, nullptr);
  CUBLAS_CHECK(cublasLtDestroy(handle));
}

// ---- norms, RoPE, attention, loss, embedding ------------------------------------------------------
TEST_F(CudaOps, RmsNormMatchesCpu) {
  for (auto [N, D] : {std::pair<int64_t, int64_t>{0, 64}, {1, 1}, {37, 300}, {4096, 7168}}) {
    SCOPED_TRACE(testing::Message() << N << "x" << D);
    const auto x = normal_vector(N * D, 1 + N), w = normal_vector(D, 2 + D), dy = normal_vector(N * D, 3 + N);
    const auto dw0 = normal_vector(D, 4);
    struct Out {
      std::vector<float> y, rstd, dx, dw;
    };
    std::vector<float> cpu_rstd;
    auto [c, g] = both([&](Backend& be) {
      Tensor gx = up(be, x), gw = up(be, w), gdy = up(be, dy), gdw = up(be, dw0);
      Tensor y(be, DType::f32, {N * D}), r(be, DType::f32, {N}), dx(be, DType::f32, {N * D});
      be.rmsnorm_forward(gx.f32(), gw.f32(), N, D, 1e-6f, y.f32(), r.f32());
      Out o{down<float>(y), down<float>(r), {}, {}};
      if (cpu_rstd.empty() && &be == &cpu()) cpu_rstd = o.rstd;
      // The backward from the CPU's rstd on both backends, so that dw can be compared bitwise.
      Tensor rc = up(be, cpu_rstd);
      be.rmsnorm_backward(gx.f32(), gw.f32(), rc.f32(), gdy.f32(), N, D, dx.f32(), gdw.f32());
      o.dx = down<float>(dx), o.dw = down<float>(gdw);
      return o;
    });
    // Row sums in double in another order: rstd may differ in its last bit, rarely.
    expect_near_rel(g.y, c.y, 1e-6, "y");
    expect_near_rel(g.rstd, c.rstd, 1e-6, "rstd");
    expect_near_rel(g.dx, c.dx, 1e-5, "dx");
    // dw: one thread per column, tokens in order: the CPU's operation order (bitwise, same rstd).
    expect_bitwise(g.dw, c.dw, "dw");
  }
}

TEST_F(CudaOps, RopeMatchesCpuBitwise) {
  for (auto [B, T, heads, hd] : {std::tuple<int64_t, int64_t, int64_t, int64_t>{1, 1, 1, 2}, {2, 17, 3, 64}, {4, 512, 8, 128}, {0, 4, 2, 8}}) {
    for (bool inverse : {false, true}) {
      SCOPED_TRACE(testing::Message() << "B" << B << " T" << T << " heads " << heads << " hd " << hd << (inverse ? " inverse" : ""));
      const auto x = normal_vector(B * T * heads * hd, 5 + T);
      std::vector<float> cs(static_cast<size_t>(T * hd / 2)), sn(cs.size());
      cpu::rope_table(T, hd, 10000.0, inverse, cs.data(), sn.data());
      auto [c, g] = both([&](Backend& be) {
        Tensor gx = up(be, x), gc = up(be, cs), gs = up(be, sn);
        be.rope(gx.f32(), B, T, heads, hd, gc.f32(), gs.f32());
        return down<float>(gx);
      });
      std::vector<float> ref = x;
      cpu::rope(ref.data(), B, T, heads, hd, 10000.0, inverse);
      expect_bitwise(c, ref, "cpu backend vs cpu::rope");
      expect_bitwise(g, c, "rope");
    }
  }
}

TEST_F(CudaOps, AttentionMatchesCpu) {
  struct S {
    int64_t B, T, H, KVH, hd;
  };
  for (S s : {S{1, 1, 1, 1, 2}, S{2, 17, 4, 1, 16}, S{1, 64, 4, 2, 64}, S{2, 256, 8, 8, 128}, S{1, 40, 2, 1, 192},
              S{0, 8, 2, 1, 16}}) {
    SCOPED_TRACE(testing::Message() << "B" << s.B << " T" << s.T << " H" << s.H << " KVH" << s.KVH << " hd" << s.hd);
    const int64_t nq = s.B * s.T * s.H * s.hd, nk = s.B * s.T * s.KVH * s.hd, nl = s.B * s.H * s.T;
    const auto q = normal_vector(nq, 11, 2.0f), k = normal_vector(nk, 12, 2.0f), v = normal_vector(nk, 13),
               dout = normal_vector(nq, 14);
    struct Out {
      std::vector<float> out, lse, dq, dk, dv;
    };
    // Each backend's backward from its own forward (the pipeline a step runs).
    auto [c, g] = both([&](Backend& be) {
      Tensor gq = up(be, q), gk = up(be, k), gv = up(be, v), gd = up(be, dout);
      Tensor o(be, DType::f32, {nq}), l(be, DType::f32, {nl}), dq(be, DType::f32, {nq}), dk(be, DType::f32, {nk}),
          dv(be, DType::f32, {nk});
      be.attention_forward(gq.f32(), gk.f32(), gv.f32(), s.B, s.T, s.H, s.KVH, s.hd, o.f32(), l.f32());
      be.attention_backward(gq.f32(), gk.f32(), gv.f32(), o.f32(), l.f32(), gd.f32(), s.B, s.T, s.H, s.KVH, s.hd,
                            dq.f32(), dk.f32(), dv.f32());
      return Out{down<float>(o), down<float>(l), down<float>(dq), down<float>(dk), down<float>(dv)};
    });
    // Online softmax in FP32 on the GPU, softmax in double on the CPU.
    expect_near_rel(g.out, c.out, 1e-5, "out");
    expect_near_rel(g.lse, c.lse, 1e-5, "lse");
    // dq and dk cancel to zero at T = 1 (the softmax of one score does not depend on it): what is
    // left is rounding of terms of size max|dout| max|v| max|k| (or max|q|). The H200 run
    // (2026-11-30) measured 1.5e-9 (GPU) against 8e-13 (CPU) there, which the relative bound alone
    // refused; the floor is 1e-6 of those terms. Not yet run on a GPU in this form.
    const double terms = max_abs(dout) * max_abs(v);
    expect_near_rel(g.dq, c.dq, 1e-4, "dq", 1e-6 * terms * max_abs(k));
    expect_near_rel(g.dk, c.dk, 1e-4, "dk", 1e-6 * terms * max_abs(q));
    expect_near_rel(g.dv, c.dv, 1e-4, "dv");
  }
}

std::vector<int32_t> ce_targets(int64_t N, int64_t V) {
  std::vector<int32_t> t(static_cast<size_t>(N));
  for (int64_t n = 0; n < N; ++n) t[n] = n % 5 == 3 ? -1 : int32_t((n * 7919) % V);  // -1: ignored
  return t;
}

TEST_F(CudaOps, CrossEntropyMatchesCpu) {
  for (auto [N, V] : {std::pair<int64_t, int64_t>{0, 7}, {1, 7}, {100, 1000}, {64, 129280}}) {
    SCOPED_TRACE(testing::Message() << N << "x" << V);
    const auto logits = normal_vector(N * V, 21 + V, 3.0f);
    const auto t = ce_targets(N, V);
    struct Out {
      std::vector<double> loss, loss_only;
      std::vector<float> dl;
    };
    auto [c, g] = both([&](Backend& be) {
      Tensor gl = up(be, logits), gt = up(be, t), gd(be, DType::f32, {N * V}), loss(be, DType::f64, {1}),
             loss2(be, DType::f64, {1});
      be.cross_entropy(gl.f32(), gt.data<int32_t>(), N, V, -1, 0.5f, gd.f32(), loss.data<double>());
      be.cross_entropy(gl.f32(), gt.data<int32_t>(), N, V, -1, 0.5f, nullptr, loss2.data<double>());  // loss only
      return Out{down<double>(loss), down<double>(loss2), down<float>(gd)};
    });
    EXPECT_NEAR(g.loss[0], c.loss[0], 1e-9 * (std::abs(c.loss[0]) + 1));
    EXPECT_EQ(g.loss_only[0], g.loss[0]) << "the loss does not depend on whether dlogits is asked for";
    expect_near_rel(g.dl, c.dl, 1e-6, "dlogits");
  }
}

TEST_F(CudaOps, VocabParallelCrossEntropyMatchesCpu) {
  // Two vocabulary shards, the all-reduces done on the host between the steps (the tensor-parallel
  // group's job): each step on the same inputs on both backends.
  for (auto [N, V] : {std::pair<int64_t, int64_t>{0, 8}, {1, 8}, {100, 1000}, {64, 129280}}) {
    SCOPED_TRACE(testing::Message() << N << "x" << V);
    const auto logits = normal_vector(N * V, 23 + V, 3.0f);
    const auto t = ce_targets(N, V);
    const int64_t v0s[2] = {0, V / 2}, Vls[2] = {V / 2, V - V / 2};
    std::vector<float> shard[2];
    for (int s = 0; s < 2; ++s)
      for (int64_t n = 0; n < N; ++n)
        shard[s].insert(shard[s].end(), logits.begin() + n * V + v0s[s], logits.begin() + n * V + v0s[s] + Vls[s]);
    std::vector<float> mx(static_cast<size_t>(N), -INFINITY);
    for (int s = 0; s < 2; ++s) {
      auto [c, g] = both([&](Backend& be) {
        Tensor gl = up(be, shard[s]), m(be, DType::f32, {N});
        be.ce_row_max(gl.f32(), N, Vls[s], m.f32());
        return down<float>(m);
      });
      expect_bitwise(g, c, "ce_row_max");
      for (int64_t n = 0; n < N; ++n) mx[n] = std::max(mx[n], c[n]);
    }
    std::vector<double> se(static_cast<size_t>(N), 0.0), tl(static_cast<size_t>(N), 0.0);
    for (int s = 0; s < 2; ++s) {
      auto [c, g] = both([&](Backend& be) {
        Tensor gl = up(be, shard[s]), gt = up(be, t), gm = up(be, mx), gse(be, DType::f64, {N}), gtl(be, DType::f64, {N});
        be.ce_partials(gl.f32(), gt.data<int32_t>(), N, Vls[s], v0s[s], -1, gm.f32(), gse.data<double>(),
                       gtl.data<double>());
        return std::make_pair(down<double>(gse), down<double>(gtl));
      });
      expect_near_rel(g.first, c.first, 1e-11, "se");  // up to 64640 terms: a block tree vs serial
      expect_bitwise(g.second, c.second, "tl");
      for (int64_t n = 0; n < N; ++n) se[n] += c.first[n], tl[n] += c.second[n];
    }
    double total[2] = {0, 0};  // cpu, gpu
    for (int s = 0; s < 2; ++s) {
      auto [c, g] = both([&](Backend& be) {
        Tensor gl = up(be, shard[s]), gt = up(be, t), gm = up(be, mx), gse = up(be, se), gtl = up(be, tl);
        Tensor gd(be, DType::f32, {N * Vls[s]}), loss(be, DType::f64, {1});
        be.ce_finish(gl.f32(), gt.data<int32_t>(), N, Vls[s], v0s[s], -1, gm.f32(), gse.data<double>(),
                     gtl.data<double>(), 0.5f, gd.f32(), loss.data<double>());
        return std::make_pair(down<double>(loss), down<float>(gd));
      });
      EXPECT_NEAR(g.first[0], c.first[0], 1e-9 * (std::abs(c.first[0]) + 1));
      expect_near_rel(g.second, c.second, 1e-6, "dlogits");
      if (s == 0) total[0] = c.first[0], total[1] = g.first[0];
    }
    // Every shard's ce_finish returns the whole loss (the rows are the same on every rank).
    auto [c1, g1] = both([&](Backend& be) {
      Tensor gl = up(be, logits), gt = up(be, t), loss(be, DType::f64, {1});
      be.cross_entropy(gl.f32(), gt.data<int32_t>(), N, V, -1, 0.5f, nullptr, loss.data<double>());
      return down<double>(loss);
    });
    EXPECT_NEAR(total[0], c1[0], 1e-9 * (std::abs(c1[0]) + 1)) << "vocabulary-parallel vs whole, cpu";
    EXPECT_NEAR(total[1], g1[0], 1e-9 * (std::abs(g1[0]) + 1)) << "vocabulary-parallel vs whole, cuda";
  }
}

TEST_F(CudaOps, EmbeddingMatchesCpuBitwise) {
  const int64_t V = 1000, D = 96;
  // The whole vocabulary, then this rank's rows [300, 700) of it (tensor parallelism).
  for (auto [N, v0, Vl] : {std::tuple<int64_t, int64_t, int64_t>{4097, 0, V}, {4097, 300, 400}, {1, 0, V}, {0, 0, V}}) {
    SCOPED_TRACE(testing::Message() << "N " << N << " rows [" << v0 << ", " << v0 + Vl << ")");
    const auto table = normal_vector(Vl * D, 31), dout = normal_vector(N * D, 32), dtable0 = normal_vector(Vl * D, 33);
    std::vector<int32_t> ids(static_cast<size_t>(N));
    for (int64_t n = 0; n < N; ++n) ids[n] = int32_t((n * n) % 37 * 27 % V);  // many repeats, local and not
    auto [c, g] = both([&](Backend& be) {
      Tensor gtab = up(be, table), gdo = up(be, dout), gdt = up(be, dtable0), gid = up(be, ids),
             out(be, DType::f32, {N * D});
      be.embedding_forward(gtab.f32(), gid.data<int32_t>(), N, D, v0, Vl, out.f32());
      be.embedding_backward(gdo.f32(), gid.data<int32_t>(), N, D, v0, Vl, gdt.f32());
      return std::make_pair(down<float>(out), down<float>(gdt));
    });
    expect_bitwise(g.first, c.first, "embedding");
    expect_bitwise(g.second, c.second, "dtable");
    if (v0 > 0 && N > 0) {
      const int64_t n_far = std::find_if(ids.begin(), ids.end(), [&](int32_t id) { return id < v0 || id >= v0 + Vl; }) - ids.begin();
      ASSERT_LT(n_far, N);
      for (int64_t d = 0; d < D; ++d) ASSERT_EQ(g.first[n_far * D + d], 0.0f) << "a non-local id's row is 0";
    }
  }
}

// ---- MoE routing, permutation, gradients ----------------------------------------------------------
struct RouterCase {
  int64_t N, E, k;
  bool sigmoid;
  int64_t groups, topk_group;
  bool normalise;
  double scaling;
  int64_t capacity;
};

RouterRule rule_of(const RouterCase& s) {
  RouterRule r;
  r.top_k = s.k, r.sigmoid = s.sigmoid, r.n_group = s.groups, r.topk_group = s.topk_group;
  r.normalise = s.normalise, r.scaling = s.scaling, r.capacity = s.capacity;
  return r;
}

// The buffers of one routing in a backend's memory.
struct Routing {
  int64_t N, E, k;
  Tensor prob, expert, gate, kept, load, offsets, row_token, row_slot, slot_row;
  Routing(Backend& be, int64_t N_, int64_t E_, int64_t k_) : N(N_), E(E_), k(k_) {
    prob = Tensor(be, DType::f32, {N, E}), expert = Tensor(be, DType::i32, {N, k}), gate = Tensor(be, DType::f32, {N, k});
    kept = Tensor(be, DType::u8, {N, k}), load = Tensor(be, DType::i64, {E}), offsets = Tensor(be, DType::i64, {E + 1});
    row_token = Tensor(be, DType::i64, {N * k}), row_slot = Tensor(be, DType::i32, {N * k});
    slot_row = Tensor(be, DType::i32, {N, k});
  }
  RoutingBuffers buffers() {
    return {N, E, k, prob.f32(), expert.data<int32_t>(), gate.f32(), kept.data<uint8_t>(), load.data<int64_t>(),
            offsets.data<int64_t>(), row_token.data<int64_t>(), row_slot.data<int32_t>(), slot_row.data<int32_t>()};
  }
};

// A routing's buffers on the host (row_token, row_slot: the R rows in use).
struct HostRouting {
  std::vector<float> prob, gate;
  std::vector<int32_t> expert, row_slot, slot_row;
  std::vector<uint8_t> kept;
  std::vector<int64_t> load, offsets, row_token;
  int64_t R = 0;
  explicit HostRouting(const Routing& r) {
    prob = down<float>(r.prob), gate = down<float>(r.gate), expert = down<int32_t>(r.expert);
    kept = down<uint8_t>(r.kept), load = down<int64_t>(r.load), offsets = down<int64_t>(r.offsets);
    slot_row = down<int32_t>(r.slot_row);
    R = offsets.back();
    row_token = down<int64_t>(r.row_token), row_slot = down<int32_t>(r.row_slot);
    row_token.resize(size_t(R)), row_slot.resize(size_t(R));
  }
};

// The same routing in another backend's memory.
Routing copy_routing(const HostRouting& h, Backend& be, int64_t N, int64_t E, int64_t k) {
  Routing r(be, N, E, k);
  to_device(be, h.prob, r.prob.f32()), to_device(be, h.gate, r.gate.f32()), to_device(be, h.expert, r.expert.data<int32_t>());
  to_device(be, h.kept, r.kept.data<uint8_t>()), to_device(be, h.load, r.load.data<int64_t>());
  to_device(be, h.offsets, r.offsets.data<int64_t>()), to_device(be, h.slot_row, r.slot_row.data<int32_t>());
  to_device(be, h.row_token, r.row_token.data<int64_t>()), to_device(be, h.row_slot, r.row_slot.data<int32_t>());
  return r;
}

// Router logits whose keys have no near-ties, so that expf vs glibc cannot flip a choice: per
// token a random order of the groups and, inside each, of the experts, on a grid of 8 / E in
// [-4, 4): every expert of a better-placed group scores above every expert of a worse one, so the
// group scores are strictly ordered too.
std::vector<float> router_logits(const RouterCase& s, uint64_t seed) {
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

const RouterCase kRouterCases[] = {
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

TEST_F(CudaOps, RoutingPermuteUnpermuteMatchCpu) {
  for (const RouterCase& s : kRouterCases) {
    SCOPED_TRACE(testing::Message() << "N" << s.N << " E" << s.E << " k" << s.k << (s.sigmoid ? " sigmoid" : " softmax")
                                    << " groups " << s.groups << "/" << s.topk_group << " normalise " << s.normalise
                                    << " scaling " << s.scaling << " cap " << s.capacity);
    const auto z = router_logits(s, 40 + s.N + s.E);
    std::vector<float> bias(static_cast<size_t>(s.E), 0.0f);
    bias[3] = -10.0f;  // expert 3 receives nothing (the bias steers the keys, never the gates)
    auto [c, g] = both([&](Backend& be) {
      Tensor gz = up(be, z), gb = up(be, bias);
      Routing r(be, s.N, s.E, s.k);
      be.route(gz.f32(), gb.f32(), rule_of(s), r.buffers());
      return HostRouting(r);
    });
    EXPECT_EQ(g.expert, c.expert);
    EXPECT_EQ(g.kept, c.kept);
    EXPECT_EQ(g.load, c.load);
    EXPECT_EQ(g.offsets, c.offsets);
    EXPECT_EQ(g.row_token, c.row_token);
    EXPECT_EQ(g.row_slot, c.row_slot);
    EXPECT_EQ(g.slot_row, c.slot_row);
    EXPECT_EQ(c.load[3], 0);
    if (s.capacity == 0) {
      EXPECT_EQ(c.R, 0);
    }
    expect_near_rel(g.prob, c.prob, 1e-6, "prob");
    expect_near_rel(g.gate, c.gate, 1e-6, "gate");

    // permute / unpermute_add on the CPU's routing in each backend's memory (bitwise).
    const int64_t D = 72, R = c.R;
    const auto x = normal_vector(s.N * D, 41), rows = normal_vector(R * D, 42), out0 = normal_vector(s.N * D, 43);
    struct Out {
      std::vector<float> perm, gated, ungated;
    };
    auto [pc, pg] = both([&](Backend& be) {
      Routing r = copy_routing(c, be, s.N, s.E, s.k);
      const RoutingBuffers rb = r.buffers();
      Tensor gx = up(be, x), grows = up(be, rows), gated = up(be, out0), ungated = up(be, out0), perm(be, DType::f32, {R * D});
      be.permute(gx.f32(), rb.row_token, R, D, perm.f32());
      be.unpermute_add(rb, R, grows.f32(), D, true, gated.f32());
      be.unpermute_add(rb, R, grows.f32(), D, false, ungated.f32());
      return Out{down<float>(perm), down<float>(gated), down<float>(ungated)};
    });
    expect_bitwise(pg.perm, pc.perm, "permute");
    expect_bitwise(pg.gated, pc.gated, "unpermute_add gated");
    expect_bitwise(pg.ungated, pc.ungated, "unpermute_add ungated");
  }
}

TEST_F(CudaOps, MoeGradientsMatchCpu) {
  for (const RouterCase& s : kRouterCases) {
    SCOPED_TRACE(testing::Message() << "N" << s.N << " E" << s.E << " k" << s.k << (s.sigmoid ? " sigmoid" : " softmax")
                                    << " normalise " << s.normalise << " scaling " << s.scaling << " cap " << s.capacity);
    const auto z = router_logits(s, 50 + s.N + s.E);
    const std::vector<float> bias(static_cast<size_t>(s.E), 0.0f);
    Tensor cz = up(cpu(), z), cb = up(cpu(), bias);
    Routing cr(cpu(), s.N, s.E, s.k);
    cpu().route(cz.f32(), cb.f32(), rule_of(s), cr.buffers());
    const HostRouting h(cr);
    const int64_t D = 72, R = h.R;
    const auto dout = normal_vector(s.N * D, 61), expert_out = normal_vector(R * D, 62);
    const auto bias0 = normal_vector(s.E, 63, 0.01f);
    struct Out {
      std::vector<float> dye;
      std::vector<double> dgate;
      std::vector<float> dz_plain, dz_aux, bias;
      std::vector<double> aux, aux_off;
    };
    // router_grad from the CPU's dgate on both backends (bitwise given the same dgate).
    std::vector<double> cpu_dgate;
    auto [c, g] = both([&](Backend& be) {
      Routing r = copy_routing(h, be, s.N, s.E, s.k);
      const RoutingBuffers rb = r.buffers();
      Tensor gdo = up(be, dout), geo = up(be, expert_out), dye(be, DType::f32, {R * D}), dgate(be, DType::f64, {s.N * s.k});
      be.gate_grad(rb, R, gdo.f32(), geo.f32(), D, dye.f32(), dgate.data<double>());
      Out o;
      o.dye = down<float>(dye), o.dgate = down<double>(dgate);
      if (&be == &cpu()) cpu_dgate = o.dgate;
      Tensor dg = up(be, cpu_dgate), dz(be, DType::f32, {s.N * s.E});
      RouterGradRule rule;
      rule.sigmoid = s.sigmoid, rule.normalise = s.normalise, rule.scaling = s.scaling;
      be.router_grad(rb, dg.data<double>(), rule, dz.f32());
      o.dz_plain = down<float>(dz);
      rule.aux_coef = 0.01, rule.aux_grad_scale = 3.0;
      be.router_grad(rb, dg.data<double>(), rule, dz.f32());
      o.dz_aux = down<float>(dz);
      Tensor aux(be, DType::f64, {1});
      be.aux_loss(rb, 0.01, s.sigmoid, aux.data<double>());
      o.aux = down<double>(aux);
      be.aux_loss(rb, 0.0, s.sigmoid, aux.data<double>());
      o.aux_off = down<double>(aux);
      Tensor b = up(be, bias0);
      be.bias_update(b.f32(), rb.load, s.E, 1e-3);
      o.bias = down<float>(b);
      return o;
    });
    expect_bitwise(g.dye, c.dye, "dye");
    // Each row's dot product in double: a warp tree on the GPU, serial on the CPU.
    expect_near_rel(g.dgate, c.dgate, 1e-12, "dgate");
    expect_bitwise(g.dz_plain, c.dz_plain, "router_grad");
    expect_bitwise(g.dz_aux, c.dz_aux, "router_grad with the aux loss");
    expect_bitwise(g.aux, c.aux, "aux_loss");
    EXPECT_EQ(g.aux_off[0], 0.0);
    EXPECT_EQ(c.aux_off[0], 0.0);
    expect_bitwise(g.bias, c.bias, "router bias");
  }
}

// ---- optimizer ------------------------------------------------------------------------------------
TEST_F(CudaOps, AdamWAndBiasUpdateMatchCpuBitwise) {
  const int64_t n = (1 << 20) + 3;
  AdamWStep h{0.9f, 0.95f, 0.19f, 0.0975f, 3e-4f, 1e-8f, 0.9999f, 0.7f};
  h.unscale = 1.0f / 24.0f;  // micro-batches x loss scale, applied inside (g is never rewritten)
  for (bool bf16 : {false, true}) {
    SCOPED_TRACE(bf16 ? "BF16 moments" : "FP32 moments");
    const auto w = normal_vector(n, 51), g = normal_vector(n, 52), m0 = normal_vector(n, 53, 0.1f);
    auto v0 = normal_vector(n, 54, 0.1f);
    for (float& x : v0) x = x * x;
    std::vector<uint16_t> m16(static_cast<size_t>(n)), v16(static_cast<size_t>(n));
    for (int64_t j = 0; j < n; ++j) m16[j] = bf16_encode(m0[j]), v16[j] = bf16_encode(v0[j]);
    struct Out {
      std::vector<float> w, g, m, v;
      std::vector<uint16_t> m16, v16;
    };
    auto [c, gg] = both([&](Backend& be) {
      Tensor gw = up(be, w), ggr = up(be, g), gm = up(be, m0), gv = up(be, v0), gm16 = up(be, m16), gv16 = up(be, v16);
      for (int step = 0; step < 2; ++step) {
        if (bf16)
          be.adamw(h, gw.f32(), ggr.f32(), nullptr, nullptr, gm16.data<uint16_t>(), gv16.data<uint16_t>(), n);
        else
          be.adamw(h, gw.f32(), ggr.f32(), gm.f32(), gv.f32(), nullptr, nullptr, n);
      }
      return Out{down<float>(gw), down<float>(ggr), down<float>(gm), down<float>(gv), down<uint16_t>(gm16),
                 down<uint16_t>(gv16)};
    });
    expect_bitwise(gg.w, c.w, "w");
    expect_bitwise(gg.g, g, "g unchanged");
    if (bf16) {
      EXPECT_EQ(gg.m16, c.m16);
      EXPECT_EQ(gg.v16, c.v16);
    } else {
      expect_bitwise(gg.m, c.m, "m");
      expect_bitwise(gg.v, c.v, "v");
    }
  }
  const std::vector<float> bias = normal_vector(64, 55);
  std::vector<int64_t> load(64);
  for (int e = 0; e < 64; ++e) load[e] = (e * 37) % 11;
  auto [c, g] = both([&](Backend& be) {
    Tensor gb = up(be, bias), gl = up(be, load);
    be.bias_update(gb.f32(), gl.data<int64_t>(), 64, 1e-3);
    return down<float>(gb);
  });
  std::vector<float> ref = bias;
  const double mean = double(std::accumulate(load.begin(), load.end(), int64_t(0))) / 64.0;
  for (int e = 0; e < 64; ++e) ref[e] = bias_update_elem(ref[e], mean, load[e], 1e-3);
  expect_bitwise(c, ref, "cpu backend router bias");
  expect_bitwise(g, c, "router bias");
}

TEST_F(CudaOps, SumOfSquaresMatchesDouble) {
  const float unscale = 0.37f;
  for (int64_t n : {int64_t(0), int64_t(1), int64_t(1000), int64_t(1 << 24) + 7}) {
    SCOPED_TRACE(n);
    const auto g = normal_vector(n, 61 + n);
    double ref = 0;
    for (float x : g) {
      const float y = x * unscale;  // rounded to FP32 first, then squared in double
      ref += double(y) * y;
    }
    auto [c, gs] = both([&](Backend& be) {
      Tensor gg = up(be, g), out(be, DType::f64, {1});
      be.sum_squares(gg.f32(), n, unscale, out.data<double>());
      return down<double>(out);
    });
    EXPECT_NEAR(c[0], ref, 1e-12 * (ref + 1));
    // The chunks of 2^14 in order on both; inside a chunk a block tree on the GPU.
    EXPECT_NEAR(gs[0], c[0], 1e-12 * (c[0] + 1));
  }
  // sum: in order on both, bitwise.
  for (int64_t n : {int64_t(0), int64_t(1), int64_t(777)}) {
    std::vector<double> x(static_cast<size_t>(n));
    const auto f = normal_vector(n, 71);
    for (int64_t i = 0; i < n; ++i) x[i] = double(f[i]) * 1e3 + 1e-7 * i;
    auto [c, g] = both([&](Backend& be) {
      Tensor gx = up(be, x), out(be, DType::f64, {1});
      be.sum(gx.data<double>(), n, out.data<double>());
      return down<double>(out);
    });
    expect_bitwise(g, c, "sum");
  }
}

// ---- GEMMs ----------------------------------------------------------------------------------------
// 1 - 2 sum(xy) / (sum(x^2) + sum(y^2)): DeepSeek-V3's similarity measure (0 when equal).
double dissimilarity(const std::vector<float>& x, const std::vector<double>& y) {
  double xy = 0, xx = 0, yy = 0;
  for (size_t i = 0; i < x.size(); ++i) xy += x[i] * y[i], xx += double(x[i]) * x[i], yy += y[i] * y[i];
  return xx + yy == 0 ? 0.0 : 1.0 - 2.0 * xy / (xx + yy);
}
std::vector<double> to_double(const std::vector<float>& x) { return std::vector<double>(x.begin(), x.end()); }

struct GemmCase {
  const char* name;
  int64_t M, N, K;
};

// The three GEMMs of a linear layer (kernels/gemm_fp8.h's table) for one recipe, on both backends.
void check_linear_gemms(Backend& cpu_be, Backend& gpu_be, bool blockwise, bool hybrid, const GemmCase& c) {
  SCOPED_TRACE(testing::Message() << c.name << " " << c.M << "x" << c.N << "x" << c.K << (blockwise ? " blockwise" : " per-tensor")
                                  << (hybrid ? " hybrid" : ""));
  const int64_t M = c.M, N = c.N, K = c.K;
  // Magnitudes ramped over rows and 128-column blocks (2^-3..2^3), so that neighbouring tiles and
  // blocks get different scales and a misplaced scale changes the product.
  auto ramp = [](std::vector<float> v, int64_t cols) {
    for (size_t i = 0; i < v.size(); ++i)
      v[i] *= std::ldexp(1.0f, int((int64_t(i) / cols) % 5) - 2 + int((int64_t(i) % cols / 128) % 3) - 1);
    return v;
  };
  const auto x = ramp(normal_vector(M * K, 71), K), w = ramp(normal_vector(N * K, 72, 0.05f), K), dy = ramp(normal_vector(M * N, 73, 1e-3f), N);
  const Fp8Dtype gd = hybrid ? Fp8Dtype::e5m2 : Fp8Dtype::e4m3;
  auto q = [&](const std::vector<float>& a, int64_t r, int64_t cl, Tiling t, Fp8Dtype dt) {
    QuantTensor out;
    if (blockwise) quantize_tiled(a.data(), r, cl, t, 128, dt, {}, &out);
    else quantize_current(a.data(), r, cl, dt, {}, {}, &out);
    return out;
  };
  const QuantTensor xq = q(x, M, K, Tiling::rows_1xT, Fp8Dtype::e4m3), wq = q(w, N, K, Tiling::blocks_TxT, Fp8Dtype::e4m3);
  const QuantTensor dyq = q(dy, M, N, Tiling::rows_1xT, gd);
  const QuantTensor dyt = blockwise ? q(dy, M, N, Tiling::cols_Tx1, Fp8Dtype::e4m3) : dyq;
  const QuantTensor xt = blockwise ? q(x, M, K, Tiling::cols_Tx1, Fp8Dtype::e4m3) : xq;
  struct G {
    const char* name;
    GemmRole role;
    const QuantTensor &a, &b;
    bool ta, tb;
    int64_t rows, cols;
    std::vector<double> exact;  // FP64 of the unquantized inputs
  };
  // FP64 references of the unquantized products.
  std::vector<double> y(M * N, 0.0), dx(M * K, 0.0), dW(N * K, 0.0);
#pragma omp parallel for schedule(static)
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      double s = 0;
      for (int64_t k = 0; k < K; ++k) s += double(x[m * K + k]) * w[n * K + k];
      y[m * N + n] = s;
    }
#pragma omp parallel for schedule(static)
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n)
      for (int64_t k = 0; k < K; ++k) dx[m * K + k] += double(dy[m * N + n]) * w[n * K + k];
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n)
    for (int64_t m = 0; m < M; ++m)
      for (int64_t k = 0; k < K; ++k) dW[n * K + k] += double(dy[m * N + n]) * x[m * K + k];
  G gemms[] = {{"fprop", GemmRole::fprop, xq, wq, false, true, M, N, y},
               {"dgrad", GemmRole::dgrad, dyq, wq, false, false, M, K, dx},
               {"wgrad", GemmRole::wgrad, dyt, xt, true, false, N, K, dW}};
  auto run = [](Backend& be, const G& gm, const std::vector<float>& c0, int64_t ldc, float alpha, float beta) {
    QTensor a = up(be, gm.a), b = up(be, gm.b);
    Tensor C = up(be, c0);
    be.gemm_fp8(gm.role, a.view(), gm.ta, b.view(), gm.tb, alpha, beta, C.f32(), ldc);
    return down<float>(C);
  };
  for (G& g : gemms) {
    SCOPED_TRACE(g.name);
    const std::vector<float> zero(static_cast<size_t>(g.rows * g.cols), 0.0f);
    const std::vector<float> cpu = run(cpu_be, g, zero, g.cols, 1.0f, 0.0f), gpu = run(gpu_be, g, zero, g.cols, 1.0f, 0.0f);
    if (g.rows * g.cols == 0) continue;
    // Against FP64 of the unquantized inputs: the FP8 error budget (DeepSeek-V3's < 1e-3; E5M2
    // gradients carry 2 mantissa bits, about 4x the error, as in tests/kernels/test_gemm_fp8.cpp).
    const double vs_exact = dissimilarity(gpu, g.exact), vs_cpu = dissimilarity(gpu, to_double(cpu));
    // The measured figures, for scripts/device-check.sh's summary.
    std::printf("[ MEASURE  ] gemm %-10s %-5s %-23s %5lldx%5lldx%5lld  vs FP64 %.2e  vs CPU %.2e\n",
                blockwise ? "blockwise" : hybrid ? "hybrid" : "per-tensor", g.name, c.name, (long long)M,
                (long long)N, (long long)K, vs_exact, vs_cpu);
    const bool fast = g.role == GemmRole::fprop;
    // Measured on an H200 (2026-11-30, scripts/device-check.sh): 7.0e-4 to 1.8e-3 over every case,
    // recipe and role. The FP8 rounding of the inputs is most of it, so this bound cannot see a
    // small scale error (a scale off by s adds about s^2 / 2); the comparison with the CPU can.
    EXPECT_LT(vs_exact, hybrid && !fast ? 4e-3 : 1e-3);
    // Against the CPU's exact emulation: the FP8 products are the same, only the accumulation
    // differs. The measure is about e^2 / 2 for a relative RMS error e (and for a scale off by e).
    // Hopper's FP8 tensor cores keep about 14 bits in their accumulator (DeepSeek-V3, section
    // 3.3.2), which allowed up to 1e-4 with fast accumulation in the first form of this test.
    // Measured on the H200 (2026-11-30): 1e-8 to 5.6e-7 over every case, recipe and role, fast
    // accumulation included. Bounds: 1e-6 (promotion to FP32 every 128 of K) and 2e-6 (fast
    // accumulation), 3.6x the worst measured: a scale off by 0.2% fails them.
    // NOTE: these bounds have not yet run on a GPU in this form (the machine that measured them ran
    // the earlier 1e-4); the next device check confirms them.
    EXPECT_LT(vs_cpu, fast ? 2e-6 : 1e-6);
  }
  // beta = 1 accumulates (weight gradients over micro-batches) and a strided C keeps its padding.
  if (M > 0 && N > 0) {
    const std::vector<float> c0 = normal_vector(M * (N + 3), 74);
    const G acc{"accumulate", GemmRole::wgrad, xq, wq, false, true, M, N, {}};
    const std::vector<float> cpu = run(cpu_be, acc, c0, N + 3, 0.5f, 1.0f), gpu = run(gpu_be, acc, c0, N + 3, 0.5f, 1.0f);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t j = N; j < N + 3; ++j) ASSERT_EQ(gpu[m * (N + 3) + j], c0[m * (N + 3) + j]) << "padding written";
    EXPECT_LT(dissimilarity(gpu, to_double(cpu)), 1e-6);
  }
}

// "large" and "aligned" write C directly (M, N multiples of 16, ldc == N); the others go through
// the padded output. "large" per-tensor reads the forward's operands in place.
const GemmCase kGemmCases[] = {{"one token", 1, 256, 128},
                               {"empty expert", 0, 256, 128},
                               {"K not a multiple of 128", 37, 300, 200},
                               {"aligned M, N, K 200", 256, 512, 200},
                               {"large", 1024, 1536, 2304}};

TEST_F(CudaOps, Fp8GemmPerTensorMatchesFp64AndCpu) {
  if (const std::string why = cuda::fp8_unsupported_reason(false); !why.empty()) GTEST_SKIP() << why;
  for (const GemmCase& c : kGemmCases)
    for (bool hybrid : {false, true}) check_linear_gemms(cpu(), gpu(), false, hybrid, c);
}

TEST_F(CudaOps, Fp8GemmBlockwiseMatchesFp64AndCpu) {
  if (const std::string why = cuda::fp8_unsupported_reason(true); !why.empty()) GTEST_SKIP() << why;
  for (const GemmCase& c : kGemmCases) check_linear_gemms(cpu(), gpu(), true, false, c);
}

TEST_F(CudaOps, Fp32GemmMatchesCpu) {
  struct S {
    int64_t M, N, K;
    float beta;
  };
  for (S s : {S{1, 1, 1, 1.0f}, S{37, 300, 200, 1.0f}, S{512, 768, 1024, 1.0f}, S{64, 48, 32, 0.0f}, S{5, 7, 0, 1.0f},
              S{5, 7, 0, 0.5f}, S{5, 7, 0, 0.0f}})
    for (bool ta : {false, true})
      for (bool tb : {false, true}) {
        SCOPED_TRACE(testing::Message() << s.M << "x" << s.N << "x" << s.K << " beta " << s.beta << " ta " << ta << " tb " << tb);
        const auto a = normal_vector(s.M * s.K, 81), b = normal_vector(s.K * s.N, 82), c0 = normal_vector(s.M * s.N, 83);
        const int64_t lda = std::max<int64_t>(1, ta ? s.M : s.K), ldb = std::max<int64_t>(1, tb ? s.K : s.N);
        auto [c, g] = both([&](Backend& be) {
          Tensor ga = up(be, a), gb = up(be, b), gc = up(be, c0);
          be.sgemm(ta, tb, s.M, s.N, s.K, 0.5f, ga.f32(), lda, gb.f32(), ldb, s.beta, gc.f32(), s.N);
          return down<float>(gc);
        });
        if (s.K == 0) expect_bitwise(g, c, "C = beta C");
        else expect_near_rel(g, c, 1e-5, "C");
      }
}

// ---- the backend itself ---------------------------------------------------------------------------
TEST_F(CudaOps, ArenaCachesAndCountsPeak) {
  Backend& be = gpu();
  be.reset_peak();
  const MemoryStats before = be.memory_stats();
  void* a = be.allocate(3 << 20);
  const MemoryStats held = be.memory_stats();
  EXPECT_EQ(held.in_use - before.in_use, 4 << 20) << "3 MiB rounds up to 4 MiB (2 MiB granules)";
  be.release(a);
  void* b = be.allocate(3 << 20);
  EXPECT_EQ(a, b) << "a freed block of the same size is reused";
  EXPECT_EQ(be.memory_stats().reserved, held.reserved) << "no new cudaMalloc";
  be.release(b);
  EXPECT_GE(be.memory_stats().peak - before.in_use, 4 << 20);
  EXPECT_EQ(be.memory_stats().in_use, before.in_use);
  void* small = be.allocate(1);
  EXPECT_EQ(be.memory_stats().in_use - before.in_use, 512) << "small blocks round to 512 bytes";
  EXPECT_EQ(reinterpret_cast<uintptr_t>(small) % 256, 0u) << "256-byte aligned";
  be.release(small);
  EXPECT_EQ(be.allocate(0), nullptr);
  EXPECT_GE(before.reserved, before.in_use);
}

TEST_F(CudaOps, OpsQueueWithoutHostSynchronisation) {
  // Pinned transfers and ops only queue work; the host waits in sync() alone (counted), and a
  // transfer from pageable memory counts as the host synchronisation it is.
  Backend& be = gpu();
  EXPECT_EQ(be.describe().rfind("cuda: ", 0), 0u) << be.describe();
  const int64_t n = (1 << 20) + 1;
  HostBuffer<float> h(be, n);
  for (int64_t i = 0; i < n; ++i) h[i] = float(i % 1000) * 0.25f;
  const TransferCounts start = be.transfers();
  Tensor a(be, DType::f32, {n}), b(be, DType::f32, {n}), sum(be, DType::f32, {n}), amax(be, DType::f32, {1});
  be.upload(a.raw(), h.data(), size_t(n) * 4);
  be.copy(b.raw(), a.raw(), size_t(n) * 4);
  be.add(a.f32(), b.f32(), sum.f32(), n);
  be.amax(sum.f32(), n, amax.f32());
  be.copy(sum.f32() + 1, sum.f32(), size_t(n - 1) * 4);  // overlapping: as memmove
  HostBuffer<float> r(be, n);
  be.download(r.data(), sum.f32(), size_t(n) * 4);
  TransferCounts d = be.transfers() - start;
  EXPECT_EQ(d.host_syncs, 0);
  EXPECT_EQ(d.h2d_bytes, n * 4);
  EXPECT_EQ(d.d2h_bytes, n * 4);
  be.sync();
  EXPECT_EQ((be.transfers() - start).host_syncs, 1);
  EXPECT_EQ(r[0], 2 * h[0]);
  for (int64_t i = 1; i < n; ++i) ASSERT_EQ(r[i], 2 * h[i - 1]) << i;
  const std::vector<float> pageable(static_cast<size_t>(n), 1.0f);
  be.upload(a.raw(), pageable.data(), size_t(n) * 4);
  EXPECT_EQ((be.transfers() - start).host_syncs, 2);
}

}  // namespace
}  // namespace fp8moe
