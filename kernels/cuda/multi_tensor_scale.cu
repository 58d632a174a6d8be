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
    transform_chunk(data, chunk.num_elements, [scale](T v) { return from_float<T>(to_float(v) * scale); });
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
