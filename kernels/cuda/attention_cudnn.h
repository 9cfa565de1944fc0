// Causal grouped-query attention fused by cuDNN: its SDPA forward and backward (flash-attention
// style, O(T) memory, tensor cores) built through the cuDNN frontend's graph API. Operands in BF16,
// softmax statistics and accumulation in FP32; the layouts of kernels/attention.h:
//   q, dq: (B*T, H, hd); k, dk: (B*T, KVH, hd); v, dv: (B*T, KVH, hdv); o, do: (B*T, H, hdv);
//   stats: (B, H, T) FP32, the natural-log log-sum-exp of each row of scaled scores (kernels/
//   attention.h's lse). cuDNN's SDPA takes a value head size other than the query/key one (on
//   Hopper the frontend 1.32 support checks accept BF16 hd != hdv up to 256 each, multiples of 8:
//   DeepSeek-V3's MLA is hd 192, hdv 128; not yet run on a GPU here); where it has no plan,
//   prepare() says why.
// libcudnn.so.9 is opened at run time (FP8MOE_CUDNN_LIBRARY names another file): a machine without
// cuDNN still runs fp8moe, with the reference kernel of kernels/cuda/attention.h.
//
// NOTE: the backward graph asks cuDNN for its deterministic algorithm (the same bits run to run on
// one GPU); a shape for which cuDNN has no plan with that property is not supported.
#pragma once

#include <cuda_runtime_api.h>

#include <compare>
#include <cstdint>
#include <memory>
#include <string>

namespace fp8moe::cuda {

struct AttnDims {
  int64_t B = 0, T = 0, H = 0, KVH = 0, hd = 0, hdv = 0;  // hd: query/key head size, hdv: value's
  auto operator<=>(const AttnDims&) const = default;
};
// "B 4 T 2048 H 16 KVH 16 head_dim 128", "... head_dim 192 value_head_dim 128" where hdv != hd
// (messages, Backend::attention_kernels()).
std::string to_string(const AttnDims& d);

// Why libcudnn cannot be opened in this process ("" when it can), and its version (0 when not).
// Neither needs a GPU.
std::string cudnn_library_error();
int64_t cudnn_library_version();

class CudnnAttention {
 public:
  // Opens cuDNN and makes its handle on `stream`: nullptr with *why set when it cannot.
  static std::unique_ptr<CudnnAttention> create(cudaStream_t stream, std::string* why);
  ~CudnnAttention();
  CudnnAttention(const CudnnAttention&) = delete;
  CudnnAttention& operator=(const CudnnAttention&) = delete;

  // "cuDNN 9.19.0 (frontend 1.32.0)".
  std::string version() const;
  // Builds the forward and backward plans of a shape (once; later calls are a look-up): false with
  // *why when cuDNN has no plan for one of them.
  bool prepare(const AttnDims& d, std::string* why);
  // Workspace bytes of a prepared shape's plans.
  int64_t forward_workspace(const AttnDims& d) const;
  int64_t backward_workspace(const AttnDims& d) const;
  // Queued on the stream; every pointer is device memory, BF16 where not float. The shape must be
  // prepared; workspace holds at least its bytes (may be nullptr for 0).
  void forward(const AttnDims& d, const void* q, const void* k, const void* v, void* o, float* stats,
               void* workspace) const;
  void backward(const AttnDims& d, const void* q, const void* k, const void* v, const void* o, const void* dout,
                const float* stats, void* dq, void* dk, void* dv, void* workspace) const;

 private:
  struct Impl;
  explicit CudnnAttention(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace fp8moe::cuda
