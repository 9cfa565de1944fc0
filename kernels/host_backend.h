// The host backends: the CPU kernels (kernels/cpu/) behind the Backend interface.
//
//   cpu       host memory; what the host reads it may read directly (the reference backend).
//   emulated  a device for machines without a GPU: every allocation is host memory whose address
//             carries a tag (bit 62: a non-canonical x86-64 address), so a host dereference of a
//             tensor outside the backend's ops faults (SIGSEGV) instead of reading silently. Each op
//             checks that every pointer it is given carries the tag (host memory handed to a device
//             op is an error too), strips it and runs the CPU kernel. download() poisons its host
//             destination (0xFF bytes) until the next sync(), so a read before the synchronisation
//             sees garbage, and a download into memory that is not allocate_host's counts as a host
//             synchronisation, as it is on a GPU (CUDA copies to pageable memory block until done).
//             Losses are bitwise those of the cpu backend: the same kernels in the same order. This
//             is how CI proves that the training step keeps its tensors on the device.
#pragma once

#include <map>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "kernels/backend.h"

namespace fp8moe {

class HostBackend final : public Backend {
 public:
  explicit HostBackend(DeviceKind kind);  // cpu or emulated
  ~HostBackend() override;
  std::string describe() const override;
  double dense_peak_flops(bool) const override;

  void* allocate(size_t bytes) override;
  void release(void* p) override;
  void* allocate_host(size_t bytes) override;
  void release_host(void* p) override;
  // in_use and peak count requested bytes; reserved is the blocks held, the cache's included.
  MemoryStats memory_stats() const override;
  void reset_peak() override;
  // The cpu kind's cache of released blocks (see allocate() in host_backend.cpp). The emulated kind
  // frees at once (misses only), so that its memory is what the planner models.
  struct CacheStats {
    int64_t hits = 0, misses = 0, evictions = 0, cached_bytes = 0;
  };
  CacheStats cache_stats() const;
  // Requests are rounded up to blocks: 256 B below 1 MiB, 64 KiB from 1 MiB on.
  static size_t block_size(size_t bytes);
  void copy(void* dst, const void* src, size_t bytes) override;
  void copy_2d(float* dst, int64_t ld_dst, const float* src, int64_t ld_src, int64_t rows, int64_t cols) override;
  void zero(void* dst, size_t bytes) override;
  void* host_address(const void* p) const override;

