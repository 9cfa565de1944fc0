// The backend: what one device needs to run the training step, passed to whatever computes (the
// model, the optimizer, the communicators, the checkpoint code) the way the process grid is, never
// read from a global. A process may hold several (a CPU and a CUDA model side by side).
//
//   HostBackend (kernels/host_backend.h)   cpu: host memory, the CPU ops
//                                          emulated: the CPU ops on memory tagged as device memory,
//                                          which the host cannot dereference outside an op
//   CudaBackend (kernels/cuda/backend.h)   a GPU: its compute and communication streams, events, the
//                                          caching arena, the cuBLASLt handle
//
// Every pointer an op takes is memory of this backend (Tensor, kernels/tensor.h); ops are queued in
// order on the backend's compute stream and return before they finish. The host sees device
// memory only through download() followed by sync(), the one place the host waits for the
// device: every sync() is counted (transfers()), and so is every byte copied each way, so that a
// step's host synchronisations can be asserted (README "CUDA backend").
//
// What each op computes is specified in its header (kernels/<op>.h), beside its CPU version; the
// CUDA versions are in kernels/cuda/<op>.cu. Parameter gradients ACCUMULATE where the op header
// says so (micro-batches add up); everything else is written.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kernels/adamw.h"
#include "kernels/grouped_gemm.h"
#include "kernels/moe_ops.h"
#include "kernels/quantize.h"
#include "kernels/router.h"
#include "kernels/tensor.h"

namespace fp8moe {

// Which of a linear layer's three GEMMs (the CUDA backend uses fast accumulation for fprop only).
enum class GemmRole { fprop, dgrad, wgrad };

struct TransferCounts {
  int64_t host_syncs = 0;  // sync() calls: the host waited for the device
  int64_t h2d_bytes = 0, d2h_bytes = 0;
  TransferCounts operator-(const TransferCounts& o) const {
    return {host_syncs - o.host_syncs, h2d_bytes - o.h2d_bytes, d2h_bytes - o.d2h_bytes};
  }
};

// Device memory of the backend's allocator: bytes handed out now, the most ever at once, and what
// it holds from the system (handed out + cached).
struct MemoryStats {
  int64_t in_use = 0, peak = 0, reserved = 0;
};

class Backend {
 public:
  explicit Backend(DeviceKind kind) : kind_(kind) {}
  virtual ~Backend() = default;
  Backend(const Backend&) = delete;
  Backend& operator=(const Backend&) = delete;

  DeviceKind kind() const { return kind_; }
  // Whether the host may dereference this backend's memory (only the CPU backend's).
  bool host_accessible() const { return kind_ == DeviceKind::cpu; }
  virtual std::string describe() const = 0;  // "cpu", "emulated device", "cuda: NVIDIA H200 (device 0)"
  // The dense peak in FLOP/s of the GEMMs this backend runs, FP8 tensor cores (fp8) or FP32, for
  // the devices whose datasheet figures are known (H100 / H200 SXM: 1979 / 67 TFLOP/s); NaN
  // otherwise (the CPU's is measured by app/step_report).
  virtual double dense_peak_flops(bool fp8) const = 0;
  // The attention kernel each shape ran so far ("B 4 T 2048 H 16 KVH 16 head_dim 128: cudnn; ...",
  // "... head_dim 192 value_head_dim 128: ..." where the value head size differs), or "reference"
  // where that is the only one (the host backends).
  virtual std::string attention_kernels() const { return "reference"; }
  // A host thread other than the one that made the backend is about to call it (parallel/pass_pair.h's
  // second pass): CUDA makes the backend's device current there; the host backends need nothing.
  virtual void enter_thread() {}

  // ---- memory -----------------------------------------------------------------------------------
  // Device memory, uninitialised, 256-byte aligned; nullptr for 0 bytes. release() may be called
  // while ops that use the block are queued: the block is reused only by later work of the stream.
  virtual void* allocate(size_t bytes) = 0;
  virtual void release(void* p) = 0;
  // Host memory for transfers: pinned (page-locked) under CUDA, so that copies are asynchronous.
  virtual void* allocate_host(size_t bytes) = 0;
  virtual void release_host(void* p) = 0;
  virtual MemoryStats memory_stats() const = 0;
  virtual void reset_peak() = 0;

