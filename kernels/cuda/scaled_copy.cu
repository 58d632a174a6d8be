#include <kernels/cuda/scaled_copy_cuda.h>
#include <kernels/cuda/converting_access.cuh>
#include <kernels/cuda/multi_tensor_apply.cuh>

namespace kernels::cuda {
namespace {

template <typename Src, typename Dst>
struct ScaledCopyFunctor {
  __device__ void operator()(const ChunkTable<2>& table, int block, ScalarArg scale_arg, float* found_inf,
                             int32_t* first_index) const {
    const Chunk chunk = chunk_of_block(table, block);
    const Src* src = static_cast<const Src*>(table.addresses[0][chunk.tensor]) + chunk.begin;
    Dst* dst = static_cast<Dst*>(table.addresses[1][chunk.tensor]) + chunk.begin;
    const float scale = read_scalar(scale_arg);
    bool bad = false;
    auto convert = [&](float x) {
      const Dst stored = from_float<Dst>(x * scale);
      bad |= !isfinite(x) || !isfinite(to_float(stored));
      return stored;
    };
    int64_t i = 0;
    // Chunks start at multiples of 65536 elements, so a chunk is aligned exactly when its tensor's start is.
    if (is_aligned16(src) && is_aligned16(dst)) {
      constexpr int kStep = kStepElements<Src, Dst>;
      const int64_t n_steps = chunk.num_elements / kStep;
      for (int64_t s = threadIdx.x; s < n_steps; s += blockDim.x) {
        float x[kStep];
        load_as_float(src + s * kStep, x);
        Dst y[kStep];
#pragma unroll
        for (int k = 0; k < kStep; ++k) y[k] = convert(x[k]);
        store_vectors(dst + s * kStep, y);
      }
      i = n_steps * kStep;
    }
    for (int64_t j = i + threadIdx.x; j < chunk.num_elements; j += blockDim.x) dst[j] = convert(to_float(src[j]));
    // The condition is the same for every thread of the block, so all of them reach the barrier or none does.
    const bool report = found_inf != nullptr || first_index != nullptr;
    if (report && __syncthreads_or(bad) && threadIdx.x == 0) {
      if (found_inf != nullptr) *found_inf = 1.0f;
      if (first_index != nullptr) atomicMin(first_index, table.original_index[chunk.tensor]);
    }
  }
};

}  // namespace

void scaled_copy(const PointerLists<2>& lists, ScalarArg scale, float* found_inf, int32_t* first_index,
                 cudaStream_t stream) {
  dispatch_dtype(lists.dtypes[0], [&](auto src_tag) {
    dispatch_dtype(lists.dtypes[1], [&](auto dst_tag) {
      using Src = decltype(src_tag);
      using Dst = decltype(dst_tag);
      multi_tensor_apply<2>(lists, stream, ScaledCopyFunctor<Src, Dst>{}, scale, found_inf, first_index);
    });
  });
}

}  // namespace kernels::cuda
