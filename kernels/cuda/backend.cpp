// The CUDA backend (kernels/cuda/backend.h): one GPU's streams, events, cuBLASLt handle and
// caching arena, and every op as the launchers of kernels/cuda/<op>.h on the compute stream.
// Scratch an op needs (attention's delta, the per-row losses, partial sums, the GEMMs' packed
// operands) is an arena Tensor inside the op: released as the op returns, which is safe because
// the arena's reuse is ordered on the compute stream (kernels/cuda/arena.h).
#include "kernels/cuda/backend.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "kernels/backend_info.h"
#include "kernels/check.h"
#include "kernels/cuda/adamw.h"
#include "kernels/cuda/arena.h"
#include "kernels/cuda/attention_runner.h"
#if FP8MOE_HAVE_CUTLASS
#include "kernels/cuda/grouped_gemm.h"
#endif
#include "kernels/cuda/cross_entropy.h"
#include "kernels/cuda/elementwise.h"
#include "kernels/cuda/embedding.h"
#include "kernels/cuda/gemm_fp8.h"
#include "kernels/cuda/mla.h"
#include "kernels/cuda/moe_ops.h"
#include "kernels/cuda/quantize.h"
#include "kernels/cuda/rmsnorm.h"
#include "kernels/rmsnorm.h"
#include "kernels/cuda/rope.h"
#include "kernels/cuda/router.h"
#include "kernels/cuda/swiglu.h"

namespace fp8moe {
namespace {

// cuBLASLt's workspace, as Transformer Engine gives it on Hopper.
constexpr size_t kLtWorkspaceBytes = size_t(32) << 20;

// Dense datasheet peaks of H100 / H200 SXM (FLOP/s): FP8 tensor cores, and FP32 without TF32.
constexpr double kHopperSxmFp8Peak = 1979e12, kHopperSxmFp32Peak = 66.9e12;
constexpr int kHopperSxmSms = 132;

// Whether the host memory at p is page-locked (cudaMallocHost, cudaHostRegister).
bool is_pinned(const void* p) {
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) {
    (void)cudaGetLastError();  // an unknown pointer: ordinary (pageable) memory
    return false;
  }
  return attr.type == cudaMemoryTypeHost;
}

class CudaBackendImpl final : public CudaBackend {
 public:
  CudaBackendImpl(int ordinal, const BackendOptions& options)
      : CudaBackend(DeviceKind::cuda), device_(ordinal), options_(options) {
    CUDA_CHECK(cudaSetDevice(device_));
    CUDA_CHECK(cudaGetDeviceProperties(&prop_, device_));
    cuda::prepare_quantize_kernels();
    CUDA_CHECK(cudaStreamCreateWithFlags(&compute_, cudaStreamNonBlocking));
    CUDA_CHECK(cudaStreamCreateWithFlags(&comm_, cudaStreamNonBlocking));
    CUDA_CHECK(cudaEventCreateWithFlags(&compute_done_, cudaEventDisableTiming));
    CUDA_CHECK(cudaEventCreateWithFlags(&comm_done_, cudaEventDisableTiming));
    CUBLAS_CHECK(cublasLtCreate(&lt_));
    arena_ = std::make_unique<cuda::Arena>(compute_);
    workspace_ = arena_->allocate(kLtWorkspaceBytes);
    attention_ = std::make_unique<cuda::AttentionRunner>(*this, compute_, options_);
  }

  ~CudaBackendImpl() override {
    // NOTE: no fatal checks while tearing down (the job may be failing already); the arena waits
    // for the compute stream before it frees its blocks.
    (void)cudaStreamSynchronize(comm_);
    (void)cudaStreamSynchronize(compute_);
    bounce_.reset();
    attention_.reset();
    arena_.reset();
    if (lt_) (void)cublasLtDestroy(lt_);
    if (comm_done_) (void)cudaEventDestroy(comm_done_);
    if (compute_done_) (void)cudaEventDestroy(compute_done_);
    if (comm_) (void)cudaStreamDestroy(comm_);
    if (compute_) (void)cudaStreamDestroy(compute_);
  }

