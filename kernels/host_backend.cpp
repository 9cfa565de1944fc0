#include "kernels/host_backend.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <iterator>

#include "kernels/attention.h"
#include "kernels/cross_entropy.h"
#include "kernels/elementwise.h"
#include "kernels/embedding.h"
#include "kernels/gemm_fp8.h"
#include "kernels/grouped_gemm.h"
#include "kernels/mla.h"
#include "kernels/rmsnorm.h"
#include "kernels/rope.h"
#include "kernels/swiglu.h"

namespace fp8moe {
namespace {

// NOTE: bit 62 makes a user-space x86-64 address non-canonical (bits 63..47 must all equal bit
// 47, which is 0 for user space): loading or storing through it raises a general-protection fault,
// which Linux delivers as SIGSEGV. Linear address masking (Intel LAM, AMD UAI) would ignore high
// bits, but only for a process that enables it through arch_prctl, which nothing here does.
constexpr uintptr_t kDeviceTag = uintptr_t(1) << 62;
constexpr size_t kAlign = 256;

size_t round_up(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

}  // namespace

HostBackend::HostBackend(DeviceKind kind) : Backend(kind) {
  FP8MOE_ASSERT(kind == DeviceKind::cpu || kind == DeviceKind::emulated, "HostBackend of kind ", to_string(kind));
}

HostBackend::~HostBackend() {
  for (auto& [size, blocks] : cached_)
    for (void* p : blocks) std::free(p);
}

size_t HostBackend::block_size(size_t bytes) {
  constexpr size_t kMiB = size_t(1) << 20, kLarge = size_t(64) << 10;
  return bytes < kMiB ? round_up(bytes) : (bytes + kLarge - 1) / kLarge * kLarge;
}

std::string HostBackend::describe() const {
  return kind() == DeviceKind::cpu ? "cpu" : "emulated device (CPU kernels; the host cannot read its memory)";
}

double HostBackend::dense_peak_flops(bool) const { return std::nan(""); }

// NOTE: the cpu kind keeps released blocks and hands them out again, as the CUDA arena does
// (kernels/cuda/arena.h): a training step frees and allocates the same tensors every micro-batch,
// and without the cache glibc unmaps every block above its mmap threshold on free, so each step
// faulted its activations in again (about 15% of a blockwise step on this project's 2-core VM). A
// request takes the smallest cached block at least its size that wastes at most a quarter of it.
// The cache is bounded: on a miss, cached blocks are freed (largest first) until the blocks held,
// live and cached, are no more than the most the live blocks have ever needed, so the cache never
// raises the process's tensor memory above its high water. The emulated kind frees at once, so
// that its resident memory is what `fp8moe plan` models and bench/plan-vs-measured.sh measures.
void* HostBackend::allocate(size_t bytes) {
  if (bytes == 0) return nullptr;
  const size_t want = block_size(bytes);
  std::lock_guard<std::mutex> lock(mu_);
  void* p = nullptr;
  size_t block = want;
  if (auto it = cached_.lower_bound(want); it != cached_.end() && it->first - want <= it->first / 4) {
    block = it->first;
    p = it->second.back();
    it->second.pop_back();
    if (it->second.empty()) cached_.erase(it);
    cached_bytes_ -= int64_t(block);
    ++cache_stats_.hits;
  } else {
    // A miss: give cached blocks back, largest first, until what is held (live blocks, the cache and
    // this block) is no more than the most live blocks have ever needed.
    const int64_t limit = std::max(block_high_water_, live_block_bytes_ + int64_t(want));
    while (!cached_.empty() && live_block_bytes_ + cached_bytes_ + int64_t(want) > limit) {
      auto last = std::prev(cached_.end());
      std::free(last->second.back());
      last->second.pop_back();
      cached_bytes_ -= int64_t(last->first);
      ++cache_stats_.evictions;
      if (last->second.empty()) cached_.erase(last);
    }
    p = std::aligned_alloc(kAlign, want);
    FP8MOE_ASSERT(p, "out of host memory allocating ", bytes, " bytes");
    ++cache_stats_.misses;
  }
  live_[reinterpret_cast<uintptr_t>(p)] = Live{bytes, block};
  live_block_bytes_ += int64_t(block);
  block_high_water_ = std::max(block_high_water_, live_block_bytes_);
  stats_.in_use += int64_t(bytes);
  stats_.reserved = live_block_bytes_ + cached_bytes_;
  if (stats_.in_use > stats_.peak) stats_.peak = stats_.in_use;
  return kind() == DeviceKind::emulated ? reinterpret_cast<void*>(reinterpret_cast<uintptr_t>(p) | kDeviceTag) : p;
}

void HostBackend::release(void* p) {
  if (!p) return;
  void* raw = h(p);
  std::lock_guard<std::mutex> lock(mu_);
  auto it = live_.find(reinterpret_cast<uintptr_t>(raw));
  FP8MOE_ASSERT(it != live_.end(), "release of memory this backend did not allocate");
  const Live blk = it->second;
  live_.erase(it);
  stats_.in_use -= int64_t(blk.bytes);
  live_block_bytes_ -= int64_t(blk.block);
  if (kind() == DeviceKind::cpu) {
    cached_[blk.block].push_back(raw);
    cached_bytes_ += int64_t(blk.block);
  } else {
    std::free(raw);
  }
  stats_.reserved = live_block_bytes_ + cached_bytes_;
}

void* HostBackend::allocate_host(size_t bytes) {
  if (bytes == 0) return nullptr;
  void* p = std::aligned_alloc(kAlign, round_up(bytes));
  FP8MOE_ASSERT(p, "out of host memory allocating ", bytes, " bytes");
  std::lock_guard<std::mutex> lock(mu_);
  host_live_[reinterpret_cast<uintptr_t>(p)] = bytes;
  return p;
}

void HostBackend::release_host(void* p) {
  if (!p) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    host_live_.erase(reinterpret_cast<uintptr_t>(p));
  }
  std::free(p);
}

MemoryStats HostBackend::memory_stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

void HostBackend::reset_peak() {
  std::lock_guard<std::mutex> lock(mu_);
  stats_.peak = stats_.in_use;
}

HostBackend::CacheStats HostBackend::cache_stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  CacheStats c = cache_stats_;
  c.cached_bytes = cached_bytes_;
  return c;
}

