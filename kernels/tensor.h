// Tensors that know where they live (docs/ARCHITECTURE.md, "Tensors and backends").
//
//   Tensor      owning, move-only: a dtype, a shape and memory from one Backend's allocator (device
//               memory on the CUDA and emulated backends, host memory on the CPU backend)
//   TensorView  non-owning: the same description of memory someone else owns (a parameter's slice
//               of the flat parameter buffer)
//   QTensor     an FP8 tensor on a backend: its bytes, its dequantization scales and its tiling;
//               QuantView is the non-owning form the ops take
//   HostBuffer  host memory for staging transfers, pinned when the backend is CUDA
//
// Nothing here dereferences tensor memory: device memory is for the backend's ops only, and the
// host reads it through Backend::download (kernels/backend.h) or the to_host helpers below.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <type_traits>
#include <utility>
#include <vector>

#include "kernels/check.h"
#include "kernels/quantize.h"

namespace fp8moe {

class Backend;

enum class DeviceKind : uint8_t {
  cpu,       // host memory: the reference backend
  cuda,      // device memory on a GPU
  emulated,  // host memory tagged as device memory that the host may not touch: the CPU kernels run
             // inside the backend's ops only (kernels/host_backend.h). Proves residency without a GPU.
};
const char* to_string(DeviceKind d);

enum class DType : uint8_t { f32, f64, bf16, e4m3, e5m2, i32, i64, u8, u64 };
size_t dtype_size(DType t);
const char* to_string(DType t);

template <class T>
constexpr DType dtype_of() {
  if constexpr (std::is_same_v<T, float>) return DType::f32;
  else if constexpr (std::is_same_v<T, double>) return DType::f64;
  else if constexpr (std::is_same_v<T, uint16_t>) return DType::bf16;
  else if constexpr (std::is_same_v<T, int32_t>) return DType::i32;
  else if constexpr (std::is_same_v<T, int64_t>) return DType::i64;
  else if constexpr (std::is_same_v<T, uint8_t>) return DType::u8;
  else if constexpr (std::is_same_v<T, uint64_t>) return DType::u64;
  else static_assert(sizeof(T) == 0, "no DType for this element type");
}
// Whether memory of dtype `t` may be accessed as T (FP8 bytes as uint8_t, BF16 bits as uint16_t).
template <class T>
constexpr bool dtype_holds(DType t) {
  if constexpr (std::is_same_v<T, uint8_t>) return t == DType::u8 || t == DType::e4m3 || t == DType::e5m2;
  else return t == dtype_of<T>();
}

// Up to four dimensions, row-major.
struct Shape {
  int64_t dims[4] = {0, 0, 0, 0};
  int rank = 0;
  Shape() = default;
  Shape(std::initializer_list<int64_t> d);
  int64_t numel() const;
  int64_t operator[](int i) const { return dims[i]; }
  bool operator==(const Shape& o) const;
};

struct TensorView {
  void* data = nullptr;
  DType dtype = DType::f32;
  Shape shape;
  DeviceKind device = DeviceKind::cpu;
  int64_t numel() const { return shape.numel(); }
  template <class T>
  T* as() const {
    FP8MOE_ASSERT(dtype_holds<T>(dtype), "a ", to_string(dtype), " tensor viewed as another element type");
    return static_cast<T*>(data);
  }
};

class Tensor {
 public:
  Tensor() = default;
  // Uninitialised memory of shape.numel() elements from be's allocator.
  Tensor(Backend& be, DType dtype, Shape shape);
  static Tensor zeros(Backend& be, DType dtype, Shape shape);
  ~Tensor() { reset(); }
  Tensor(Tensor&& o) noexcept { *this = std::move(o); }
  Tensor& operator=(Tensor&& o) noexcept;
  Tensor(const Tensor&) = delete;
  Tensor& operator=(const Tensor&) = delete;

  template <class T>
  T* data() {
    FP8MOE_ASSERT(empty() || dtype_holds<T>(dtype_), "a ", to_string(dtype_), " tensor accessed as another type");
    return static_cast<T*>(data_);
  }
  template <class T>
  const T* data() const {
    FP8MOE_ASSERT(empty() || dtype_holds<T>(dtype_), "a ", to_string(dtype_), " tensor accessed as another type");
    return static_cast<const T*>(data_);
  }
  float* f32() { return data<float>(); }
  const float* f32() const { return data<float>(); }
  void* raw() const { return data_; }

  DType dtype() const { return dtype_; }
  const Shape& shape() const { return shape_; }
  int64_t numel() const { return shape_.numel(); }
  size_t bytes() const { return size_t(numel()) * dtype_size(dtype_); }
  bool empty() const { return numel() == 0; }
  Backend* backend() const { return be_; }
  TensorView view() const;
  void reset();

 private:
  Backend* be_ = nullptr;
  void* data_ = nullptr;
  DType dtype_ = DType::f32;
  Shape shape_;
};

// An FP8 tensor on a backend (kernels/quantize.h's QuantTensor, in backend memory).
struct QTensor {
  Tensor data;       // (rows, cols) bytes
  Tensor scale_inv;  // the tiling's scale layout (kernels/quantize.h), FP32
  int64_t rows = 0, cols = 0;
  Fp8Dtype dtype = Fp8Dtype::e4m3;
  Tiling tiling = Tiling::per_tensor;
  int tile = 1;
  // Allocates the bytes and the scales of a (rows, cols) tensor of this tiling (uninitialised).
  QTensor(Backend& be, int64_t rows, int64_t cols, Fp8Dtype dtype, Tiling tiling, int tile);
  QTensor() = default;
  QuantView view() const;
  bool empty() const { return data.backend() == nullptr; }
  int64_t bytes() const { return int64_t(data.bytes() + scale_inv.bytes()); }
};

// Host memory for transfers (Backend::allocate_host: pinned under CUDA), n elements of T.
template <class T>
class HostBuffer {
 public:
  HostBuffer() = default;
  HostBuffer(Backend& be, int64_t n);
  ~HostBuffer() { reset(); }
  HostBuffer(HostBuffer&& o) noexcept
      : be_(std::exchange(o.be_, nullptr)), p_(std::exchange(o.p_, nullptr)), n_(std::exchange(o.n_, 0)) {}
  HostBuffer& operator=(HostBuffer&& o) noexcept {
    if (this != &o) reset(), be_ = std::exchange(o.be_, nullptr), p_ = std::exchange(o.p_, nullptr), n_ = std::exchange(o.n_, 0);
    return *this;
  }
  HostBuffer(const HostBuffer&) = delete;
  HostBuffer& operator=(const HostBuffer&) = delete;
  T* data() { return p_; }
  const T* data() const { return p_; }
  T& operator[](int64_t i) { return p_[i]; }
  const T& operator[](int64_t i) const { return p_[i]; }
  int64_t size() const { return n_; }
  void reset();

 private:
  Backend* be_ = nullptr;
  T* p_ = nullptr;
  int64_t n_ = 0;
};

// Copies for tests, tools and checkpoints: device -> a host vector (one download and one host
// synchronisation), and a host vector -> device memory (an upload).
template <class T>
std::vector<T> to_host(Backend& be, const T* device, int64_t n);
template <class T>
std::vector<T> to_host(const Tensor& t) {
  return to_host(*t.backend(), t.data<T>(), t.numel());
}
template <class T>
void to_device(Backend& be, const std::vector<T>& host, T* device);
template <class T>
Tensor tensor_from(Backend& be, const std::vector<T>& host, Shape shape);

}  // namespace fp8moe