  std::string describe() const override {
    return detail::concat("cuda: ", prop_.name, " (device ", device_, ")");
  }

  double dense_peak_flops(bool fp8) const override {
    // H100 / H200 SXM only: the PCIe H100 has 114 SMs, and the NVL parts have 132 SMs like the SXM
    // ones but a lower clock and peak, which this table does not hold.
    if (prop_.major == 9 && prop_.minor == 0 && prop_.multiProcessorCount >= kHopperSxmSms &&
        std::strstr(prop_.name, "NVL") == nullptr)
      return fp8 ? kHopperSxmFp8Peak : kHopperSxmFp32Peak;
    return std::nan("");
  }

  // ---- CudaBackend ------------------------------------------------------------------------------
  int device() const override { return device_; }
  cudaStream_t compute_stream() const override { return compute_; }
  cudaStream_t comm_stream() const override { return comm_; }
  void comm_waits_for_compute() override {
    CUDA_CHECK(cudaEventRecord(compute_done_, compute_));
    CUDA_CHECK(cudaStreamWaitEvent(comm_, compute_done_, 0));
  }
  void compute_waits_for_comm() override {
    CUDA_CHECK(cudaEventRecord(comm_done_, comm_));
    CUDA_CHECK(cudaStreamWaitEvent(compute_, comm_done_, 0));
  }

  // ---- memory -----------------------------------------------------------------------------------
  void* allocate(size_t bytes) override { return arena_->allocate(bytes); }
  void release(void* p) override { arena_->release(p); }
  void* allocate_host(size_t bytes) override {
    if (bytes == 0) return nullptr;
    void* p = nullptr;
    CUDA_CHECK(cudaMallocHost(&p, bytes));
    return p;
  }
  void release_host(void* p) override {
    if (p) CUDA_CHECK(cudaFreeHost(p));
  }
  MemoryStats memory_stats() const override { return arena_->stats(); }
  void reset_peak() override { arena_->reset_peak(); }