template <class T>
T* HostBackend::h(T* p) const {
  if (!p) return p;
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  if (kind() == DeviceKind::emulated) {
    FP8MOE_ASSERT(a & kDeviceTag, "a host pointer given to an op of the emulated device: its tensors live in device "
                                  "memory, which only Backend::upload fills");
    return reinterpret_cast<T*>(a & ~kDeviceTag);
  }
  FP8MOE_ASSERT(!(a & kDeviceTag), "emulated device memory given to a cpu backend op");
  return p;
}

QuantView HostBackend::h(const QuantView& q) const {
  QuantView v = q;
  v.data = h(q.data), v.scale_inv = h(q.scale_inv);
  return v;
}

template <class T>
std::vector<T> HostBackend::h(const std::vector<T>& v) const {
  std::vector<T> out;
  out.reserve(v.size());
  for (const T& x : v) out.push_back(h(x));
  return out;
}

RoutingBuffers HostBackend::h(const RoutingBuffers& r) const {
  RoutingBuffers v = r;
  v.prob = h(r.prob), v.expert = h(r.expert), v.gate = h(r.gate), v.kept = h(r.kept), v.load = h(r.load);
  v.offsets = h(r.offsets), v.row_token = h(r.row_token), v.row_slot = h(r.row_slot), v.slot_row = h(r.slot_row);
  return v;
}

void* HostBackend::host_address(const void* p) const { return const_cast<void*>(h(p)); }

void HostBackend::upload_impl(void* dst, const void* host, size_t bytes) { std::memcpy(h(dst), host, bytes); }

void HostBackend::download_impl(void* host, const void* src, size_t bytes) {
  if (kind() == DeviceKind::cpu) {
    std::memcpy(host, src, bytes);
    return;
  }
  // In stream order the copy reads the source now; the host sees the data only after sync().
  PendingDownload d{host, std::vector<unsigned char>(bytes)};
  std::memcpy(d.data.data(), h(src), bytes);
  std::memset(host, 0xFF, bytes);
  pending_.push_back(std::move(d));
  bool staging = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    const uintptr_t a = reinterpret_cast<uintptr_t>(host);
    auto it = host_live_.upper_bound(a);
    staging = it != host_live_.begin() && (--it, a + bytes <= it->first + it->second);
  }
  if (!staging) sync();  // as a GPU's copy to pageable memory: the host waits for it
}

