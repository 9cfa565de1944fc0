// SwiGLU on the GPU: the element functions of kernels/swiglu.h in grid-stride loops.
//
// Against kernels/cpu/swiglu.cpp: close. The same source runs on both sides, but the device expf
// differs from the CPU's exponential (SLEEF's, kernels/cpu/vmath.h) by up to 2 ulp and nvcc fuses its multiply-adds (1 + a (1 - s) cancels near
// a = -1.28), so results agree to rounding relative to the size of the terms, not bitwise. The
// gated backward's dgate is a warp's tree of double products per row (the CPU's: serial).
#include "kernels/cuda/block_reduce.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/swiglu.h"
#include "kernels/fp8.h"
#include "kernels/swiglu.h"

namespace fp8moe::cuda {
namespace {

// T: float, or uint16_t (BF16 bits), read as kernels/fp8.h kept_value widens them.

// Element i of the contiguous (rows, cols) y / dy is (i / cols, i % cols) of the strided a, b.
template <class T>
__global__ void swiglu_forward_kernel(const T* __restrict__ a, const T* __restrict__ b, int64_t ld,
                                      float* __restrict__ y, int64_t n, int64_t cols) {
  FP8MOE_GRID_STRIDE(i, n) {
    const int64_t j = (i / cols) * ld + i % cols;
    y[i] = swiglu_forward_elem(kept_value(a[j]), kept_value(b[j]));
  }
}

template <class T>
__global__ void swiglu_backward_kernel(const T* __restrict__ a, const T* __restrict__ b, int64_t ld,
                                       const float* __restrict__ dy, float* __restrict__ da,
                                       float* __restrict__ db, int64_t n, int64_t cols) {
  FP8MOE_GRID_STRIDE(i, n) {
    const int64_t j = (i / cols) * ld + i % cols;
    swiglu_backward_elem(kept_value(a[j]), kept_value(b[j]), dy[i], &da[j], &db[j]);
  }
}

template <class T>
__global__ void swiglu_gated_forward_kernel(const T* __restrict__ a, const T* __restrict__ b, int64_t ld,
                                            const float* __restrict__ gate, float* __restrict__ y, int64_t n,
                                            int64_t cols) {
  FP8MOE_GRID_STRIDE(i, n) {
    const int64_t r = i / cols, j = r * ld + i % cols;
    const float x = kept_value(a[j]);
    y[i] = swiglu_gated_forward_elem(x, kept_value(b[j]), sigmoidf_(x), gate[r]);
  }
}

// One warp per row.
template <class T>
__global__ void swiglu_gated_backward_kernel(const T* __restrict__ a, const T* __restrict__ b, int64_t ld,
                                             const float* __restrict__ gate, const float* __restrict__ dy,
                                             float* __restrict__ da, float* __restrict__ db,
                                             double* __restrict__ dgate, int64_t rows, int64_t cols) {
  const int64_t r = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) / kWarpThreads;
  const int lane = threadIdx.x % kWarpThreads;
  if (r >= rows) return;
  const float g = gate[r];
  double dg = 0;
  for (int64_t c = lane; c < cols; c += kWarpThreads) {
    const int64_t j = r * ld + c;
    const float x = kept_value(a[j]), y = kept_value(b[j]);
    const float s = sigmoidf_(x), d = dy[r * cols + c];
    dg += double(d) * double(swiglu_forward_elem(x, y, s));
    swiglu_backward_elem(x, y, g * d, s, &da[j], &db[j]);
  }
  dg = warp_reduce(dg, SumOp{});
  if (lane == 0) dgate[r] = dg;
}

}  // namespace

void swiglu_gated_forward(const float* a, const float* b, int64_t ld, const float* gate, float* y, int64_t rows,
                          int64_t cols, cudaStream_t stream) {
  const int64_t n = rows * cols;
  if (n == 0) return;
  swiglu_gated_forward_kernel<float><<<grid_for(n), kBlockThreads, 0, stream>>>(a, b, ld, gate, y, n, cols);
  check_launch();
}

void swiglu_gated_backward(const float* a, const float* b, int64_t ld, const float* gate, const float* dy, float* da,
                           float* db, double* dgate, int64_t rows, int64_t cols, cudaStream_t stream) {
  if (rows == 0) return;
  swiglu_gated_backward_kernel<float><<<warps_grid(rows, "swiglu_gated_backward"), kBlockThreads, 0, stream>>>(
      a, b, ld, gate, dy, da, db, dgate, rows, cols);
  check_launch();
}

void swiglu_forward(const float* a, const float* b, int64_t ld, float* y, int64_t rows, int64_t cols,
                    cudaStream_t stream) {
  const int64_t n = rows * cols;
  if (n == 0) return;
  swiglu_forward_kernel<float><<<grid_for(n), kBlockThreads, 0, stream>>>(a, b, ld, y, n, cols);
  check_launch();
}

void swiglu_backward(const float* a, const float* b, int64_t ld, const float* dy, float* da, float* db, int64_t rows,
                     int64_t cols, cudaStream_t stream) {
  const int64_t n = rows * cols;
  if (n == 0) return;
  swiglu_backward_kernel<float><<<grid_for(n), kBlockThreads, 0, stream>>>(a, b, ld, dy, da, db, n, cols);
  check_launch();
}

void swiglu_forward_bf16(const uint16_t* a, const uint16_t* b, int64_t ld, const float* gate, float* y, int64_t rows,
                         int64_t cols, cudaStream_t stream) {
  const int64_t n = rows * cols;
  if (n == 0) return;
  if (gate)
    swiglu_gated_forward_kernel<uint16_t><<<grid_for(n), kBlockThreads, 0, stream>>>(a, b, ld, gate, y, n, cols);
  else
    swiglu_forward_kernel<uint16_t><<<grid_for(n), kBlockThreads, 0, stream>>>(a, b, ld, y, n, cols);
  check_launch();
}

void swiglu_backward_bf16(const uint16_t* a, const uint16_t* b, int64_t ld, const float* gate, const float* dy,
                          float* da, float* db, double* dgate, int64_t rows, int64_t cols, cudaStream_t stream) {
  if (rows == 0 || cols == 0) return;
  if (gate) {
    swiglu_gated_backward_kernel<uint16_t><<<warps_grid(rows, "swiglu_backward_bf16"), kBlockThreads, 0, stream>>>(
        a, b, ld, gate, dy, da, db, dgate, rows, cols);
  } else {
    const int64_t n = rows * cols;
    swiglu_backward_kernel<uint16_t><<<grid_for(n), kBlockThreads, 0, stream>>>(a, b, ld, dy, da, db, n, cols);
  }
  check_launch();
}

}  // namespace fp8moe::cuda
