#include <kernels/cuda/multi_tensor_scale_cuda.h>
#include <kernels/cuda/multi_tensor_apply.cuh>
#include <kernels/cuda/vector_access.cuh>

namespace kernels::cuda {
namespace {

template <typename T>
struct ScaleFunctor {
  __device__ void operator()(const ChunkTable<1>& table, int block, float scale) const {
    const Chunk chunk = chunk_of_block(table, block);
    T* data = static_cast<T*>(table.addresses[0][chunk.tensor]) + chunk.begin;
    int64_t i = 0;
    if (is_aligned16(data)) {
      constexpr int kVec = kVectorElements<T>;
      auto* vectors = reinterpret_cast<Vector16<T>*>(data);
      const int64_t n_vectors = chunk.num_elements / kVec;
      for (int64_t v = threadIdx.x; v < n_vectors; v += blockDim.x) {
        Vector16<T> x = vectors[v];
#pragma unroll
        for (int k = 0; k < kVec; ++k) x.values[k] = from_float<T>(to_float(x.values[k]) * scale);
        vectors[v] = x;
      }
      i = n_vectors * kVec;
    }
    for (int64_t j = i + threadIdx.x; j < chunk.num_elements; j += blockDim.x) {
      data[j] = from_float<T>(to_float(data[j]) * scale);
    }
  }
};

}  // namespace

void multi_tensor_scale(const PointerLists<1>& lists, float scale, cudaStream_t stream) {
  dispatch_dtype(lists.dtypes[0], [&](auto tag) {
    using T = decltype(tag);
    multi_tensor_apply<1>(lists, stream, ScaleFunctor<T>{}, scale);
  });
}

}  // namespace kernels::cuda