void HostBackend::sync_impl() {
  for (PendingDownload& d : pending_) std::memcpy(d.host, d.data.data(), d.data.size());
  pending_.clear();
}

void HostBackend::copy(void* dst, const void* src, size_t bytes) {
  if (bytes) std::memmove(h(dst), h(src), bytes);
}

void HostBackend::copy_2d(float* dst, int64_t ld_dst, const float* src, int64_t ld_src, int64_t rows, int64_t cols) {
  FP8MOE_ASSERT(rows >= 0 && cols >= 0 && ld_dst >= cols && ld_src >= cols, "copy_2d of ", rows, " x ", cols,
                " with row strides ", ld_dst, " (dst) and ", ld_src, " (src)");
  if (rows == 0 || cols == 0) return;  // zero-size tensors are nullptr
  float* d = h(dst);
  const float* s = h(src);
  for (int64_t r = 0; r < rows; ++r) std::memcpy(d + r * ld_dst, s + r * ld_src, size_t(cols) * sizeof(float));
}

void HostBackend::zero(void* dst, size_t bytes) {
  if (bytes) std::memset(h(dst), 0, bytes);
}

void HostBackend::sgemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
                        int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  fp8moe::sgemm(trans_a, trans_b, M, N, K, alpha, h(A), lda, h(B), ldb, beta, h(C), ldc);
}

void HostBackend::gemm_bf16(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                            const uint16_t* A, int64_t lda, const uint16_t* B, int64_t ldb, float beta, float* C,
                            int64_t ldc) {
  fp8moe::gemm_bf16(trans_a, trans_b, M, N, K, alpha, h(A), lda, h(B), ldb, beta, h(C), ldc);
}

void HostBackend::gemm_fp8(GemmRole, const QuantView& A, bool trans_a, const QuantView& B, bool trans_b, float alpha,
                           float beta, float* C, int64_t ldc) {
  fp8moe::gemm_fp8(h(A), trans_a, h(B), trans_b, alpha, beta, h(C), ldc);
}

// The CPU form of kernels/grouped_gemm.h on the untagged operands.
void HostBackend::grouped_gemm_fp8_forward(const std::vector<QuantView>& X, const std::vector<QuantView>& W,
                                           const std::vector<float*>& Y, int64_t ld) {
  fp8moe::grouped_gemm_fp8_forward(h(X), h(W), h(Y), ld);
}

void HostBackend::grouped_gemm_fp8_dgrad(const std::vector<QuantView>& dY, const std::vector<QuantView>& W,
                                         const std::vector<float*>& dX, int64_t ld) {
  fp8moe::grouped_gemm_fp8_dgrad(h(dY), h(W), h(dX), ld);
}

void HostBackend::grouped_gemm_fp8_wgrad(const std::vector<QuantView>& dY, const std::vector<QuantView>& X,
                                         const std::vector<float*>& dW, int64_t ld) {
  fp8moe::grouped_gemm_fp8_wgrad(h(dY), h(X), h(dW), ld);
}

void HostBackend::amax(const float* x, int64_t n, float* out) { *h(out) = fp8moe::amax(h(x), n); }

void HostBackend::scale_from_amax(const float* amax, Fp8Dtype dtype, const ScaleOptions& opt, float* scale) {
  *h(scale) = compute_scale(*h(amax), fp8_max(dtype), opt.margin, opt.power_of_two);
}

namespace {
void add_counts(uint64_t* counts, int64_t sat, int64_t under) {
  if (counts) counts[0] += uint64_t(sat), counts[1] += uint64_t(under);
}
}  // namespace

void HostBackend::quantize_scaled(const float* x, const float* scale, const QuantView& out, uint64_t* counts,
                                  float* amax) {
  int64_t sat = 0, under = 0;
  cpu::quantize_scaled(h(x), *h(scale), h(out), &sat, &under, amax ? h(amax) : nullptr);
  add_counts(h(counts), sat, under);
}