  void copy(void* dst, const void* src, size_t bytes) override {
    if (bytes == 0 || dst == src) return;
    const uintptr_t d = reinterpret_cast<uintptr_t>(dst), s = reinterpret_cast<uintptr_t>(src);
    if (d < s + bytes && s < d + bytes) {
      // NOTE: overlapping ranges (the CPU backend's memmove): cudaMemcpy's result is undefined
      // there, so through a temporary block.
      void* tmp = arena_->allocate(bytes);
      CUDA_CHECK(cudaMemcpyAsync(tmp, src, bytes, cudaMemcpyDeviceToDevice, compute_));
      CUDA_CHECK(cudaMemcpyAsync(dst, tmp, bytes, cudaMemcpyDeviceToDevice, compute_));
      arena_->release(tmp);
      return;
    }
    CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, compute_));
  }
  void copy_2d(float* dst, int64_t ld_dst, const float* src, int64_t ld_src, int64_t rows, int64_t cols) override {
    FP8MOE_ASSERT(rows >= 0 && cols >= 0 && ld_dst >= cols && ld_src >= cols, "copy_2d of ", rows, " x ", cols,
                  " with row strides ", ld_dst, " (dst) and ", ld_src, " (src)");
    if (rows == 0 || cols == 0) return;
    constexpr size_t f = sizeof(float);
    CUDA_CHECK(cudaMemcpy2DAsync(dst, size_t(ld_dst) * f, src, size_t(ld_src) * f, size_t(cols) * f, size_t(rows),
                                 cudaMemcpyDeviceToDevice, compute_));
  }
  void zero(void* dst, size_t bytes) override {
    if (bytes) CUDA_CHECK(cudaMemsetAsync(dst, 0, bytes, compute_));
  }
  void* host_address(const void*) const override {
    fatal_error(__FILE__, __LINE__,
                "host_address on the CUDA backend: its memory is device memory, which the host reads only through "
                "download() and sync()");
  }

  // ---- GEMMs ------------------------------------------------------------------------------------
  void sgemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
             const float* B, int64_t ldb, float beta, float* C, int64_t ldc) override {
    cuda::sgemm(lt(), trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, compute_);
  }
  void gemm_bf16(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const uint16_t* A,
                 int64_t lda, const uint16_t* B, int64_t ldb, float beta, float* C, int64_t ldc) override {
    cuda::gemm_bf16(lt(), trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, compute_);
  }

  void gemm_fp8(GemmRole role, const QuantView& A, bool trans_a, const QuantView& B, bool trans_b, float alpha,
                float beta, float* C, int64_t ldc) override {
    const cuda::Fp8GemmPlan p = cuda::plan_gemm_fp8(A, trans_a, B, trans_b, C, ldc);
    if (p.empty) return;
    Tensor a_data(*this, DType::u8, {p.a.data_bytes}), a_scale(*this, DType::f32, {p.a.scale_count});
    Tensor b_data(*this, DType::u8, {p.b.data_bytes}), b_scale(*this, DType::f32, {p.b.scale_count});
    Tensor d(*this, DType::f32, {p.out_count});
    const cuda::Fp8GemmScratch s{a_data.data<uint8_t>(), a_scale.f32(), b_data.data<uint8_t>(), b_scale.f32(),
                                 d.f32()};
    // Fast accumulation for the forward GEMM only (Transformer Engine's split accumulator for
    // dgrad and wgrad); gemm_fp8_tn also never uses it with block scaling.
    cuda::gemm_fp8(lt(), p, A, B, alpha, beta, C, ldc, s, role == GemmRole::fprop, compute_);
  }

  // kernels/grouped_gemm.h's entry points: CUTLASS's grouped kernel where it takes the call, else
  // the loop of gemm_fp8 (Backend's), counted and named (grouped, below).
  void grouped_gemm_fp8_forward(const std::vector<QuantView>& X, const std::vector<QuantView>& W,
                                const std::vector<float*>& Y, int64_t ld) override {
    if (!grouped(GroupedGemm::forward, X, W, Y, ld)) Backend::grouped_gemm_fp8_forward(X, W, Y, ld);
  }
  void grouped_gemm_fp8_dgrad(const std::vector<QuantView>& dY, const std::vector<QuantView>& W,
                              const std::vector<float*>& dX, int64_t ld) override {
    if (!grouped(GroupedGemm::dgrad, dY, W, dX, ld)) Backend::grouped_gemm_fp8_dgrad(dY, W, dX, ld);
  }
  void grouped_gemm_fp8_wgrad(const std::vector<QuantView>& dY, const std::vector<QuantView>& X,
                              const std::vector<float*>& dW, int64_t ld) override {
    if (!grouped(GroupedGemm::wgrad, dY, X, dW, ld)) Backend::grouped_gemm_fp8_wgrad(dY, X, dW, ld);
  }
  GroupedGemmFallbacks grouped_gemm_fallbacks() const override { return fallbacks_; }

  // ---- quantization -----------------------------------------------------------------------------
  void amax(const float* x, int64_t n, float* out) override { cuda::amax(x, n, out, compute_); }
  void scale_from_amax(const float* amax, Fp8Dtype dtype, const ScaleOptions& opt, float* scale) override {
    cuda::scale_from_amax(amax, dtype, opt, scale, compute_);
  }
  void quantize_scaled(const float* x, const float* scale, const QuantView& out, uint64_t* counts,
                       float* amax = nullptr) override {
    cuda::quantize_scaled(x, scale, out, counts, amax, compute_);
  }
  void quantize_tiled(const float* x, const ScaleOptions& opt, const QuantView& out, uint64_t* counts) override {
    cuda::quantize_tiled(x, opt, out, counts, compute_);
  }
  void quantize_tiled_pair(const float* x, const ScaleOptions& opt, const QuantView& rows_out, uint64_t* rows_counts,
                           const QuantView& cols_out, uint64_t* cols_counts) override {
    check_tiled_pair(rows_out, cols_out);
    cuda::quantize_tiled_pair(x, opt, rows_out, rows_counts, cols_out, cols_counts, compute_);
  }
  void delayed_update(float* history, int64_t len, int64_t steps, const float* amax, DelayedScalingCompute compute,
                      Fp8Dtype dtype, const ScaleOptions& opt, float* scale) override {
    cuda::delayed_update(history, len, steps, amax, compute, dtype, opt, scale, compute_);
  }
  void dequantize(const QuantView& q, float* out) override { cuda::dequantize(q, out, compute_); }

  // ---- the transformer's ops --------------------------------------------------------------------
  void rmsnorm_forward(const float* x, const float* w, int64_t N, int64_t D, float eps, float* y,
                       float* rstd) override {
    cuda::rmsnorm_forward(x, w, N, D, eps, y, rstd, compute_);
  }
  void rmsnorm_backward(const float* x, const float* w, const float* rstd, const float* dy, int64_t N, int64_t D,
                        float* dx, float* dw) override {
    if (N == 0 || D == 0) return;
    Tensor partials(*this, DType::f32, {rmsnorm_dw_chunks(N) * D});
    cuda::rmsnorm_backward(x, w, rstd, dy, N, D, dx, dw, partials.f32(), compute_);
  }
  void rmsnorm_forward_bf16(const uint16_t* x, const float* w, int64_t N, int64_t D, float eps, float* y,
                            float* rstd) override {
    cuda::rmsnorm_forward_bf16(x, w, N, D, eps, y, rstd, compute_);
  }
  void rmsnorm_backward_bf16(const uint16_t* x, const float* w, const float* rstd, const float* dy, int64_t N,
                             int64_t D, float* dx, float* dw) override {
    if (N == 0 || D == 0) return;
    Tensor partials(*this, DType::f32, {rmsnorm_dw_chunks(N) * D});
    cuda::rmsnorm_backward_bf16(x, w, rstd, dy, N, D, dx, dw, partials.f32(), compute_);
  }
  void rope(float* x, int64_t B, int64_t T, int64_t heads, int64_t hd, const float* cs, const float* sn,
            int64_t head_stride) override {
    cuda::rope(x, B, T, heads, hd, cs, sn, head_stride, compute_);
  }
  void attention_forward(const float* q, const float* k, const float* v, int64_t B, int64_t T, int64_t H, int64_t KVH,
                         int64_t hd, int64_t hdv, float* out, float* lse) override {
    attention_->forward(q, k, v, B, T, H, KVH, hd, hdv, out, lse);
  }
  void attention_backward(const float* q, const float* k, const float* v, const float* out, const float* lse,
                          const float* dout, int64_t B, int64_t T, int64_t H, int64_t KVH, int64_t hd, int64_t hdv,
                          float* dq, float* dk, float* dv) override {
    attention_->backward(q, k, v, out, lse, dout, B, T, H, KVH, hd, hdv, dq, dk, dv);
  }
  void attention_forward_bf16(const uint16_t* q, const uint16_t* k, const uint16_t* v, int64_t B, int64_t T,
                              int64_t H, int64_t KVH, int64_t hd, int64_t hdv, float* out, float* lse) override {
    attention_->forward_bf16(q, k, v, B, T, H, KVH, hd, hdv, out, lse);
  }
  void attention_backward_bf16(const uint16_t* q, const uint16_t* k, const uint16_t* v, const float* out,
                               const float* lse, const float* dout, int64_t B, int64_t T, int64_t H, int64_t KVH,
                               int64_t hd, int64_t hdv, float* dq, float* dk, float* dv) override {
    attention_->backward_bf16(q, k, v, out, lse, dout, B, T, H, KVH, hd, hdv, dq, dk, dv);
  }
  void mla_expand_kv(const float* kv, const float* kpe, int64_t N, int64_t H, int64_t nope, int64_t rope, int64_t vd,
                     float* k, float* v) override {
    cuda::mla_expand_kv(kv, kpe, N, H, nope, rope, vd, k, v, compute_);
  }
  void mla_expand_kv_backward(const float* dk, const float* dv, int64_t N, int64_t H, int64_t nope, int64_t rope,
                              int64_t vd, float* dkv, float* dkpe) override {
    cuda::mla_expand_kv_backward(dk, dv, N, H, nope, rope, vd, dkv, dkpe, compute_);
  }
  void cross_entropy(const float* logits, const int32_t* targets, int64_t N, int64_t V, int32_t ignore,
                     float grad_scale, float* dlogits, double* loss_sum) override {
    Tensor row_loss(*this, DType::f64, {N});
    cuda::cross_entropy(logits, targets, N, V, ignore, grad_scale, dlogits, loss_sum, row_loss.data<double>(),
                        compute_);
  }
  void ce_row_max(const float* logits, int64_t N, int64_t Vl, float* mx) override {
    cuda::ce_row_max(logits, N, Vl, mx, compute_);
  }
  void ce_partials(const float* logits, const int32_t* targets, int64_t N, int64_t Vl, int64_t v0, int32_t ignore,
                   const float* mx, double* se, double* tl) override {
    cuda::ce_partials(logits, targets, N, Vl, v0, ignore, mx, se, tl, compute_);
  }
  void ce_finish(const float* logits, const int32_t* targets, int64_t N, int64_t Vl, int64_t v0, int32_t ignore,
                 const float* mx, const double* se, const double* tl, float grad_scale, float* dlogits,
                 double* loss_sum) override {
    Tensor row_loss(*this, DType::f64, {N});
    cuda::ce_finish(logits, targets, N, Vl, v0, ignore, mx, se, tl, grad_scale, dlogits, loss_sum,
                    row_loss.data<double>(), compute_);
  }
  void embedding_forward(const float* table, const int32_t* ids, int64_t N, int64_t D, int64_t v0, int64_t Vl,
                         float* out) override {
    cuda::embedding_forward(table, ids, N, D, v0, Vl, out, compute_);
  }
  void embedding_backward(const float* dout, const int32_t* ids, int64_t N, int64_t D, int64_t v0, int64_t Vl,
                          float* dtable) override {
    if (N * D == 0 || Vl == 0) return;
    Tensor scratch(*this, DType::u8, {int64_t(cuda::embedding_backward_scratch_bytes(N))});
    cuda::embedding_backward(dout, ids, N, D, v0, Vl, dtable, scratch.data<uint8_t>(), compute_);
  }
  void swiglu_forward(const float* a, const float* b, int64_t ld, float* y, int64_t rows, int64_t cols) override {
    cuda::swiglu_forward(a, b, ld, y, rows, cols, compute_);
  }
  void swiglu_backward(const float* a, const float* b, int64_t ld, const float* dy, float* da, float* db, int64_t rows,
                       int64_t cols) override {
    cuda::swiglu_backward(a, b, ld, dy, da, db, rows, cols, compute_);
  }
  void swiglu_gated_forward(const float* a, const float* b, int64_t ld, const float* gate, float* y, int64_t rows,
                            int64_t cols) override {
    cuda::swiglu_gated_forward(a, b, ld, gate, y, rows, cols, compute_);
  }
  void swiglu_gated_backward(const float* a, const float* b, int64_t ld, const float* gate, const float* dy, float* da,
                             float* db, double* dgate, int64_t rows, int64_t cols) override {
    cuda::swiglu_gated_backward(a, b, ld, gate, dy, da, db, dgate, rows, cols, compute_);
  }
  void swiglu_forward_bf16(const uint16_t* a, const uint16_t* b, int64_t ld, const float* gate, float* y, int64_t rows,
                           int64_t cols) override {
    cuda::swiglu_forward_bf16(a, b, ld, gate, y, rows, cols, compute_);
  }
  void swiglu_backward_bf16(const uint16_t* a, const uint16_t* b, int64_t ld, const float* gate, const float* dy,
                            float* da, float* db, double* dgate, int64_t rows, int64_t cols) override {
    cuda::swiglu_backward_bf16(a, b, ld, gate, dy, da, db, dgate, rows, cols, compute_);
  }
  void add(const float* a, const float* b, float* out, int64_t n) override { cuda::add(a, b, out, n, compute_); }
  void to_bf16(const float* x, uint16_t* y, int64_t n) override { cuda::to_bf16(x, y, n, compute_); }
  void from_bf16(const uint16_t* x, float* y, int64_t n) override { cuda::from_bf16(x, y, n, compute_); }
  void round_bf16(const float* x, float* y, int64_t n) override { cuda::round_bf16(x, y, n, compute_); }

  // ---- MoE --------------------------------------------------------------------------------------
  void route(const float* z, const float* bias, const RouterRule& rule, const RoutingBuffers& out) override {
    Tensor scratch(*this, DType::i32, {cuda::route_scratch_count(out.N, out.E, out.k)});
    cuda::route(z, bias, rule, out, scratch.data<int32_t>(), compute_);
  }
  void permute(const float* x, const int64_t* row_token, int64_t R, int64_t D, float* rows) override {
    cuda::permute(x, row_token, R, D, rows, compute_);
  }
  void unpermute_add(const RoutingBuffers& r, int64_t R, const float* rows, int64_t D, bool gated,
                     float* out) override {
    cuda::unpermute_add(r, R, rows, D, gated, out, compute_);
  }
  void permute_bf16(const float* x, const int64_t* row_token, int64_t R, int64_t D, uint16_t* rows) override {
    cuda::permute_bf16(x, row_token, R, D, rows, compute_);
  }
  void unpermute_add_bf16(const RoutingBuffers& r, int64_t R, const uint16_t* rows, int64_t D, bool gated,
                          float* out) override {
    cuda::unpermute_add_bf16(r, R, rows, D, gated, out, compute_);
  }
  void gate_grad_bf16(const RoutingBuffers& r, int64_t R, const float* dout, const uint16_t* expert_out, int64_t D,
                      float* dye, double* dgate) override {
    cuda::gate_grad_bf16(r, R, dout, expert_out, D, dye, dgate, compute_);
  }
  void row_gates(const RoutingBuffers& r, int64_t R, float* gate_rows) override {
    cuda::row_gates(r, R, gate_rows, compute_);
  }
  void sum_rows(const float* rows, const int64_t* offsets, const int64_t* index, int64_t n, int64_t D,
                float* out) override {
    cuda::sum_rows(rows, offsets, index, n, D, out, compute_);
  }
  void sum_rows_bf16(const uint16_t* rows, const int64_t* offsets, const int64_t* index, int64_t n, int64_t D,
                     uint16_t* out) override {
    cuda::sum_rows_bf16(rows, offsets, index, n, D, out, compute_);
  }
  void slot_grads(const RoutingBuffers& r, int64_t R, const double* row_grads, double* dgate) override {
    cuda::slot_grads(r, R, row_grads, dgate, compute_);
  }
  void gate_grad(const RoutingBuffers& r, int64_t R, const float* dout, const float* expert_out, int64_t D, float* dye,
                 double* dgate) override {
    cuda::gate_grad(r, R, dout, expert_out, D, dye, dgate, compute_);
  }
  void router_grad(const RoutingBuffers& r, const double* dgate, const RouterGradRule& rule, float* dz) override {
    cuda::router_grad(r, dgate, rule, dz, compute_);
  }
  void aux_loss(const RoutingBuffers& r, double coef, bool sigmoid, double* out) override {
    Tensor row_sum(*this, DType::f64, {sigmoid ? r.N : 0}), terms(*this, DType::f64, {r.E});
    cuda::aux_loss(r, coef, sigmoid, out, row_sum.data<double>(), terms.data<double>(), compute_);
  }
  void bias_update(float* bias, const int64_t* load, int64_t E, double rate) override {
    cuda::bias_update(bias, load, E, rate, compute_);
  }

  // ---- the optimizer ----------------------------------------------------------------------------
  void adamw(const AdamWStep& h, float* w, const float* g, float* m, float* v, uint16_t* m16, uint16_t* v16,
             int64_t n) override {
    cuda::adamw(h, w, g, m, v, m16, v16, n, compute_);
  }
  void sum_squares(const float* g, int64_t n, float unscale, double* out) override {
    Tensor partial(*this, DType::f64, {cuda::sum_squares_partials(n)});
    cuda::sum_squares(g, n, unscale, out, partial.data<double>(), compute_);
  }
  void sum(const double* x, int64_t n, double* out) override { cuda::sum(x, n, out, compute_); }

 protected:
  // NOTE: from pinned memory (allocate_host) both copies are asynchronous, as the Backend contract
  // wants. From pageable memory CUDA does not document that an asynchronous upload has read its
  // source when it returns ("might be synchronous"), while the contract lets the caller reuse the
  // buffer at once: such an upload is copied into pinned bounce memory first (host memcpy), which
  // the copy then reads; the bounce memory is reused only after the next sync(), when every copy
  // queued before it has run. A download to pageable memory blocks until it is done (CUDA's API
  // synchronisation behaviour): it is followed by sync(), counted, so that it shows as the host
  // synchronisation it is (the emulated device counts it the same way).
  void upload_impl(void* dst, const void* host, size_t bytes) override {
    if (is_pinned(host)) {
      CUDA_CHECK(cudaMemcpyAsync(dst, host, bytes, cudaMemcpyHostToDevice, compute_));
      return;
    }
    // Through the bounce memory, in pieces of at most its size; when it is full, the host waits for
    // the copies queued from it (a counted sync: at start-up, where the whole model is uploaded
    // parameter by parameter, not in a training step, whose pageable uploads are a few loads).
    for (size_t done = 0; done < bytes;) {
      const size_t n = std::min(bytes - done, kBounceBytes);
      if (!bounce_.data()) bounce_ = HostBuffer<unsigned char>(*this, int64_t(kBounceBytes));
      size_t at = (bounce_used_ + 255) / 256 * 256;
      if (at + n > kBounceBytes) sync(), at = 0;
      std::memcpy(bounce_.data() + at, static_cast<const unsigned char*>(host) + done, n);
      CUDA_CHECK(cudaMemcpyAsync(static_cast<unsigned char*>(dst) + done, bounce_.data() + at, n,
                                 cudaMemcpyHostToDevice, compute_));
      bounce_used_ = at + n;
      done += n;
    }
  }
  void download_impl(void* host, const void* src, size_t bytes) override {
    CUDA_CHECK(cudaMemcpyAsync(host, src, bytes, cudaMemcpyDeviceToHost, compute_));
    if (!is_pinned(host)) sync();
  }
  void sync_impl() override {
    CUDA_CHECK(cudaStreamSynchronize(compute_));
    bounce_used_ = 0;  // every upload from the bounce memory has run
  }

  // Runs a grouped call on CUTLASS's kernel (true) where it can take it; else counts the
  // fallback, names its reason on stderr the first time (verbose: rank 0) and returns false, and
  // the caller runs the loop. One group is a single GEMM, cuBLASLt's as a dense layer's: no
  // fallback.
  bool grouped(GroupedGemm e, const std::vector<QuantView>& A, const std::vector<QuantView>& B,
               const std::vector<float*>& C, int64_t ld) {
    check_grouped_operands(e, A, B, C);
    if (A.size() < 2) return false;
    const std::string why = grouped_unsupported(e, A, B, C, ld);
#if FP8MOE_HAVE_CUTLASS
    if (why.empty()) {
      grouped_cutlass(e, A, B, C);
      return true;
    }
#endif
    ++fallbacks_[e];
    if (options_.verbose && grouped_reasons_.insert(detail::concat(to_string(e), ": ", why)).second)
      std::fprintf(stderr,
                   "fp8moe: the grouped FP8 GEMM %s runs as a loop of cuBLASLt GEMMs (counted in "
                   "Backend::grouped_gemm_fallbacks): %s\n",
                   to_string(e), why.c_str());
    return false;
  }
  // Why CUTLASS's grouped kernel cannot take this call ("" when it can).
  std::string grouped_unsupported(GroupedGemm e, const std::vector<QuantView>& A, const std::vector<QuantView>& B,
                                  const std::vector<float*>& C, int64_t ld) {
    if (!options_.grouped_gemm) return "runtime.grouped_gemm is false";
#if FP8MOE_HAVE_CUTLASS
    if (!grouped_unsupported_) grouped_unsupported_ = cuda::grouped_gemm_unsupported_reason(device_);
    if (!grouped_unsupported_->empty()) return *grouped_unsupported_;
    return cuda::grouped_gemm_unsupported_reason(e, A, B, C, ld);
#else
    (void)e, (void)A, (void)B, (void)C, (void)ld;
    return "built without CUTLASS (scripts/fetch-headers.sh)";
#endif
  }