  // ---- transfers, queued in order with the ops ---------------------------------------------------
  // Host -> device. From pageable memory the host buffer may be reused when this returns; from
  // allocate_host memory only after the next sync().
  void upload(void* dst, const void* host, size_t bytes);
  // Device -> host (host: allocate_host memory under CUDA). The host may read `host` only after the
  // next sync().
  void download(void* host, const void* src, size_t bytes);
  virtual void copy(void* dst, const void* src, size_t bytes) = 0;  // device -> device
  // A pitched copy, device -> device: dst[r ld_dst + c] = src[r ld_src + c] for r < rows, c < cols
  // (ld_dst, ld_src >= cols; the two regions do not overlap). rows or cols 0 is nothing, the
  // pointers untouched. CUDA: cudaMemcpy2DAsync.
  virtual void copy_2d(float* dst, int64_t ld_dst, const float* src, int64_t ld_src, int64_t rows, int64_t cols) = 0;
  virtual void zero(void* dst, size_t bytes) = 0;
  // The host waits for everything queued so far. Counted.
  void sync();
  const TransferCounts& transfers() const { return counts_; }
  // The host address of this backend's memory where the memory is host memory (cpu: itself;
  // emulated: untagged, for the emulated device's own collectives, parallel/device_communicator.h).
  // Fatal on CUDA.
  virtual void* host_address(const void* p) const = 0;

  // ---- GEMMs (row-major; C = alpha op(A) op(B) + beta C) -----------------------------------------
  virtual void sgemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
                     int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc) = 0;
  // BF16 operands (bits, uint16_t), FP32 accumulation and C (train.hp_gemm bf16: the router, head
  // and eh_proj). CPU: the operands widened exactly and sgemm, so the same products and FP32 sums
  // in sgemm's order; CUDA: cuBLASLt's BF16 GEMM.
  virtual void gemm_bf16(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const uint16_t* A,
                         int64_t lda, const uint16_t* B, int64_t ldb, float beta, float* C, int64_t ldc) = 0;
  // kernels/gemm_fp8.h's contract on FP8 operands in this backend's memory.
  virtual void gemm_fp8(GemmRole role, const QuantView& A, bool trans_a, const QuantView& B, bool trans_b, float alpha,
                        float beta, float* C, int64_t ldc) = 0;
  // The experts' GEMMs, kernels/grouped_gemm.h's three entry points on FP8 operands in this
  // backend's memory (ld: the row stride of every output). Here the loop of this backend's
  // gemm_fp8 that defines them (what a backend wrapping another inherits); the host backends run
  // the CPU form (kernels/cpu/grouped_gemm.cpp), the CUDA backend CUTLASS's grouped kernel where it
  // takes the call (kernels/cuda/grouped_gemm.h), else this loop, counted in grouped_gemm_fallbacks.
  virtual void grouped_gemm_fp8_forward(const std::vector<QuantView>& X, const std::vector<QuantView>& W,
                                        const std::vector<float*>& Y, int64_t ld);
  virtual void grouped_gemm_fp8_dgrad(const std::vector<QuantView>& dY, const std::vector<QuantView>& W,
                                      const std::vector<float*>& dX, int64_t ld);
  virtual void grouped_gemm_fp8_wgrad(const std::vector<QuantView>& dY, const std::vector<QuantView>& X,
                                      const std::vector<float*>& dW, int64_t ld);
  // The grouped calls that ran as the loop although this backend has a grouped kernel, since it
  // was made (the CUDA backend: CUTLASS's could not take them; always none on the host backends,
  // whose grouped GEMM is the loop by definition).
  virtual GroupedGemmFallbacks grouped_gemm_fallbacks() const { return {}; }

