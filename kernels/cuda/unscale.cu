#include <kernels/cuda/unscale_cuda.h>
#include <kernels/cuda/multi_tensor_apply.cuh>
#include <kernels/cuda/vector_access.cuh>

namespace kernels::cuda {
namespace {

template <typename T>
__device__ __forceinline__ T unscale_one(T value, float inv_scale, bool& bad) {
  const float x = to_float(value);
  const T stored = from_float<T>(x * inv_scale);
  bad |= !isfinite(x) || !isfinite(to_float(stored));
  return stored;
}

template <typename T>
struct UnscaleFunctor {
  __device__ void operator()(const ChunkTable<1>& table, int block, const float* inv_scale_ptr, float* found_inf,
                             int32_t* first_index) const {
    const Chunk chunk = chunk_of_block(table, block);
    T* data = static_cast<T*>(table.addresses[0][chunk.tensor]) + chunk.begin;
    const float inv_scale = *inv_scale_ptr;
    bool bad = false;
    transform_chunk(data, chunk.num_elements, [&](T v) { return unscale_one(v, inv_scale, bad); });
    // One write per block that saw a non-finite value.
    if (__syncthreads_or(bad) && threadIdx.x == 0) {
      *found_inf = 1.0f;
      if (first_index != nullptr) atomicMin(first_index, table.original_index[chunk.tensor]);
    }
  }
};

}  // namespace

void unscale_and_check(const PointerLists<1>& lists, const float* inv_scale, float* found_inf, int32_t* first_index,
                       cudaStream_t stream) {
  dispatch_dtype(lists.dtypes[0], [&](auto tag) {
    using T = decltype(tag);
    multi_tensor_apply<1>(lists, stream, UnscaleFunctor<T>{}, inv_scale, found_inf, first_index);
  });
}

}  // namespace kernels::cuda
