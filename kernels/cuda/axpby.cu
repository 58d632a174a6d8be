#include <kernels/cuda/axpby_cuda.h>
#include <kernels/cuda/converting_access.cuh>
#include <kernels/cuda/multi_tensor_apply.cuh>

namespace kernels::cuda {
namespace {

template <typename X, typename Y, typename Out>
struct AxpbyFunctor {
  __device__ void operator()(const ChunkTable<3>& table, int block, float a, float b, float* found_inf, bool check_x,
                             bool check_y) const {
    const Chunk chunk = chunk_of_block(table, block);
    const X* x = static_cast<const X*>(table.addresses[0][chunk.tensor]) + chunk.begin;
    const Y* y = static_cast<const Y*>(table.addresses[1][chunk.tensor]) + chunk.begin;
    Out* out = static_cast<Out*>(table.addresses[2][chunk.tensor]) + chunk.begin;
    bool bad = false;
    // Every element is read and written by the same thread, so out may alias x or y. The explicit fmaf keeps
    // the rounding identical to the CPU twin's (see kernels/cpu/axpby_cpu.cpp).
    auto combine = [&](float xv, float yv) {
      bad |= (check_x && !isfinite(xv)) || (check_y && !isfinite(yv));
      return from_float<Out>(fmaf(a, xv, b * yv));
    };
    int64_t i = 0;
    if (is_aligned16(x) && is_aligned16(y) && is_aligned16(out)) {
      constexpr int kStep = kStepElements<X, Y, Out>;
      const int64_t n_steps = chunk.num_elements / kStep;
      for (int64_t s = threadIdx.x; s < n_steps; s += blockDim.x) {
        float xs[kStep];
        float ys[kStep];
        load_as_float(x + s * kStep, xs);
        load_as_float(y + s * kStep, ys);
        Out r[kStep];
#pragma unroll
        for (int k = 0; k < kStep; ++k) r[k] = combine(xs[k], ys[k]);
        store_vectors(out + s * kStep, r);
      }
      i = n_steps * kStep;
    }
    for (int64_t j = i + threadIdx.x; j < chunk.num_elements; j += blockDim.x) {
      out[j] = combine(to_float(x[j]), to_float(y[j]));
    }
    // Uniform condition: every thread of the block reaches the barrier or none does.
    if (found_inf != nullptr && __syncthreads_or(bad) && threadIdx.x == 0) *found_inf = 1.0f;
  }
};

}  // namespace

void axpby(const PointerLists<3>& lists, float a, float b, float* found_inf, bool check_x, bool check_y,
           cudaStream_t stream) {
  dispatch_dtype(lists.dtypes[0], [&](auto x_tag) {
    dispatch_dtype(lists.dtypes[1], [&](auto y_tag) {
      dispatch_dtype(lists.dtypes[2], [&](auto out_tag) {
        using X = decltype(x_tag);
        using Y = decltype(y_tag);
        using Out = decltype(out_tag);
        multi_tensor_apply<3>(lists, stream, AxpbyFunctor<X, Y, Out>{}, a, b, found_inf, check_x, check_y);
      });
    });
  });
}

}  // namespace kernels::cuda
