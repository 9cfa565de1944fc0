// The grouped FP8 GEMM (kernels/grouped_gemm.h):
//  - the CPU form is the loop of gemm_fp8 that defines it, bitwise, for each entry point and
//    recipe (per-tensor and blockwise operands, an expert without tokens);
//  - each entry point through the Backend on the CPU backend, the emulated device (bitwise the
//    CPU backend's) and CUDA, where it is CUTLASS's kernel (backend_cases.h);
//  - CUTLASS's shape check and its packing of a call (kernels/cuda/grouped_gemm.h): pure host
//    functions, checked here without a device; the kernel itself against FP64 of the dequantized
//    operands (CudaOps.GroupedGemmMatchesFp64), and a fallback to the loop counted and named once
//    (CudaOps.GroupedGemmFallbackIsCountedAndNamedOnce): SKIPPED without a device.
#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kernels/gemm_fp8.h"
#include "kernels/grouped_gemm.h"
#include "tests/kernels/backend_cases.h"
#if FP8MOE_HAVE_CUTLASS
#include "kernels/cuda/backend.h"
#include "kernels/cuda/grouped_gemm.h"
#endif
#include "tests/test_random.h"

namespace fp8moe::test {
namespace {

// Host operands of one grouped call: A_g, B_g and the outputs C_g (rows_g x out_cols) in one
// block, group after group.
struct HostCall {
  std::vector<QuantTensor> a, b;
  std::vector<float> c0;  // the outputs' initial values
  std::vector<int64_t> c_offset;
  int64_t ld = 0;
  std::vector<QuantView> views(const std::vector<QuantTensor>& q) const {
    std::vector<QuantView> v;
    for (const QuantTensor& t : q) v.push_back(t.view());
    return v;
  }
  std::vector<float*> outputs(float* base) const {
    std::vector<float*> c;
    for (int64_t o : c_offset) c.push_back(base + o);
    return c;
  }
};

// A HostCall's operands and outputs uploaded to a backend.
struct DeviceCall {
  std::vector<QTensor> a, b;
  std::vector<QuantView> A, B;
  Tensor out;
  std::vector<float*> C;
  DeviceCall(Backend& be, const HostCall& h) : out(up(be, h.c0)), C(h.outputs(out.f32())) {
    for (size_t g = 0; g < h.a.size(); ++g) a.push_back(up(be, h.a[g])), b.push_back(up(be, h.b[g]));
    for (size_t g = 0; g < h.a.size(); ++g) A.push_back(a[g].view()), B.push_back(b[g].view());
  }
};

QuantTensor quantized(int64_t rows, int64_t cols, bool blockwise, Tiling t, uint64_t seed, float sd) {
  const std::vector<float> x = normal_vector(rows * cols, seed, sd);
  QuantTensor q;
  if (blockwise) quantize_tiled(x.data(), rows, cols, t, 128, Fp8Dtype::e4m3, {}, &q);
  else quantize_current(x.data(), rows, cols, Fp8Dtype::e4m3, {}, {}, &q);
  return q;
}

// The operands of entry point e over experts with these token counts: a layer of N outputs and K
// inputs (W (N, K)).
HostCall host_call(GroupedGemm e, const std::vector<int64_t>& tokens, int64_t N, int64_t K, bool blockwise) {
  HostCall h;
  int64_t at = 0;
  for (size_t g = 0; g < tokens.size(); ++g) {
    const int64_t T = tokens[g];
    const uint64_t s = 100 * uint64_t(e) + 10 * g;
    if (e == GroupedGemm::wgrad) {  // dW_g (N, K) += dY_g^T X_g
      h.a.push_back(quantized(T, N, blockwise, Tiling::cols_Tx1, s + 1, 1.5f));
      h.b.push_back(quantized(T, K, blockwise, Tiling::cols_Tx1, s + 2, 1.0f));
      h.c_offset.push_back(at), at += N * K, h.ld = K;
    } else {  // forward Y_g = X_g W_g^T (X_g (T, K)), dgrad dX_g = dY_g W_g (dY_g (T, N))
      const bool fwd = e == GroupedGemm::forward;
      h.a.push_back(quantized(T, fwd ? K : N, blockwise, Tiling::rows_1xT, s + 1, 2.0f));
      h.b.push_back(quantized(N, K, blockwise, Tiling::blocks_TxT, s + 2, 0.1f));
      h.ld = fwd ? N : K;
      h.c_offset.push_back(at), at += T * h.ld;
    }
  }
  // wgrad adds into its output: random; forward and dgrad write theirs: poisoned (NaN).
  h.c0 = e == GroupedGemm::wgrad ? normal_vector(at, 600) : poisoned_f32(at);
  return h;
}

// The entry point on the host (the CPU form), or on a backend.
void run_cpu_form(GroupedGemm e, const std::vector<QuantView>& A, const std::vector<QuantView>& B,
                  const std::vector<float*>& C, int64_t ld) {
  if (e == GroupedGemm::forward) grouped_gemm_fp8_forward(A, B, C, ld);
  else if (e == GroupedGemm::dgrad) grouped_gemm_fp8_dgrad(A, B, C, ld);
  else grouped_gemm_fp8_wgrad(A, B, C, ld);
}
void run_on(Backend& be, GroupedGemm e, const std::vector<QuantView>& A, const std::vector<QuantView>& B,
            const std::vector<float*>& C, int64_t ld) {
  if (e == GroupedGemm::forward) be.grouped_gemm_fp8_forward(A, B, C, ld);
  else if (e == GroupedGemm::dgrad) be.grouped_gemm_fp8_dgrad(A, B, C, ld);
  else be.grouped_gemm_fp8_wgrad(A, B, C, ld);
}

const GroupedGemm kEntryPoints[] = {GroupedGemm::forward, GroupedGemm::dgrad, GroupedGemm::wgrad};

// The definition, written out: gemm_fp8 of every group with the entry point's transposes and beta.
TEST(GroupedGemm, CpuFormIsTheLoopOfGemmFp8) {
  for (bool blockwise : {false, true})
    for (GroupedGemm e : kEntryPoints) {
      SCOPED_TRACE(testing::Message() << to_string(e) << (blockwise ? " blockwise" : " per-tensor"));
      const HostCall h = host_call(e, {3, 0, 130, 1}, 256, 384, blockwise);
      std::vector<float> loop = h.c0, grouped = h.c0;
      const std::vector<QuantView> A = h.views(h.a), B = h.views(h.b);
      const std::vector<float*> C = h.outputs(loop.data());
      for (size_t g = 0; g < A.size(); ++g) {
        if (e == GroupedGemm::forward) gemm_fp8(A[g], false, B[g], true, 1.0f, 0.0f, C[g], h.ld);
        if (e == GroupedGemm::dgrad) gemm_fp8(A[g], false, B[g], false, 1.0f, 0.0f, C[g], h.ld);
        if (e == GroupedGemm::wgrad) gemm_fp8(A[g], true, B[g], false, 1.0f, 1.0f, C[g], h.ld);
      }
      run_cpu_form(e, A, B, h.outputs(grouped.data()), h.ld);
      expect_bitwise(grouped, loop, "the CPU form vs the loop of gemm_fp8");
    }
}

TEST(GroupedGemmDeathTest, OperandsOfAnotherCountAreFatal) {
  const HostCall h = host_call(GroupedGemm::forward, {3, 5}, 256, 128, true);
  std::vector<float> y = h.c0;
  std::vector<float*> one = h.outputs(y.data());
  one.pop_back();
  EXPECT_DEATH(grouped_gemm_fp8_forward(h.views(h.a), h.views(h.b), one, h.ld), "2 A, 2 B, 1 C");
}

// Backend::grouped_gemm_fp8_forward / _dgrad / _wgrad: the experts' GEMMs as one call each, on the
// CPU backend against the CPU form called directly and the loop of the backend's gemm_fp8, and on
// the device under test against the CPU backend. On CUDA this is the CUTLASS kernel (groups with
// no rows included), with the bound of GroupedGemmMatchesFp64 below; token counts that are not
// multiples of 16 or 128 included (CUTLASS pads wgrad's).
TEST_P(DeviceOps, GroupedGemmMatchesTheLoop) {
  if (!exact())
    if (const std::string why = cuda_fp8_gemm_unsupported(true); !why.empty()) GTEST_SKIP() << why;
  const std::vector<int64_t> tokens = {3, 0, 130, 128, 1};
  for (GroupedGemm e : kEntryPoints) {
    SCOPED_TRACE(to_string(e));
    // W (256, 384): forward N 256 (K 384), dgrad and wgrad outputs of K 384 columns.
    const HostCall h = host_call(e, tokens, 256, 384, true);
    auto run = [&](Backend& be, bool grouped) {
      DeviceCall d(be, h);
      if (grouped) {
        run_on(be, e, d.A, d.B, d.C, h.ld);
      } else {
        const GemmRole role = e == GroupedGemm::forward ? GemmRole::fprop
                              : e == GroupedGemm::dgrad ? GemmRole::dgrad
                                                        : GemmRole::wgrad;
        const bool wgrad = e == GroupedGemm::wgrad;
        for (size_t g = 0; g < tokens.size(); ++g)
          be.gemm_fp8(role, d.A[g], wgrad, d.B[g], e == GroupedGemm::forward, 1.0f, wgrad ? 1.0f : 0.0f, d.C[g], h.ld);
      }
      return down<float>(d.out);
    };
    std::vector<float> direct = h.c0;
    run_cpu_form(e, h.views(h.a), h.views(h.b), h.outputs(direct.data()), h.ld);
    const std::vector<float> loop = run(cpu(), false), c = run(cpu(), true), g = run(dev(), true);
    expect_bitwise(c, loop, "cpu backend: grouped vs the loop");
    expect_bitwise(c, direct, "cpu backend vs the CPU form");
    expect_match(g, c, 2e-3, "grouped");
  }
  EXPECT_EQ(cpu().grouped_gemm_fallbacks().total(), 0) << "the host backends' grouped GEMM is the loop itself";
}

// ---- CUTLASS's grouped block-scaled FP8 GEMM (kernels/cuda/grouped_gemm.h) -----------------------

#if FP8MOE_HAVE_CUTLASS
// Operands at made-up addresses (the check and the packing read no memory): group g's A, its
// scales, B and its scales, and C at 64 KiB steps, 16-byte aligned.
struct FakeCall {
  std::vector<QuantView> A, B;
  std::vector<float*> C;
  int64_t ld = 0;
};
template <class T>
T* address(uintptr_t a) {
  return reinterpret_cast<T*>(a);
}
QuantView fake_view(uintptr_t at, int64_t rows, int64_t cols, Tiling t, Fp8Dtype dtype = Fp8Dtype::e4m3,
                    int tile = 128) {
  QuantView v;
  v.data = address<uint8_t>(at), v.scale_inv = address<float>(at + 0x4000);
  v.rows = rows, v.cols = cols, v.dtype = dtype, v.tiling = t, v.tile = tile;
  return v;
}
// The blockwise call of entry point e that CUTLASS takes: W (N, K) = (256, 384).
FakeCall fake_call(GroupedGemm e, const std::vector<int64_t>& tokens) {
  FakeCall f;
  const int64_t N = 256, K = 384;
  for (size_t g = 0; g < tokens.size(); ++g) {
    const uintptr_t base = 0x1000000 + 0x10000 * (4 * g);
    if (e == GroupedGemm::wgrad) {
      f.A.push_back(fake_view(base, tokens[g], N, Tiling::cols_Tx1));
      f.B.push_back(fake_view(base + 0x10000, tokens[g], K, Tiling::cols_Tx1));
      f.ld = K;
    } else {
      f.A.push_back(fake_view(base, tokens[g], e == GroupedGemm::forward ? K : N, Tiling::rows_1xT));
      f.B.push_back(fake_view(base + 0x10000, N, K, Tiling::blocks_TxT));
      f.ld = e == GroupedGemm::forward ? N : K;
    }
    f.C.push_back(address<float>(base + 0x20000));
  }
  return f;
}
std::string refusal(GroupedGemm e, const FakeCall& f) {
  return cuda::grouped_gemm_unsupported_reason(e, f.A, f.B, f.C, f.ld);
}
#endif

// Each entry point's shape check: what it refuses, and why, in words that name no group and no
// token count (the CUDA backend names each distinct reason once).
TEST(GroupedGemm, CutlassShapeCheckNamesWhatItRefuses) {
#if FP8MOE_HAVE_CUTLASS
  const std::vector<int64_t> tokens = {5, 0, 130};
  for (GroupedGemm e : kEntryPoints) {
    SCOPED_TRACE(to_string(e));
    const bool wgrad = e == GroupedGemm::wgrad;
    const char* a = e == GroupedGemm::forward ? "X" : "dY";
    EXPECT_EQ(refusal(e, fake_call(e, tokens)), "");
    auto expect_refused = [&](const FakeCall& f, const std::string& words) {
      const std::string why = refusal(e, f);
      EXPECT_NE(why.find(words), std::string::npos) << "\"" << why << "\" should say \"" << words << "\"";
    };
    FakeCall f = fake_call(e, tokens);
    f.A[2].tiling = Tiling::per_tensor;
    expect_refused(f, std::string(a) + " is per-tensor e4m3");
    // The reason does not depend on the tokens: the same words for another expert's count.
    FakeCall other = f;
    other.A[2].rows = 77;
    if (wgrad) other.B[2].rows = 77;
    EXPECT_EQ(refusal(e, other), refusal(e, f));
    f = fake_call(e, tokens);
    f.B[0].tile = 64;
    expect_refused(f, wgrad ? "X is e4m3 in 64x1 tiles" : "W is e4m3 in 64x64 blocks");
    f = fake_call(e, tokens);
    f.A[1].dtype = Fp8Dtype::e5m2;  // an E5M2 gradient (the hybrid recipe is per-tensor, but still)
    expect_refused(f, std::string(a) + " is e5m2 in " + (wgrad ? "128x1" : "1x128") + " tiles");
    f = fake_call(e, tokens);
    ++f.ld;
    expect_refused(f, "row stride");
    f = fake_call(e, tokens);
    f.C[2] = address<float>(reinterpret_cast<uintptr_t>(f.C[2]) + 4);
    expect_refused(f, "not 16-byte aligned");
    f = fake_call(e, tokens);
    if (wgrad) {
      f.B[2].rows = 129;
      expect_refused(f, "differ in tokens");
      f = fake_call(e, tokens);
      f.A[0].cols = 300, f.A[1].cols = 300, f.A[2].cols = 300;  // dY (T_g, N) with N = 300
      expect_refused(f, "N 300 and K 384 must be multiples of 128");
    } else {
      f.B[1].rows = 128;
      expect_refused(f, "weights differ in shape");
      f = fake_call(e, tokens);
      f.A[1].data = address<uint8_t>(reinterpret_cast<uintptr_t>(f.A[1].data) + 8);
      EXPECT_EQ(refusal(e, f), "") << "an expert without tokens: its A is not read";
      f.A[0].data = f.A[1].data;
      expect_refused(f, "not 16-byte aligned");
      f = fake_call(e, tokens);
      for (QuantView& w : f.B) w.cols = 200;  // W (256, 200)
      if (e == GroupedGemm::dgrad) f.ld = 200;
      expect_refused(f, "N 256 and K 200 must be multiples of 128");
    }
  }
#else
  GTEST_SKIP() << "built without CUTLASS (scripts/fetch-headers.sh): no grouped FP8 GEMM";
#endif
}

// A call as the kernel's problem: the groups with rows, their offsets and pointers in order, the
// kernel's N and K for each entry point, beta 1 for wgrad only.
TEST(GroupedGemm, CutlassCallPacksTheGroupsWithRows) {
#if FP8MOE_HAVE_CUTLASS
  const std::vector<int64_t> tokens = {3, 0, 130, 0};
  for (GroupedGemm e : kEntryPoints) {
    SCOPED_TRACE(to_string(e));
    const FakeCall f = fake_call(e, tokens);
    cuda::GroupedGemmCall call = cuda::grouped_gemm_call(e, f.A, f.B, f.C);
    const cuda::GroupedGemmFp8& p = call.p;
    EXPECT_EQ(p.form, e);
    EXPECT_EQ(p.groups, 2);
    EXPECT_EQ(p.rows, 133);
    EXPECT_EQ(p.max_rows, 130);
    // D_g (M_g, N) of the kernel reduces over K: forward Y (M, 256) over 384, dgrad dX (M, 384)
    // over 256, wgrad dW (256, 384) over the tokens.
    EXPECT_EQ(p.N, e == GroupedGemm::dgrad ? 384 : 256);
    EXPECT_EQ(p.K, e == GroupedGemm::dgrad ? 256 : 384);
    EXPECT_EQ(p.alpha, 1.0f);
    EXPECT_EQ(p.beta, e == GroupedGemm::wgrad ? 1.0f : 0.0f);
    auto u = [](const void* ptr) { return uint64_t(reinterpret_cast<uintptr_t>(ptr)); };
    const std::vector<uint64_t> want = {0, 3, 133,
                                        u(f.A[0].data), u(f.A[2].data), u(f.A[0].scale_inv), u(f.A[2].scale_inv),
                                        u(f.B[0].data), u(f.B[2].data), u(f.B[0].scale_inv), u(f.B[2].scale_inv),
                                        u(f.C[0]), u(f.C[2])};
    EXPECT_EQ(call.args, want);
    // point_at: p's arrays are the parts of the (here host) copy of args.
    const uint64_t* d = call.args.data();
    cuda::point_at(&call.p, d);
    EXPECT_EQ(static_cast<const void*>(p.row_offsets), d);
    EXPECT_EQ(static_cast<const void*>(p.A), d + 3);
    EXPECT_EQ(static_cast<const void*>(p.a_scale), d + 5);
    EXPECT_EQ(static_cast<const void*>(p.B), d + 7);
    EXPECT_EQ(static_cast<const void*>(p.b_scale), d + 9);
    EXPECT_EQ(static_cast<const void*>(p.D), d + 11);
    const cuda::GroupedGemmCall none = cuda::grouped_gemm_call(e, {f.A[1]}, {f.B[1]}, {f.C[1]});
    EXPECT_EQ(none.p.groups, 0) << "no group has rows: nothing to launch";
    EXPECT_TRUE(none.args.empty());
  }
#else
  GTEST_SKIP() << "built without CUTLASS (scripts/fetch-headers.sh): no grouped FP8 GEMM";
#endif
}

// Groups of every kind (none, one row, a partial tile, whole tiles, a partial second tile) against
// FP64 of the dequantized operands, written (beta 0) and accumulated (beta 1).
TEST_F(CudaOps, GroupedGemmMatchesFp64) {
#if FP8MOE_HAVE_CUTLASS
  CudaBackend& cb = cuda_backend(gpu());
  if (const std::string why = cuda::grouped_gemm_unsupported_reason(cb.device()); !why.empty()) GTEST_SKIP() << why;
  const std::vector<int64_t> rows = {0, 1, 127, 128, 300, 5, 0, 256};
  const int64_t G = int64_t(rows.size()), N = 384, K = 512;
  std::vector<int64_t> off(1, 0);
  for (int64_t r : rows) off.push_back(off.back() + r);
  const int64_t R = off.back();
  QuantTensor a, b;
  quantize_tiled(normal_vector(R * K, 91, 3.0f).data(), R, K, Tiling::rows_1xT, 128, Fp8Dtype::e4m3, {}, &a);
  std::vector<uint8_t> b_bytes;
  std::vector<float> b_scales;
  std::vector<QuantTensor> bs(static_cast<size_t>(G));
  for (int64_t g = 0; g < G; ++g) {
    quantize_tiled(normal_vector(N * K, 100 + g, 0.05f * float(g + 1)).data(), N, K, Tiling::blocks_TxT, 128,
                   Fp8Dtype::e4m3, {}, &bs[size_t(g)]);
    b_bytes.insert(b_bytes.end(), bs[size_t(g)].data.begin(), bs[size_t(g)].data.end());
    b_scales.insert(b_scales.end(), bs[size_t(g)].scale_inv.begin(), bs[size_t(g)].scale_inv.end());
  }
  // FP64 of the dequantized operands.
  std::vector<double> want(static_cast<size_t>(R * N), 0.0);
  for (int64_t g = 0; g < G; ++g)
    for (int64_t r = off[size_t(g)]; r < off[size_t(g) + 1]; ++r)
      for (int64_t n = 0; n < N; ++n) {
        double d = 0;
        for (int64_t k = 0; k < K; ++k) d += double(a.dequant(r, k)) * double(bs[size_t(g)].dequant(n, k));
        want[size_t(r * N + n)] = d;
      }
  const std::vector<float> c0 = normal_vector(R * N, 92);
  for (float beta : {0.0f, 1.0f}) {
    SCOPED_TRACE(testing::Message() << "beta " << beta);
    Backend& be = gpu();
    Tensor ga = up(be, a.data), gsa = up(be, a.scale_inv), gb = up(be, b_bytes), gsb = up(be, b_scales),
           goff = up(be, off);
    Tensor d = beta == 0 ? poisoned(be, DType::f32, R * N) : up(be, c0);
    // The groups' argument arrays in device memory: A and its scales as row ranges of one tensor,
    // the weights one after another.
    const int64_t kb = K / 128, nbk = (N / 128) * kb;
    std::vector<uint64_t> pa, psa, pb, psb, pd;
    for (int64_t g = 0; g < G; ++g) {
      pa.push_back(uint64_t(ga.data<uint8_t>() + off[size_t(g)] * K));
      psa.push_back(uint64_t(gsa.f32() + off[size_t(g)] * kb));
      pb.push_back(uint64_t(gb.data<uint8_t>() + g * N * K));
      psb.push_back(uint64_t(gsb.f32() + g * nbk));
      pd.push_back(uint64_t(d.f32() + off[size_t(g)] * N));
    }
    Tensor dpa = up(be, pa), dpsa = up(be, psa), dpb = up(be, pb), dpsb = up(be, psb), dpd = up(be, pd);
    cuda::GroupedGemmFp8 p;
    p.groups = G, p.rows = R, p.N = N, p.K = K, p.row_offsets = goff.data<int64_t>();
    p.A = reinterpret_cast<const uint8_t* const*>(dpa.raw()), p.a_scale = reinterpret_cast<const float* const*>(dpsa.raw());
    p.B = reinterpret_cast<const uint8_t* const*>(dpb.raw()), p.b_scale = reinterpret_cast<const float* const*>(dpsb.raw());
    p.D = reinterpret_cast<float* const*>(dpd.raw()), p.beta = beta;
    Tensor scratch(be, DType::u8, {int64_t(cuda::grouped_gemm_fp8_scratch_bytes(p, cb.device()))});
    cuda::grouped_gemm_fp8(p, scratch.raw(), size_t(scratch.bytes()), cb.device(), cb.compute_stream());
    const std::vector<float> got = down<float>(d);
    std::vector<float> ref(static_cast<size_t>(R * N));
    for (size_t i = 0; i < ref.size(); ++i) ref[i] = float(want[i] + (beta == 0 ? 0.0 : double(c0[i])));
    // NOTE: the bound is from the FP8 tensor cores' accumulator (about 14 bits within each 128 of
    // K, promoted to FP32 between them: DeepSeek-V3's report), not yet measured on a GPU.
    expect_near_rel(got, ref, 2e-3, "D");
    expect_unchanged(ga, a.data, "A");
    expect_unchanged(gsb, b_scales, "B scales");
  }
#else
  GTEST_SKIP() << "built without CUTLASS (scripts/fetch-headers.sh): no grouped FP8 GEMM";
#endif
}

// A call CUTLASS's kernel cannot take runs the loop of cuBLASLt GEMMs: counted per entry point, its
// reason printed on stderr once (verbose backends only), its result still the loop's. Per-tensor
// operands (always refused), one group (a single GEMM: not a fallback), a blockwise call (taken
// where the device has the kernel), and runtime.grouped_gemm false (refused whatever the operands).
TEST_F(CudaOps, GroupedGemmFallbackIsCountedAndNamedOnce) {
  if (const std::string why = cuda_fp8_gemm_unsupported(false); !why.empty()) GTEST_SKIP() << why;
  release_backends();  // a verbose backend of its own (one CudaBackend at a time per device)
  BackendOptions verbose;
  verbose.attention = AttentionKernel::reference, verbose.verbose = true;
  auto calls = [](Backend& be, bool blockwise, const std::vector<int64_t>& tokens, int times) {
    const HostCall h = host_call(GroupedGemm::forward, tokens, 256, 384, blockwise);
    DeviceCall d(be, h);
    for (int i = 0; i < times; ++i) be.grouped_gemm_fp8_forward(d.A, d.B, d.C, h.ld);
    return down<float>(d.out);
  };
  auto lines = [](const std::string& text, const std::string& words) {
    int n = 0;
    for (size_t at = text.find(words); at != std::string::npos; at = text.find(words, at + 1)) ++n;
    return n;
  };
  const std::vector<int64_t> tokens = {3, 0, 130};
  {
    std::unique_ptr<Backend> be = make_backend(DeviceKind::cuda, 0, verbose);
    testing::internal::CaptureStderr();
    const std::vector<float> got = calls(*be, false, tokens, 2);
    calls(*be, false, {5}, 1);  // one group
    const std::string err = testing::internal::GetCapturedStderr();
    EXPECT_EQ(be->grouped_gemm_fallbacks().forward, 2);
    EXPECT_EQ(be->grouped_gemm_fallbacks().total(), 2);
    EXPECT_EQ(lines(err, "the grouped FP8 GEMM forward runs as a loop of cuBLASLt GEMMs"), 1) << err;
    expect_near_rel(got, calls(cpu(), false, tokens, 1), 2e-3, "the fallback's Y");
    if (cuda_fp8_gemm_unsupported(true).empty()) {  // the loop of block-scaled cuBLASLt GEMMs can run
#if FP8MOE_HAVE_CUTLASS
      const bool takes = cuda::grouped_gemm_unsupported_reason(cuda_backend(*be).device()).empty();
#else
      const bool takes = false;
#endif
      calls(*be, true, tokens, 1);
      EXPECT_EQ(be->grouped_gemm_fallbacks().forward, takes ? 2 : 3);
    }
  }
  BackendOptions off = verbose;
  off.grouped_gemm = false;
  std::unique_ptr<Backend> be = make_backend(DeviceKind::cuda, 0, off);
  testing::internal::CaptureStderr();
  calls(*be, false, tokens, 3);
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_EQ(be->grouped_gemm_fallbacks().forward, 3);
  EXPECT_EQ(lines(err, "runtime.grouped_gemm is false"), 1) << err;
}

}  // namespace
}  // namespace fp8moe::test