void HostBackend::quantize_tiled(const float* x, const ScaleOptions& opt, const QuantView& out, uint64_t* counts) {
  int64_t sat = 0, under = 0;
  cpu::quantize_tiled(h(x), opt, h(out), &sat, &under);
  add_counts(h(counts), sat, under);
}

void HostBackend::delayed_update(float* history, int64_t len, int64_t steps, const float* amax,
                                 DelayedScalingCompute compute, Fp8Dtype dtype, const ScaleOptions& opt, float* scale) {
  cpu::delayed_update(h(history), len, steps, *h(amax), compute, dtype, opt, h(scale));
}

void HostBackend::dequantize(const QuantView& q, float* out) { cpu::dequantize(h(q), h(out)); }

void HostBackend::rmsnorm_forward(const float* x, const float* w, int64_t N, int64_t D, float eps, float* y,
                                  float* rstd) {
  cpu::rmsnorm_forward(h(x), h(w), N, D, eps, h(y), h(rstd));
}

void HostBackend::rmsnorm_backward(const float* x, const float* w, const float* rstd, const float* dy, int64_t N,
                                   int64_t D, float* dx, float* dw) {
  cpu::rmsnorm_backward(h(x), h(w), h(rstd), h(dy), N, D, h(dx), h(dw));
}

void HostBackend::rmsnorm_forward_bf16(const uint16_t* x, const float* w, int64_t N, int64_t D, float eps, float* y,
                                       float* rstd) {
  cpu::rmsnorm_forward_bf16(h(x), h(w), N, D, eps, h(y), h(rstd));
}

void HostBackend::rmsnorm_backward_bf16(const uint16_t* x, const float* w, const float* rstd, const float* dy, int64_t N,
                                        int64_t D, float* dx, float* dw) {
  cpu::rmsnorm_backward_bf16(h(x), h(w), h(rstd), h(dy), N, D, h(dx), h(dw));
}

void HostBackend::rope(float* x, int64_t B, int64_t T, int64_t heads, int64_t hd, const float* cs, const float* sn,
                       int64_t head_stride) {
  // NOTE: nothing to rotate, nothing translated: x may then be an offset from an empty tensor's
  // nullptr (the rotated part of a head, x = q + nope), which h() would take for host memory.
  if (B * T * heads * (hd / 2) == 0) return;
  cpu::rope(h(x), B, T, heads, hd, h(cs), h(sn), head_stride);
}

void HostBackend::attention_forward(const float* q, const float* k, const float* v, int64_t B, int64_t T, int64_t H,
                                    int64_t KVH, int64_t hd, int64_t hdv, float* out, float* lse) {
  cpu::attention_forward(h(q), h(k), h(v), B, T, H, KVH, hd, hdv, h(out), h(lse));
}

void HostBackend::attention_backward(const float* q, const float* k, const float* v, const float* out,
                                     const float* lse, const float* dout, int64_t B, int64_t T, int64_t H, int64_t KVH,
                                     int64_t hd, int64_t hdv, float* dq, float* dk, float* dv) {
  cpu::attention_backward(h(q), h(k), h(v), h(out), h(lse), h(dout), B, T, H, KVH, hd, hdv, h(dq), h(dk), h(dv));
}

void HostBackend::attention_forward_bf16(const uint16_t* q, const uint16_t* k, const uint16_t* v, int64_t B, int64_t T,
                                         int64_t H, int64_t KVH, int64_t hd, int64_t hdv, float* out, float* lse) {
  cpu::attention_forward_bf16(h(q), h(k), h(v), B, T, H, KVH, hd, hdv, h(out), h(lse));
}

void HostBackend::attention_backward_bf16(const uint16_t* q, const uint16_t* k, const uint16_t* v, const float* out,
                                          const float* lse, const float* dout, int64_t B, int64_t T, int64_t H,
                                          int64_t KVH, int64_t hd, int64_t hdv, float* dq, float* dk, float* dv) {
  cpu::attention_backward_bf16(h(q), h(k), h(v), h(out), h(lse), h(dout), B, T, H, KVH, hd, hdv, h(dq), h(dk), h(dv));
}