#if FP8MOE_HAVE_CUTLASS
  // The argument arrays go up in one transfer from pageable memory (the bounce buffer: no wait).
  void grouped_cutlass(GroupedGemm e, const std::vector<QuantView>& A, const std::vector<QuantView>& B,
                       const std::vector<float*>& C) {
    cuda::GroupedGemmCall call = cuda::grouped_gemm_call(e, A, B, C);
    if (call.p.groups == 0) return;  // no group has rows
    Tensor args(*this, DType::u64, {int64_t(call.args.size())});
    upload(args.raw(), call.args.data(), call.args.size() * sizeof(uint64_t));
    cuda::point_at(&call.p, args.data<uint64_t>());
    const size_t bytes = cuda::grouped_gemm_fp8_scratch_bytes(call.p, device_);
    Tensor scratch(*this, DType::u8, {int64_t(bytes)});
    cuda::grouped_gemm_fp8(call.p, scratch.raw(), bytes, device_, compute_);
  }
#endif

  void enter_thread() override { CUDA_CHECK(cudaSetDevice(device_)); }

  std::string attention_kernels() const override {
    const std::string s = attention_->kernels();
    return s.empty() ? Backend::attention_kernels() : s;
  }

 private:
#if FP8MOE_HAVE_CUTLASS
  std::optional<std::string> grouped_unsupported_;  // why CUTLASS's grouped GEMM cannot run here ("": it can)
