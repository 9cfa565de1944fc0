#include "kernels/tensor.h"

#include <cstring>

#include "kernels/backend.h"

namespace fp8moe {

const char* to_string(DeviceKind d) {
  switch (d) {
    case DeviceKind::cpu: return "cpu";
    case DeviceKind::cuda: return "cuda";
    default: return "emulated";
  }
}

size_t dtype_size(DType t) {
  switch (t) {
    case DType::f64: case DType::i64: case DType::u64: return 8;
    case DType::f32: case DType::i32: return 4;
    case DType::bf16: return 2;
    default: return 1;
  }
}

const char* to_string(DType t) {
  switch (t) {
    case DType::f32: return "fp32";
    case DType::f64: return "fp64";
    case DType::bf16: return "bf16";
    case DType::e4m3: return "e4m3";
    case DType::e5m2: return "e5m2";
    case DType::i32: return "int32";
    case DType::i64: return "int64";
    case DType::u8: return "uint8";
    default: return "uint64";
  }
}

Shape::Shape(std::initializer_list<int64_t> d) {
  FP8MOE_ASSERT(d.size() <= 4, "a tensor of ", d.size(), " dimensions (at most 4)");
  for (int64_t x : d) {
    FP8MOE_ASSERT(x >= 0, "a negative dimension ", x);
    dims[rank++] = x;
  }
}

int64_t Shape::numel() const {
  if (rank == 0) return 0;
  int64_t n = 1;
  for (int i = 0; i < rank; ++i) n *= dims[i];
  return n;
}

bool Shape::operator==(const Shape& o) const {
  if (rank != o.rank) return false;
  for (int i = 0; i < rank; ++i)
    if (dims[i] != o.dims[i]) return false;
  return true;
}

Tensor::Tensor(Backend& be, DType dtype, Shape shape) : be_(&be), dtype_(dtype), shape_(shape) {
  data_ = be.allocate(bytes());
}

Tensor Tensor::zeros(Backend& be, DType dtype, Shape shape) {
  Tensor t(be, dtype, shape);
  if (t.bytes() > 0) be.zero(t.data_, t.bytes());
  return t;
}

Tensor& Tensor::operator=(Tensor&& o) noexcept {
  if (this != &o) {
    reset();
    be_ = std::exchange(o.be_, nullptr);
    data_ = std::exchange(o.data_, nullptr);
    dtype_ = o.dtype_;
    shape_ = std::exchange(o.shape_, Shape{});
  }
  return *this;
}

void Tensor::reset() {
  if (be_ && data_) be_->release(data_);
  data_ = nullptr;
  shape_ = Shape{};
}

TensorView Tensor::view() const { return {data_, dtype_, shape_, be_ ? be_->kind() : DeviceKind::cpu}; }

QTensor::QTensor(Backend& be, int64_t rows_, int64_t cols_, Fp8Dtype dtype_, Tiling tiling_, int tile_)
    : rows(rows_), cols(cols_), dtype(dtype_), tiling(tiling_), tile(tiling_ == Tiling::per_tensor ? 1 : tile_) {
  data = Tensor(be, dtype == Fp8Dtype::e4m3 ? DType::e4m3 : DType::e5m2, {rows, cols});
  scale_inv = Tensor(be, DType::f32, {tiling_scale_rows(tiling, tile, rows) * tiling_scale_cols(tiling, tile, cols)});
}

QuantView QTensor::view() const {
  return {static_cast<uint8_t*>(data.raw()), static_cast<float*>(scale_inv.raw()), rows, cols, dtype, tiling, tile};
}

template <class T>
HostBuffer<T>::HostBuffer(Backend& be, int64_t n) : be_(&be), n_(n) {
  p_ = n > 0 ? static_cast<T*>(be.allocate_host(size_t(n) * sizeof(T))) : nullptr;
}

template <class T>
void HostBuffer<T>::reset() {
  if (be_ && p_) be_->release_host(p_);
  p_ = nullptr, n_ = 0;
}

template <class T>
std::vector<T> to_host(Backend& be, const T* device, int64_t n) {
  std::vector<T> out(static_cast<size_t>(n));
  if (n == 0) return out;
  HostBuffer<T> staging(be, n);
  be.download(staging.data(), device, size_t(n) * sizeof(T));
  be.sync();
  std::memcpy(out.data(), staging.data(), size_t(n) * sizeof(T));
  return out;
}

template <class T>
void to_device(Backend& be, const std::vector<T>& host, T* device) {
  if (!host.empty()) be.upload(device, host.data(), host.size() * sizeof(T));
}

template <class T>
Tensor tensor_from(Backend& be, const std::vector<T>& host, Shape shape) {
  FP8MOE_ASSERT(shape.numel() == int64_t(host.size()), "tensor_from: ", host.size(), " values for ", shape.numel());
  Tensor t(be, dtype_of<T>(), shape);
  to_device(be, host, t.data<T>());
  return t;
}

#define FP8MOE_TENSOR_TYPES(T)                                           \
  template class HostBuffer<T>;                                          \
  template std::vector<T> to_host<T>(Backend&, const T*, int64_t);       \
  template void to_device<T>(Backend&, const std::vector<T>&, T*);       \
  template Tensor tensor_from<T>(Backend&, const std::vector<T>&, Shape);
FP8MOE_TENSOR_TYPES(float)
FP8MOE_TENSOR_TYPES(double)
FP8MOE_TENSOR_TYPES(int32_t)
FP8MOE_TENSOR_TYPES(int64_t)
FP8MOE_TENSOR_TYPES(uint8_t)
FP8MOE_TENSOR_TYPES(uint16_t)
FP8MOE_TENSOR_TYPES(uint64_t)
#undef FP8MOE_TENSOR_TYPES

}  // namespace fp8moe
