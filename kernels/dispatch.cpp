#include "kernels/dispatch.h"

#include <vector>

#include "kernels/check.h"
#include "kernels/device.h"
#include "kernels/ops.h"
#include "kernels/swiglu.h"

#ifdef FP8MOE_HAVE_CUDA
#include "kernels/cuda/context.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/swiglu.h"
#endif

namespace fp8moe::dev {
namespace {

#ifdef FP8MOE_HAVE_CUDA
bool on_gpu() { return compute_device() == ComputeDevice::cuda; }
cudaStream_t stream() { return cuda::context().compute; }
template <class T>
cuda::Buffer<T> up(const T* host, int64_t n) { return cuda::to_device(host, n); }
template <class T>
void down(const cuda::Buffer<T>& b, T* host, int64_t n) { cuda::to_host(b, host, n); }
#else
constexpr bool on_gpu() { return false; }
#endif

}  // namespace

void gemm_fp8(GemmRole role, const QuantTensor& A, bool trans_a, const QuantTensor& B, bool trans_b, float alpha,
              float beta, float* C, int64_t ldc) {
#ifdef FP8MOE_HAVE_CUDA
  if (on_gpu()) return cuda::gemm_fp8(A, trans_a, B, trans_b, alpha, beta, C, ldc, role == GemmRole::fprop);
#endif
  (void)role;
  fp8moe::gemm_fp8(A, trans_a, B, trans_b, alpha, beta, C, ldc);
}

void sgemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
           const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
#ifdef FP8MOE_HAVE_CUDA
  if (on_gpu() && M > 0 && N > 0) {
    // The stored extents: A is (M, K) or (K, M) with leading dimension lda, B likewise (none when
    // a dimension is 0).
    auto extent = [](int64_t rows, int64_t cols, int64_t ld) { return rows > 0 && cols > 0 ? (rows - 1) * ld + cols : 0; };
    const int64_t na = trans_a ? extent(K, M, lda) : extent(M, K, lda);
    const int64_t nb = trans_b ? extent(N, K, ldb) : extent(K, N, ldb);
    const int64_t nc = extent(M, N, ldc);
    auto a = up(A, na), b = up(B, nb);
    cuda::Buffer<float> c = beta != 0.0f ? up(C, nc) : cuda::Buffer<float>(nc);
    cuda::sgemm(trans_a, trans_b, M, N, K, alpha, a.get(), lda, b.get(), ldb, beta, c.get(), ldc, stream());
    if (ldc == N) return down(c, C, nc);
    // NOTE: a strided C: only its M x N block may be written.
    CUDA_CHECK(cudaMemcpy2DAsync(C, size_t(ldc) * 4, c.get(), size_t(ldc) * 4, size_t(N) * 4, size_t(M),
                                 cudaMemcpyDeviceToHost, stream()));
    CUDA_CHECK(cudaStreamSynchronize(stream()));
    return;
  }
#endif
  fp8moe::sgemm(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

void rmsnorm_forward(const float* x, const float* w, int64_t N, int64_t D, float eps, float* y, float* rstd) {
#ifdef FP8MOE_HAVE_CUDA
  if (on_gpu()) {
    auto dx = up(x, N * D), dw = up(w, D);
    cuda::Buffer<float> dy(N * D), dr(N);
    cuda::rmsnorm_forward(dx.get(), dw.get(), N, D, eps, dy.get(), dr.get(), stream());
    down(dy, y, N * D);
    return down(dr, rstd, N);
  }
#endif
  cpu::rmsnorm_forward(x, w, N, D, eps, y, rstd);
}

void rmsnorm_backward(const float* x, const float* w, const float* rstd, const float* dy, int64_t N, int64_t D,
                      float* dx, float* dw) {
#ifdef FP8MOE_HAVE_CUDA
  if (on_gpu()) {
    auto gx = up(x, N * D), gw = up(w, D), gr = up(rstd, N), gdy = up(dy, N * D), gdw = up(dw, D);
    cuda::Buffer<float> gdx(N * D);
    cuda::rmsnorm_backward(gx.get(), gw.get(), gr.get(), gdy.get(), N, D, gdx.get(), gdw.get(), stream());
    down(gdx, dx, N * D);
    return down(gdw, dw, D);
  }
#endif
  cpu::rmsnorm_backward(x, w, rstd, dy, N, D, dx, dw);
}

void rope(float* x, int64_t B, int64_t T, int64_t heads, int64_t hd, double theta, bool inverse) {
#ifdef FP8MOE_HAVE_CUDA
  if (on_gpu()) {
    std::vector<float> cs(static_cast<size_t>(T * (hd / 2))), sn(cs.size());
    cpu::rope_table(T, hd, theta, inverse, cs.data(), sn.data());
    const int64_t n = B * T * heads * hd;
    auto gx = up(x, n), gc = up(cs.data(), int64_t(cs.size())), gs = up(sn.data(), int64_t(sn.size()));
    cuda::rope(gx.get(), B, T, heads, hd, gc.get(), gs.get(), stream());
    return down(gx, x, n);
  }
#endif
  cpu::rope(x, B, T, heads, hd, theta, inverse);
}

void attention_forward(const float* q, const float* k, const float* v, int64_t B, int64_t T, int64_t H, int64_t KVH,
                       int64_t hd, float* out, float* lse) {
#ifdef FP8MOE_HAVE_CUDA
  if (on_gpu()) {
    const int64_t nq = B * T * H * hd, nk = B * T * KVH * hd;
    auto gq = up(q, nq), gk = up(k, nk), gv = up(v, nk);
    cuda::Buffer<float> go(nq), gl(B * H * T);
    cuda::attention_forward(gq.get(), gk.get(), gv.get(), B, T, H, KVH, hd, go.get(), gl.get(), stream());
    down(go, out, nq);
    return down(gl, lse, B * H * T);
  }
#endif
  cpu::attention_forward(q, k, v, B, T, H, KVH, hd, out, lse);
}

void attention_backward(const float* q, const float* k, const float* v, const float* out, const float* lse,
                        const float* dout, int64_t B, int64_t T, int64_t H, int64_t KVH, int64_t hd, float* dq,
                        float* dk, float* dv) {
#ifdef FP8MOE_HAVE_CUDA
  if (on_gpu()) {
    const int64_t nq = B * T * H * hd, nk = B * T * KVH * hd;
    auto gq = up(q, nq), gk = up(k, nk), gv = up(v, nk), go = up(out, nq), gl = up(lse, B * H * T), gd = up(dout, nq);
    cuda::Buffer<float> gdq(nq), gdk(nk), gdv(nk);
    cuda::attention_backward(gq.get(), gk.get(), gv.get(), go.get(), gl.get(), gd.get(), B, T, H, KVH, hd, gdq.get(),
                             gdk.get(), gdv.get(), stream());
    down(gdq, dq, nq);
    down(gdk, dk, nk);
    return down(gdv, dv, nk);
  }
#endif
  cpu::attention_backward(q, k, v, out, lse, dout, B, T, H, KVH, hd, dq, dk, dv);
}

double cross_entropy(const float* logits, const int32_t* targets, int64_t N, int64_t V, int32_t ignore,
                     float grad_scale, float* dlogits, int64_t* count) {
#ifdef FP8MOE_HAVE_CUDA
  if (on_gpu()) {
    auto gl = up(logits, N * V);
    auto gt = up(targets, N);
    cuda::Buffer<float> gd(dlogits ? N * V : 0);
    cuda::Buffer<double> loss(N);
    cuda::Buffer<int32_t> counted(N), bad(1);
    CUDA_CHECK(cudaMemsetAsync(bad.get(), 0, sizeof(int32_t), stream()));
    cuda::cross_entropy(gl.get(), gt.get(), N, V, ignore, grad_scale, dlogits ? gd.get() : nullptr, loss.get(),
                        counted.get(), bad.get(), stream());
    std::vector<double> hl(static_cast<size_t>(N));
    std::vector<int32_t> hc(static_cast<size_t>(N));
    int32_t hbad = 0;
    if (dlogits) down(gd, dlogits, N * V);
    down(loss, hl.data(), N);
    down(counted, hc.data(), N);
    down(bad, &hbad, 1);
    FP8MOE_ASSERT(hbad == 0, "a target outside the vocabulary of ", V);
    double total = 0;  // in row order, as the CPU
    int64_t c = 0;
    for (int64_t n = 0; n < N; ++n) total += hl[size_t(n)], c += hc[size_t(n)];
    *count = c;
    return total;
  }
#endif
  return cpu::cross_entropy(logits, targets, N, V, ignore, grad_scale, dlogits, count);
}

void embedding_forward(const float* table, const int32_t* ids, int64_t N, int64_t D, float* out) {
  // A gather: on the GPU it would move the whole table for N rows; the CPU does it in place.
  cpu::embedding_forward(table, ids, N, D, out);
}

void embedding_backward(const float* dout, const int32_t* ids, int64_t N, int64_t D, float* dtable) {
  cpu::embedding_backward(dout, ids, N, D, dtable);
}

void swiglu_forward(const float* a, const float* b, float* y, int64_t n) {
#ifdef FP8MOE_HAVE_CUDA
  if (on_gpu()) {
    auto ga = up(a, n), gb = up(b, n);
    cuda::Buffer<float> gy(n);
    cuda::swiglu_forward(ga.get(), gb.get(), gy.get(), n, stream());
    return down(gy, y, n);
  }
#endif
  cpu::swiglu_forward(a, b, y, n);
}

void swiglu_backward(const float* a, const float* b, const float* dy, float* da, float* db, int64_t n) {
#ifdef FP8MOE_HAVE_CUDA
  if (on_gpu()) {
    auto ga = up(a, n), gb = up(b, n), gdy = up(dy, n);
    cuda::Buffer<float> gda(n), gdb(n);
    cuda::swiglu_backward(ga.get(), gb.get(), gdy.get(), gda.get(), gdb.get(), n, stream());
    down(gda, da, n);
    return down(gdb, db, n);
  }
#endif
  cpu::swiglu_backward(a, b, dy, da, db, n);
}

void adamw(const AdamWStep& h, float* w, float* g, float* m, float* v, uint16_t* m16, uint16_t* v16, int64_t n) {
#ifdef FP8MOE_HAVE_CUDA
  if (on_gpu()) {
    auto gw = up(w, n), gg = up(g, n);
    cuda::Buffer<float> gm = m ? up(m, n) : cuda::Buffer<float>(), gv = v ? up(v, n) : cuda::Buffer<float>();
    cuda::Buffer<uint16_t> gm16 = m16 ? up(m16, n) : cuda::Buffer<uint16_t>(),
                           gv16 = v16 ? up(v16, n) : cuda::Buffer<uint16_t>();
    cuda::adamw(h, gw.get(), gg.get(), gm.get(), gv.get(), gm16.get(), gv16.get(), n, stream());
    down(gw, w, n);
    down(gg, g, n);
    if (m) down(gm, m, n), down(gv, v, n);
    if (m16) down(gm16, m16, n), down(gv16, v16, n);
    return;
  }
#endif
#pragma omp parallel for schedule(static)
  for (int64_t j = 0; j < n; ++j) {
    float mj = m16 ? bf16_decode(m16[j]) : m[j];
    float vj = v16 ? bf16_decode(v16[j]) : v[j];
    adamw_elem(h, &w[j], &mj, &vj, &g[j]);
    if (m16) m16[j] = bf16_encode(mj), v16[j] = bf16_encode(vj);
    else m[j] = mj, v[j] = vj;
  }
}

}  // namespace fp8moe::dev