  // ---- quantization (kernels/quantize.h); scales and amax values stay in device memory ----------
  // counts (2 entries, may be null): saturated and underflowed elements, accumulated.
  virtual void amax(const float* x, int64_t n, float* out) = 0;
  virtual void scale_from_amax(const float* amax, Fp8Dtype dtype, const ScaleOptions& opt, float* scale) = 0;
  // out (per-tensor) = fp8(x * *scale), out.scale_inv[0] = 1 / *scale; with amax (1, may be null)
  // also amax's *amax = max |x| from the same read of x (the delayed recipe's next history entry).
  virtual void quantize_scaled(const float* x, const float* scale, const QuantView& out, uint64_t* counts,
                               float* amax = nullptr) = 0;
  virtual void quantize_tiled(const float* x, const ScaleOptions& opt, const QuantView& out, uint64_t* counts) = 0;
  // Both tilings of one (rows, cols) tensor that the blockwise recipe uses: rows_out 1 x T (the
  // forward or dgrad operand) and cols_out T x 1 (wgrad's), each exactly quantize_tiled's, with
  // their own counters. Here the two calls; the CUDA backend reads x once for both (one T x T
  // region per block in shared memory: the cast and the transposed cast fused).
  virtual void quantize_tiled_pair(const float* x, const ScaleOptions& opt, const QuantView& rows_out,
                                   uint64_t* rows_counts, const QuantView& cols_out, uint64_t* cols_counts);
  // Delayed scaling's history step after a quantization (cpu::delayed_update).
  virtual void delayed_update(float* history, int64_t len, int64_t steps, const float* amax,
                              DelayedScalingCompute compute, Fp8Dtype dtype, const ScaleOptions& opt,
                              float* scale) = 0;
  virtual void dequantize(const QuantView& q, float* out) = 0;