  void sgemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
             const float* B, int64_t ldb, float beta, float* C, int64_t ldc) override;
  void gemm_bf16(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const uint16_t* A,
                 int64_t lda, const uint16_t* B, int64_t ldb, float beta, float* C, int64_t ldc) override;
  void gemm_fp8(GemmRole role, const QuantView& A, bool trans_a, const QuantView& B, bool trans_b, float alpha,
                float beta, float* C, int64_t ldc) override;
  void grouped_gemm_fp8_forward(const std::vector<QuantView>& X, const std::vector<QuantView>& W,
                                const std::vector<float*>& Y, int64_t ld) override;
  void grouped_gemm_fp8_dgrad(const std::vector<QuantView>& dY, const std::vector<QuantView>& W,
                              const std::vector<float*>& dX, int64_t ld) override;
  void grouped_gemm_fp8_wgrad(const std::vector<QuantView>& dY, const std::vector<QuantView>& X,
                              const std::vector<float*>& dW, int64_t ld) override;
  void amax(const float* x, int64_t n, float* out) override;
  void scale_from_amax(const float* amax, Fp8Dtype dtype, const ScaleOptions& opt, float* scale) override;
  void quantize_scaled(const float* x, const float* scale, const QuantView& out, uint64_t* counts,
                       float* amax = nullptr) override;
  void quantize_tiled(const float* x, const ScaleOptions& opt, const QuantView& out, uint64_t* counts) override;
  void delayed_update(float* history, int64_t len, int64_t steps, const float* amax, DelayedScalingCompute compute,
                      Fp8Dtype dtype, const ScaleOptions& opt, float* scale) override;
  void dequantize(const QuantView& q, float* out) override;
  void rmsnorm_forward(const float* x, const float* w, int64_t N, int64_t D, float eps, float* y, float* rstd) override;
  void rmsnorm_backward(const float* x, const float* w, const float* rstd, const float* dy, int64_t N, int64_t D,
                        float* dx, float* dw) override;
  void rmsnorm_forward_bf16(const uint16_t* x, const float* w, int64_t N, int64_t D, float eps, float* y,
                            float* rstd) override;
  void rmsnorm_backward_bf16(const uint16_t* x, const float* w, const float* rstd, const float* dy, int64_t N,
                             int64_t D, float* dx, float* dw) override;
  void rope(float* x, int64_t B, int64_t T, int64_t heads, int64_t hd, const float* cs, const float* sn,
            int64_t head_stride) override;
  void attention_forward(const float* q, const float* k, const float* v, int64_t B, int64_t T, int64_t H, int64_t KVH,
                         int64_t hd, int64_t hdv, float* out, float* lse) override;
  void attention_backward(const float* q, const float* k, const float* v, const float* out, const float* lse,
                          const float* dout, int64_t B, int64_t T, int64_t H, int64_t KVH, int64_t hd, int64_t hdv,
                          float* dq, float* dk, float* dv) override;
  void attention_forward_bf16(const uint16_t* q, const uint16_t* k, const uint16_t* v, int64_t B, int64_t T, int64_t H,
                              int64_t KVH, int64_t hd, int64_t hdv, float* out, float* lse) override;
  void attention_backward_bf16(const uint16_t* q, const uint16_t* k, const uint16_t* v, const float* out,
                               const float* lse, const float* dout, int64_t B, int64_t T, int64_t H, int64_t KVH,
                               int64_t hd, int64_t hdv, float* dq, float* dk, float* dv) override;
  void mla_expand_kv(const float* kv, const float* kpe, int64_t N, int64_t H, int64_t nope, int64_t rope, int64_t vd,
                     float* k, float* v) override;
  void mla_expand_kv_backward(const float* dk, const float* dv, int64_t N, int64_t H, int64_t nope, int64_t rope,
                              int64_t vd, float* dkv, float* dkpe) override;
  void cross_entropy(const float* logits, const int32_t* targets, int64_t N, int64_t V, int32_t ignore,
                     float grad_scale, float* dlogits, double* loss_sum) override;
  void ce_row_max(const float* logits, int64_t N, int64_t Vl, float* mx) override;
  void ce_partials(const float* logits, const int32_t* targets, int64_t N, int64_t Vl, int64_t v0, int32_t ignore,
                   const float* mx, double* se, double* tl) override;
  void ce_finish(const float* logits, const int32_t* targets, int64_t N, int64_t Vl, int64_t v0, int32_t ignore,
                 const float* mx, const double* se, const double* tl, float grad_scale, float* dlogits,
                 double* loss_sum) override;
  void embedding_forward(const float* table, const int32_t* ids, int64_t N, int64_t D, int64_t v0, int64_t Vl,
                         float* out) override;
  void embedding_backward(const float* dout, const int32_t* ids, int64_t N, int64_t D, int64_t v0, int64_t Vl,
                          float* dtable) override;
  void swiglu_forward(const float* a, const float* b, int64_t ld, float* y, int64_t rows, int64_t cols) override;
  void swiglu_gated_forward(const float* a, const float* b, int64_t ld, const float* gate, float* y, int64_t rows,
                            int64_t cols) override;
  void swiglu_gated_backward(const float* a, const float* b, int64_t ld, const float* gate, const float* dy, float* da,
                             float* db, double* dgate, int64_t rows, int64_t cols) override;
  void swiglu_backward(const float* a, const float* b, int64_t ld, const float* dy, float* da, float* db, int64_t rows,
                       int64_t cols) override;
  void swiglu_forward_bf16(const uint16_t* a, const uint16_t* b, int64_t ld, const float* gate, float* y, int64_t rows,
                           int64_t cols) override;
  void swiglu_backward_bf16(const uint16_t* a, const uint16_t* b, int64_t ld, const float* gate, const float* dy,
                            float* da, float* db, double* dgate, int64_t rows, int64_t cols) override;
  void add(const float* a, const float* b, float* out, int64_t n) override;
  void to_bf16(const float* x, uint16_t* y, int64_t n) override;
  void from_bf16(const uint16_t* x, float* y, int64_t n) override;
  void round_bf16(const float* x, float* y, int64_t n) override;
  void route(const float* z, const float* bias, const RouterRule& rule, const RoutingBuffers& out) override;
  void permute(const float* x, const int64_t* row_token, int64_t R, int64_t D, float* rows) override;
  void unpermute_add(const RoutingBuffers& r, int64_t R, const float* rows, int64_t D, bool gated, float* out) override;
  void row_gates(const RoutingBuffers& r, int64_t R, float* gate_rows) override;
  void sum_rows(const float* rows, const int64_t* offsets, const int64_t* index, int64_t n, int64_t D,
                float* out) override;
  void sum_rows_bf16(const uint16_t* rows, const int64_t* offsets, const int64_t* index, int64_t n, int64_t D,
                     uint16_t* out) override;
  void slot_grads(const RoutingBuffers& r, int64_t R, const double* row_grads, double* dgate) override;
  void gate_grad(const RoutingBuffers& r, int64_t R, const float* dout, const float* expert_out, int64_t D, float* dye,
                 double* dgate) override;
  void permute_bf16(const float* x, const int64_t* row_token, int64_t R, int64_t D, uint16_t* rows) override;
  void unpermute_add_bf16(const RoutingBuffers& r, int64_t R, const uint16_t* rows, int64_t D, bool gated,
                          float* out) override;
  void gate_grad_bf16(const RoutingBuffers& r, int64_t R, const float* dout, const uint16_t* expert_out, int64_t D,
                      float* dye, double* dgate) override;
  void router_grad(const RoutingBuffers& r, const double* dgate, const RouterGradRule& rule, float* dz) override;
  void aux_loss(const RoutingBuffers& r, double coef, bool sigmoid, double* out) override;
  void bias_update(float* bias, const int64_t* load, int64_t E, double rate) override;
  void adamw(const AdamWStep& h, float* w, const float* g, float* m, float* v, uint16_t* m16, uint16_t* v16,
             int64_t n) override;
  void sum_squares(const float* g, int64_t n, float unscale, double* out) override;
  void sum(const double* x, int64_t n, double* out) override;