#endif
  GroupedGemmFallbacks fallbacks_;
  std::set<std::string> grouped_reasons_;  // entry point + reason, of the fallbacks named so far
  cuda::LtContext lt() const { return {lt_, workspace_, kLtWorkspaceBytes, device_}; }

  int device_;
  BackendOptions options_;
  cudaDeviceProp prop_{};
  cudaStream_t compute_ = nullptr, comm_ = nullptr;
  cudaEvent_t compute_done_ = nullptr, comm_done_ = nullptr;
  cublasLtHandle_t lt_ = nullptr;
  std::unique_ptr<cuda::Arena> arena_;
  std::unique_ptr<cuda::AttentionRunner> attention_;  // cuDNN's fused SDPA or the reference kernel, per shape
  void* workspace_ = nullptr;  // cuBLASLt's, from the arena (so in memory_stats)
  static constexpr size_t kBounceBytes = size_t(64) << 20;
  HostBuffer<unsigned char> bounce_;  // pinned, kBounceBytes: uploads from pageable memory
  size_t bounce_used_ = 0;            // bytes of it queued since the last sync
};

}  // namespace

std::unique_ptr<Backend> make_cuda_backend(int ordinal, const BackendOptions& options) {
  std::string why;
  const int n = cuda_device_count(&why);
  if (n == 0) fatal_error(__FILE__, __LINE__, "runtime.device cuda: no CUDA device visible: " + why);
  FP8MOE_ASSERT(ordinal >= 0 && ordinal < n, "CUDA device ", ordinal, " asked for; ", n, " visible");
  return std::make_unique<CudaBackendImpl>(ordinal, options);
}

CudaBackend& cuda_backend(Backend& be) {
  auto* c = dynamic_cast<CudaBackend*>(&be);
  if (!c) fatal_error(__FILE__, __LINE__, "a CUDA backend was needed, got " + be.describe());
  return *c;
}

}  // namespace fp8moe