  // ---- the transformer's ops ---------------------------------------------------------------------
  virtual void rmsnorm_forward(const float* x, const float* w, int64_t N, int64_t D, float eps, float* y,
                               float* rstd) = 0;
  virtual void rmsnorm_backward(const float* x, const float* w, const float* rstd, const float* dy, int64_t N,
                                int64_t D, float* dx, float* dw) = 0;
  // rmsnorm_forward and rmsnorm_backward with x kept in BF16 (train.activations bf16; the forward: a
  // norm output made again from its kept input): the same bits as widening it to FP32 first
  // (exact), without the FP32 copy.
  virtual void rmsnorm_forward_bf16(const uint16_t* x, const float* w, int64_t N, int64_t D, float eps, float* y,
                                    float* rstd) = 0;
  virtual void rmsnorm_backward_bf16(const uint16_t* x, const float* w, const float* rstd, const float* dy, int64_t N,
                                     int64_t D, float* dx, float* dw) = 0;
  // hd elements of each head rotated, heads head_stride apart (head_stride = hd: contiguous heads).
  virtual void rope(float* x, int64_t B, int64_t T, int64_t heads, int64_t hd, const float* cs, const float* sn,
                    int64_t head_stride) = 0;
  // hd: the query/key head size, hdv: the value head size (kernels/attention.h).
  virtual void attention_forward(const float* q, const float* k, const float* v, int64_t B, int64_t T, int64_t H,
                                 int64_t KVH, int64_t hd, int64_t hdv, float* out, float* lse) = 0;
  virtual void attention_backward(const float* q, const float* k, const float* v, const float* out, const float* lse,
                                  const float* dout, int64_t B, int64_t T, int64_t H, int64_t KVH, int64_t hd,
                                  int64_t hdv, float* dq, float* dk, float* dv) = 0;
  // The same with q, k and v in BF16 (train.activations bf16; kernels/attention.h's _bf16 forms:
  // the probabilities, dout and dS rounded to BF16 as a fused kernel rounds them). CUDA: cuDNN's
  // SDPA on the operands as they are, or its reference kernel on them widened.
  virtual void attention_forward_bf16(const uint16_t* q, const uint16_t* k, const uint16_t* v, int64_t B, int64_t T,
                                      int64_t H, int64_t KVH, int64_t hd, int64_t hdv, float* out, float* lse) = 0;
  virtual void attention_backward_bf16(const uint16_t* q, const uint16_t* k, const uint16_t* v, const float* out,
                                       const float* lse, const float* dout, int64_t B, int64_t T, int64_t H,
                                       int64_t KVH, int64_t hd, int64_t hdv, float* dq, float* dk, float* dv) = 0;
  // MLA's keys and values from the kv projection and the shared rotary key (kernels/mla.h).
  virtual void mla_expand_kv(const float* kv, const float* kpe, int64_t N, int64_t H, int64_t nope, int64_t rope,
                             int64_t vd, float* k, float* v) = 0;
  virtual void mla_expand_kv_backward(const float* dk, const float* dv, int64_t N, int64_t H, int64_t nope,
                                      int64_t rope, int64_t vd, float* dkv, float* dkpe) = 0;
  // The sum of the counted rows' losses goes to *loss_sum (device).
  virtual void cross_entropy(const float* logits, const int32_t* targets, int64_t N, int64_t V, int32_t ignore,
                             float grad_scale, float* dlogits, double* loss_sum) = 0;
  virtual void ce_row_max(const float* logits, int64_t N, int64_t Vl, float* mx) = 0;
  virtual void ce_partials(const float* logits, const int32_t* targets, int64_t N, int64_t Vl, int64_t v0,
                           int32_t ignore, const float* mx, double* se, double* tl) = 0;
  virtual void ce_finish(const float* logits, const int32_t* targets, int64_t N, int64_t Vl, int64_t v0, int32_t ignore,
                         const float* mx, const double* se, const double* tl, float grad_scale, float* dlogits,
                         double* loss_sum) = 0;
  virtual void embedding_forward(const float* table, const int32_t* ids, int64_t N, int64_t D, int64_t v0, int64_t Vl,
                                 float* out) = 0;
  virtual void embedding_backward(const float* dout, const int32_t* ids, int64_t N, int64_t D, int64_t v0, int64_t Vl,
                                  float* dtable) = 0;
  // (rows, cols); a, b, da, db with row stride ld (the halves of a fused W1|W3 output), y, dy contiguous.
  virtual void swiglu_forward(const float* a, const float* b, int64_t ld, float* y, int64_t rows, int64_t cols) = 0;
  virtual void swiglu_backward(const float* a, const float* b, int64_t ld, const float* dy, float* da, float* db,
                               int64_t rows, int64_t cols) = 0;
  // Row r scaled by gate[r] after the SwiGLU; backward: dgate (rows, double) and da, db of gate dy
  // (kernels/swiglu.h; train.moe_gates expert).
  virtual void swiglu_gated_forward(const float* a, const float* b, int64_t ld, const float* gate, float* y,
                                    int64_t rows, int64_t cols) = 0;
  virtual void swiglu_gated_backward(const float* a, const float* b, int64_t ld, const float* gate, const float* dy,
                                     float* da, float* db, double* dgate, int64_t rows, int64_t cols) = 0;
  // The forms reading a and b as kept in BF16 (train.activations bf16; the forward: a recomputed
  // SwiGLU output): the same bits as widening them to FP32 first (exact), without the FP32 copy.
  // gate may be nullptr: ungated (and dgate is not written).
  virtual void swiglu_forward_bf16(const uint16_t* a, const uint16_t* b, int64_t ld, const float* gate, float* y,
                                   int64_t rows, int64_t cols) = 0;
  virtual void swiglu_backward_bf16(const uint16_t* a, const uint16_t* b, int64_t ld, const float* gate,
                                    const float* dy, float* da, float* db, double* dgate, int64_t rows,
                                    int64_t cols) = 0;
  virtual void add(const float* a, const float* b, float* out, int64_t n) = 0;
  // BF16 (kernels/elementwise.h): FP32 -> BF16 bits rounded to nearest even, back exactly, and the
  // rounding in FP32 (y may be x). train.activations: bf16's rounding points and wire formats.
  virtual void to_bf16(const float* x, uint16_t* y, int64_t n) = 0;
  virtual void from_bf16(const uint16_t* x, float* y, int64_t n) = 0;
  virtual void round_bf16(const float* x, float* y, int64_t n) = 0;