 protected:
  void upload_impl(void* dst, const void* host, size_t bytes) override;
  void download_impl(void* host, const void* src, size_t bytes) override;
  void sync_impl() override;

 private:
  // The host address of backend memory p (emulated: checks the tag and strips it; cpu: checks
  // there is none). nullptr stays nullptr.
  template <class T>
  T* h(T* p) const;
  QuantView h(const QuantView& q) const;
  template <class T>
  std::vector<T> h(const std::vector<T>& v) const;  // each element's
  RoutingBuffers h(const RoutingBuffers& r) const;

  mutable std::mutex mu_;
  MemoryStats stats_;
  struct Live {
    size_t bytes, block;  // requested; the block's size
  };
  std::unordered_map<uintptr_t, Live> live_;  // untagged address -> its block
  std::map<size_t, std::vector<void*>> cached_;  // cpu: block size -> released blocks, last released on top
  int64_t cached_bytes_ = 0, live_block_bytes_ = 0, block_high_water_ = 0;
  CacheStats cache_stats_;
  std::map<uintptr_t, size_t> host_live_;       // allocate_host memory: address -> bytes
  struct PendingDownload {
    void* host;
    std::vector<unsigned char> data;
  };
  std::vector<PendingDownload> pending_;  // emulated: applied at sync()
};

}  // namespace fp8moe
