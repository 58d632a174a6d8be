#pragma once

// Element access shared by the multi-tensor functors: fp32 arithmetic on any storage dtype, and 16-byte
// vector loads where the address allows them.

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <kernels/dtype.h>

namespace kernels::cuda {

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __half from_float<__half>(float x) {
  return __float2half_rn(x);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

/// Elements of T in one 16-byte vector.
template <typename T>
constexpr int kVectorElements = 16 / static_cast<int>(sizeof(T));

template <typename T>
struct alignas(16) Vector16 {
  T values[kVectorElements<T>];
};

__device__ __forceinline__ bool is_aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

/// Replaces every element v of data[0, n) by op(v), the threads of the block striding through: 16-byte vector
/// loads and stores where `data` is aligned, then a scalar tail. The read-modify-write shape of scale, clip and
/// unscale.
template <typename T, typename Op>
__device__ __forceinline__ void transform_chunk(T* data, int64_t n, Op op) {
  int64_t i = 0;
  if (is_aligned16(data)) {
    constexpr int kVec = kVectorElements<T>;
    auto* vectors = reinterpret_cast<Vector16<T>*>(data);
    const int64_t n_vectors = n / kVec;
    for (int64_t v = threadIdx.x; v < n_vectors; v += blockDim.x) {
      Vector16<T> x = vectors[v];
#pragma unroll
      for (int k = 0; k < kVec; ++k) x.values[k] = op(x.values[k]);
      vectors[v] = x;
    }
    i = n_vectors * kVec;
  }
  for (int64_t j = i + threadIdx.x; j < n; j += blockDim.x) data[j] = op(data[j]);
}

/// Calls `f(dtype_tag)` with a value of the CUDA storage type matching `dtype`.
template <typename F>
void dispatch_dtype(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kFloat32:
      f(float{});
      break;
    case DType::kFloat16:
      f(__half{});
      break;
    case DType::kBFloat16:
      f(__nv_bfloat16{});
      break;
  }
}

}  // namespace kernels::cuda