void HostBackend::mla_expand_kv(const float* kv, const float* kpe, int64_t N, int64_t H, int64_t nope, int64_t rope,
                                int64_t vd, float* k, float* v) {
  cpu::mla_expand_kv(h(kv), h(kpe), N, H, nope, rope, vd, h(k), h(v));
}

void HostBackend::mla_expand_kv_backward(const float* dk, const float* dv, int64_t N, int64_t H, int64_t nope,
                                         int64_t rope, int64_t vd, float* dkv, float* dkpe) {
  cpu::mla_expand_kv_backward(h(dk), h(dv), N, H, nope, rope, vd, h(dkv), h(dkpe));
}

void HostBackend::cross_entropy(const float* logits, const int32_t* targets, int64_t N, int64_t V, int32_t ignore,
                                float grad_scale, float* dlogits, double* loss_sum) {
  int64_t count = 0;
  *h(loss_sum) = cpu::cross_entropy(h(logits), h(targets), N, V, ignore, grad_scale, h(dlogits), &count);
}

void HostBackend::ce_row_max(const float* logits, int64_t N, int64_t Vl, float* mx) {
  cpu::ce_row_max(h(logits), N, Vl, h(mx));
}

void HostBackend::ce_partials(const float* logits, const int32_t* targets, int64_t N, int64_t Vl, int64_t v0,
                              int32_t ignore, const float* mx, double* se, double* tl) {
  cpu::ce_partials(h(logits), h(targets), N, Vl, v0, ignore, h(mx), h(se), h(tl));
}

void HostBackend::ce_finish(const float* logits, const int32_t* targets, int64_t N, int64_t Vl, int64_t v0,
                            int32_t ignore, const float* mx, const double* se, const double* tl, float grad_scale,
                            float* dlogits, double* loss_sum) {
  *h(loss_sum) = cpu::ce_finish(h(logits), h(targets), N, Vl, v0, ignore, h(mx), h(se), h(tl), grad_scale, h(dlogits));
}

void HostBackend::embedding_forward(const float* table, const int32_t* ids, int64_t N, int64_t D, int64_t v0,
                                    int64_t Vl, float* out) {
  cpu::embedding_forward(h(table), h(ids), N, D, v0, Vl, h(out));
}

void HostBackend::embedding_backward(const float* dout, const int32_t* ids, int64_t N, int64_t D, int64_t v0,
                                     int64_t Vl, float* dtable) {
  cpu::embedding_backward(h(dout), h(ids), N, D, v0, Vl, h(dtable));
}

void HostBackend::swiglu_forward(const float* a, const float* b, int64_t ld, float* y, int64_t rows, int64_t cols) {
  cpu::swiglu_forward(h(a), h(b), ld, h(y), rows, cols);
}

void HostBackend::swiglu_backward(const float* a, const float* b, int64_t ld, const float* dy, float* da, float* db,
                                  int64_t rows, int64_t cols) {
  cpu::swiglu_backward(h(a), h(b), ld, h(dy), h(da), h(db), rows, cols);
}

void HostBackend::swiglu_gated_forward(const float* a, const float* b, int64_t ld, const float* gate, float* y,
                                       int64_t rows, int64_t cols) {
  cpu::swiglu_gated_forward(h(a), h(b), ld, h(gate), h(y), rows, cols);
}

void HostBackend::swiglu_gated_backward(const float* a, const float* b, int64_t ld, const float* gate, const float* dy,
                                        float* da, float* db, double* dgate, int64_t rows, int64_t cols) {
  cpu::swiglu_gated_backward(h(a), h(b), ld, h(gate), h(dy), h(da), h(db), h(dgate), rows, cols);
}

void HostBackend::add(const float* a, const float* b, float* out, int64_t n) { cpu::add(h(a), h(b), h(out), n); }
void HostBackend::to_bf16(const float* x, uint16_t* y, int64_t n) { cpu::to_bf16(h(x), h(y), n); }
void HostBackend::swiglu_forward_bf16(const uint16_t* a, const uint16_t* b, int64_t ld, const float* gate, float* y,
                                      int64_t rows, int64_t cols) {
  cpu::swiglu_forward_bf16(h(a), h(b), ld, h(gate), h(y), rows, cols);
}

