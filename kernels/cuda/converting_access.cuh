#pragma once

// Vector access for functors whose lists have different dtypes (e.g. read fp16, write fp32). One step handles
// kN elements, the widest 16-byte vector among the dtypes involved (8 for any 2-byte dtype, else 4), so every
// load and store of every list is a whole 16-byte access: a float->half copy reads two float vectors and
// writes one half vector per step.

#include <kernels/cuda/scalar_arg.cuh>
#include <kernels/cuda/vector_access.cuh>

namespace kernels::cuda {

template <typename T, typename... Rest>
constexpr int widest_vector() {
  if constexpr (sizeof...(Rest) == 0) {
    return kVectorElements<T>;
  } else {
    constexpr int rest = widest_vector<Rest...>();
    return kVectorElements<T> > rest ? kVectorElements<T> : rest;
  }
}

/// Elements per vector step of a functor over lists of dtypes Ts.
template <typename... Ts>
constexpr int kStepElements = widest_vector<Ts...>();

/// Loads kN elements of T as fp32 with 16-byte loads. p must be 16-byte aligned and kN a whole number of
/// 16-byte vectors of T.
template <int kN, typename T>
__device__ __forceinline__ void load_as_float(const T* p, float (&out)[kN]) {
  constexpr int kPer = kVectorElements<T>;
  static_assert(kN % kPer == 0, "kN must be a whole number of 16-byte vectors");
  const auto* vectors = reinterpret_cast<const Vector16<T>*>(p);
#pragma unroll
  for (int v = 0; v < kN / kPer; ++v) {
    const Vector16<T> w = vectors[v];
#pragma unroll
    for (int k = 0; k < kPer; ++k) out[v * kPer + k] = to_float(w.values[k]);
  }
}

/// Stores kN elements of T with 16-byte stores (same requirements as load_as_float).
template <int kN, typename T>
__device__ __forceinline__ void store_vectors(T* p, const T (&in)[kN]) {
  constexpr int kPer = kVectorElements<T>;
  static_assert(kN % kPer == 0, "kN must be a whole number of 16-byte vectors");
  auto* vectors = reinterpret_cast<Vector16<T>*>(p);
#pragma unroll
  for (int v = 0; v < kN / kPer; ++v) {
    Vector16<T> w;
#pragma unroll
    for (int k = 0; k < kPer; ++k) w.values[k] = in[v * kPer + k];
    vectors[v] = w;
  }
}

}  // namespace kernels::cuda