  // ---- MoE (kernels/router.h, kernels/moe_ops.h) -------------------------------------------------
  virtual void route(const float* z, const float* bias, const RouterRule& rule, const RoutingBuffers& out) = 0;
  virtual void permute(const float* x, const int64_t* row_token, int64_t R, int64_t D, float* rows) = 0;
  virtual void unpermute_add(const RoutingBuffers& r, int64_t R, const float* rows, int64_t D, bool gated,
                             float* out) = 0;
  virtual void gate_grad(const RoutingBuffers& r, int64_t R, const float* dout, const float* expert_out, int64_t D,
                         float* dye, double* dgate) = 0;
  // Their BF16 forms (kernels/moe_ops.h): the rows rounded as they are gathered, and BF16 rows read
  // as they travelled (the FP32 forms' bits on the widened rows, without an FP32 copy of them).
  virtual void permute_bf16(const float* x, const int64_t* row_token, int64_t R, int64_t D, uint16_t* rows) = 0;
  virtual void unpermute_add_bf16(const RoutingBuffers& r, int64_t R, const uint16_t* rows, int64_t D, bool gated,
                                  float* out) = 0;
  virtual void gate_grad_bf16(const RoutingBuffers& r, int64_t R, const float* dout, const uint16_t* expert_out,
                              int64_t D, float* dye, double* dgate) = 0;
  virtual void row_gates(const RoutingBuffers& r, int64_t R, float* gate_rows) = 0;
  virtual void sum_rows(const float* rows, const int64_t* offsets, const int64_t* index, int64_t n, int64_t D,
                        float* out) = 0;
  virtual void sum_rows_bf16(const uint16_t* rows, const int64_t* offsets, const int64_t* index, int64_t n,
                             int64_t D, uint16_t* out) = 0;
  virtual void slot_grads(const RoutingBuffers& r, int64_t R, const double* row_grads, double* dgate) = 0;
  virtual void router_grad(const RoutingBuffers& r, const double* dgate, const RouterGradRule& rule, float* dz) = 0;
  virtual void aux_loss(const RoutingBuffers& r, double coef, bool sigmoid, double* out) = 0;
  virtual void bias_update(float* bias, const int64_t* load, int64_t E, double rate) = 0;

  // ---- the optimizer (kernels/adamw.h) -----------------------------------------------------------
  virtual void adamw(const AdamWStep& h, float* w, const float* g, float* m, float* v, uint16_t* m16, uint16_t* v16,
                     int64_t n) = 0;
  virtual void sum_squares(const float* g, int64_t n, float unscale, double* out) = 0;
  virtual void sum(const double* x, int64_t n, double* out) = 0;

 protected:
  // quantize_tiled_pair's outputs: a 1 x T and a T x 1 tensor of one shape (fatal otherwise).
  static void check_tiled_pair(const QuantView& rows_out, const QuantView& cols_out);
  virtual void upload_impl(void* dst, const void* host, size_t bytes) = 0;
  virtual void download_impl(void* host, const void* src, size_t bytes) = 0;
  virtual void sync_impl() = 0;

 private:
  DeviceKind kind_;
  TransferCounts counts_;
};

// The backend of runtime.device: cpu or emulated (host kinds), or cuda on device `ordinal`
// (fatal when CUDA is not built in; the caller checks that a device is visible).
// Which attention kernel a backend runs (runtime.attention).
enum class AttentionKernel {
  automatic,  // cuda: cuDNN's fused attention where cuDNN loads and has plans for the shape (a
              // warning gives the reason where not), else the reference kernel; host: the reference
  cudnn,      // cuda only: cuDNN's fused attention, fatal where it cannot run
  reference,  // kernels/attention.h's kernel (FP32 softmax), on every backend
};
struct BackendOptions {
  AttentionKernel attention = AttentionKernel::automatic;
  // false: the grouped GEMMs are the loop of gemm_fp8 on CUDA too (cuBLASLt per expert), not CUTLASS's kernels
  bool grouped_gemm = true;
  // print what the backend decides: the attention kernel of each shape (stdout), each distinct
  // reason a grouped GEMM ran as the loop (stderr, once)
  bool verbose = false;
};

std::unique_ptr<Backend> make_backend(DeviceKind kind, int ordinal = 0, const BackendOptions& options = {});

}  // namespace fp8moe