void HostBackend::swiglu_backward_bf16(const uint16_t* a, const uint16_t* b, int64_t ld, const float* gate,
                                       const float* dy, float* da, float* db, double* dgate, int64_t rows,
                                       int64_t cols) {
  cpu::swiglu_backward_bf16(h(a), h(b), ld, h(gate), h(dy), h(da), h(db), h(dgate), rows, cols);
}

void HostBackend::from_bf16(const uint16_t* x, float* y, int64_t n) { cpu::from_bf16(h(x), h(y), n); }
void HostBackend::round_bf16(const float* x, float* y, int64_t n) { cpu::round_bf16(h(x), h(y), n); }

void HostBackend::route(const float* z, const float* bias, const RouterRule& rule, const RoutingBuffers& out) {
  cpu::route(h(z), h(bias), rule, h(out));
}

void HostBackend::permute(const float* x, const int64_t* row_token, int64_t R, int64_t D, float* rows) {
  cpu::permute(h(x), h(row_token), R, D, h(rows));
}

void HostBackend::unpermute_add(const RoutingBuffers& r, int64_t R, const float* rows, int64_t D, bool gated,
                                float* out) {
  cpu::unpermute_add(h(r), R, h(rows), D, gated, h(out));
}

void HostBackend::row_gates(const RoutingBuffers& r, int64_t R, float* gate_rows) {
  cpu::row_gates(h(r), R, h(gate_rows));
}

void HostBackend::sum_rows(const float* rows, const int64_t* offsets, const int64_t* index, int64_t n, int64_t D,
                           float* out) {
  cpu::sum_rows(h(rows), h(offsets), h(index), n, D, h(out));
}

void HostBackend::sum_rows_bf16(const uint16_t* rows, const int64_t* offsets, const int64_t* index, int64_t n,
                                int64_t D, uint16_t* out) {
  cpu::sum_rows_bf16(h(rows), h(offsets), h(index), n, D, h(out));
}

void HostBackend::slot_grads(const RoutingBuffers& r, int64_t R, const double* row_grads, double* dgate) {
  cpu::slot_grads(h(r), R, h(row_grads), h(dgate));
}

void HostBackend::gate_grad(const RoutingBuffers& r, int64_t R, const float* dout, const float* expert_out, int64_t D,
                            float* dye, double* dgate) {
  cpu::gate_grad(h(r), R, h(dout), h(expert_out), D, h(dye), h(dgate));
}

void HostBackend::permute_bf16(const float* x, const int64_t* row_token, int64_t R, int64_t D, uint16_t* rows) {
  cpu::permute_bf16(h(x), h(row_token), R, D, h(rows));
}

void HostBackend::unpermute_add_bf16(const RoutingBuffers& r, int64_t R, const uint16_t* rows, int64_t D, bool gated,
                                     float* out) {
  cpu::unpermute_add_bf16(h(r), R, h(rows), D, gated, h(out));
}

void HostBackend::gate_grad_bf16(const RoutingBuffers& r, int64_t R, const float* dout, const uint16_t* expert_out,
                                 int64_t D, float* dye, double* dgate) {
  cpu::gate_grad_bf16(h(r), R, h(dout), h(expert_out), D, h(dye), h(dgate));
}

void HostBackend::router_grad(const RoutingBuffers& r, const double* dgate, const RouterGradRule& rule, float* dz) {
  cpu::router_grad(h(r), h(dgate), rule, h(dz));
}

void HostBackend::aux_loss(const RoutingBuffers& r, double coef, bool sigmoid, double* out) {
  *h(out) = cpu::aux_loss(h(r), coef, sigmoid);
}

void HostBackend::bias_update(float* bias, const int64_t* load, int64_t E, double rate) {
  cpu::bias_update(h(bias), h(load), E, rate);
}

void HostBackend::adamw(const AdamWStep& hp, float* w, const float* g, float* m, float* v, uint16_t* m16,
                        uint16_t* v16, int64_t n) {
  cpu::adamw(hp, h(w), h(g), h(m), h(v), h(m16), h(v16), n);
}

void HostBackend::sum_squares(const float* g, int64_t n, float unscale, double* out) {
  *h(out) = cpu::sum_squares(h(g), n, unscale);
}

void HostBackend::sum(const double* x, int64_t n, double* out) { *h(out) = cpu::sum(h(x), n); }

}  // namespace fp8moe
