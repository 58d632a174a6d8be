#include <kernels/cpu/chunks.h>
#include <kernels/cuda/l2_norm_cuda.h>
#include <kernels/optim/clip_rule.h>
#include <kernels/cuda/multi_tensor_apply.cuh>
#include <kernels/cuda/vector_access.cuh>

namespace kernels::cuda {
namespace {

// kernels/multi_tensor/l2_norm.cpp sizes the slot table with cpu::kChunkElements; the launcher's block_chunk must count
// the same chunks.
static_assert(kChunkElements == cpu::kChunkElements, "CUDA and CPU chunks must match the slot table");

constexpr int kWarpThreads = 32;
constexpr int kBlockWarps = kBlockThreads / kWarpThreads;
constexpr unsigned kFullWarpMask = 0xffffffffu;

/// Sum over the lanes of a warp in a fixed tree order; the result is valid in lane 0.
__device__ __forceinline__ double warp_sum(double value) {
#pragma unroll
  for (int offset = kWarpThreads / 2; offset > 0; offset /= 2) value += __shfl_down_sync(kFullWarpMask, value, offset);
  return value;
}

/// Sum over a block of kBlockThreads threads in a fixed order (warp sums, then the sum of the warp sums by
/// warp 0); valid in thread 0. Every thread of the block must call it, once per kernel.
__device__ double block_sum(double value) {
  __shared__ double warp_sums[kBlockWarps];
  const int lane = static_cast<int>(threadIdx.x) % kWarpThreads;
  const int warp = static_cast<int>(threadIdx.x) / kWarpThreads;
  value = warp_sum(value);
  if (lane == 0) warp_sums[warp] = value;
  __syncthreads();
  value = 0.0;
  if (warp == 0) value = warp_sum(lane < kBlockWarps ? warp_sums[lane] : 0.0);
  return value;
}

template <typename T>
__device__ __forceinline__ float scaled_square(T value, float inv_scale) {
  const float x = to_float(value) * inv_scale;
  return x * x;
}

// Note [alignment-independent sums]
// Each thread's fp32 sum depends on which elements it adds and in which order. Splitting aligned chunks by
// 16-byte vectors and misaligned ones element by element (as transform_chunk may, which is harmless for an
// element-wise op) would give a tensor and an offset view holding the same values different bits. The norm
// therefore uses the vector mapping for both and only chooses how to load.

/// Stage 1: one block per chunk writes the chunk's sum of squares to its own slot (no atomics).
template <typename T>
struct SumOfSquaresFunctor {
  __device__ void operator()(const ChunkTable<1>& table, int block, const int64_t* slot_base,
                             const float* inv_scale_ptr, double* partials) const {
    const Chunk chunk = chunk_of_block(table, block);
    const T* data = static_cast<const T*>(table.addresses[0][chunk.tensor]) + chunk.begin;
    const float inv_scale = inv_scale_ptr != nullptr ? *inv_scale_ptr : 1.0f;
    // One element-to-thread mapping whatever the address (Note [alignment-independent sums]): thread t owns the
    // kVec-element groups t, t + blockDim.x, ... and then the tail elements n_groups * kVec + t, + blockDim.x, ...,
    // and adds their squares in that order. Only the load differs: one 16-byte vector where `data` is aligned,
    // kVec scalar loads where it is not.
    constexpr int kVec = kVectorElements<T>;
    const bool aligned = is_aligned16(data);
    const int64_t n_groups = chunk.num_elements / kVec;
    float acc = 0.0f;
#pragma unroll 4
    for (int64_t v = threadIdx.x; v < n_groups; v += blockDim.x) {
      Vector16<T> x;
      if (aligned) {
        x = reinterpret_cast<const Vector16<T>*>(data)[v];
      } else {
#pragma unroll
        for (int k = 0; k < kVec; ++k) x.values[k] = data[v * kVec + k];
      }
#pragma unroll
      for (int k = 0; k < kVec; ++k) acc += scaled_square(x.values[k], inv_scale);
    }
    for (int64_t j = n_groups * kVec + threadIdx.x; j < chunk.num_elements; j += blockDim.x) {
      acc += scaled_square(data[j], inv_scale);
    }
    const double sum = block_sum(static_cast<double>(acc));
    if (threadIdx.x == 0) partials[slot_base[table.original_index[chunk.tensor]] + table.block_chunk[block]] = sum;
  }
};

/// Stage 2: block 0 sums every slot into the total; blocks 1.. give one warp to each tensor.
__global__ void __launch_bounds__(kBlockThreads)
    reduce_partials_kernel(const double* partials, const int64_t* slot_base, int64_t num_tensors, int64_t num_slots,
                           float* total, float* per_tensor, float* found_inf) {
  if (blockIdx.x == 0) {
    double acc = 0.0;
    for (int64_t s = threadIdx.x; s < num_slots; s += blockDim.x) acc += partials[s];
    const double sum = block_sum(acc);
    if (threadIdx.x == 0) {
      const auto norm = static_cast<float>(sqrt(sum));
      *total = norm;
      if (found_inf != nullptr && !isfinite(norm)) *found_inf = 1.0f;
    }
    return;
  }
  const int64_t tensor = static_cast<int64_t>(blockIdx.x - 1) * kBlockWarps + threadIdx.x / kWarpThreads;
  if (tensor >= num_tensors) return;  // the whole warp leaves together
  const int lane = static_cast<int>(threadIdx.x) % kWarpThreads;
  double acc = 0.0;
  for (int64_t s = slot_base[tensor] + lane; s < slot_base[tensor + 1]; s += kWarpThreads) acc += partials[s];
  acc = warp_sum(acc);
  if (lane == 0) per_tensor[tensor] = static_cast<float>(sqrt(acc));
}

template <typename T>
struct ClipFunctor {
  __device__ void operator()(const ChunkTable<1>& table, int block, const float* total_norm, float max_norm) const {
    const float coef = clip_coefficient(*total_norm, max_norm);
    if (coef == 1.0f) return;  // the same value in every thread: the whole block leaves
    const Chunk chunk = chunk_of_block(table, block);
    T* data = static_cast<T*>(table.addresses[0][chunk.tensor]) + chunk.begin;
    transform_chunk(data, chunk.num_elements, [coef](T v) { return from_float<T>(to_float(v) * coef); });
  }
};

/// The slot table travels in the kernel parameters: a captured launch replays with these values and reads no host
/// memory (a copy from a pinned buffer would re-read it at replay, after it was freed).
struct SlotTableSegment {
  static constexpr int64_t kMaxValues =
      (kKernelParamBytes - kReservedParamBytes) / static_cast<int64_t>(sizeof(int64_t)) - 2;
  int64_t first;
  int64_t count;
  int64_t values[kMaxValues];
};
static_assert(sizeof(SlotTableSegment) + kReservedParamBytes <= kKernelParamBytes,
              "slot table segment exceeds the kernel parameter space");

__global__ void __launch_bounds__(kBlockThreads)
    write_slot_table_kernel(const __grid_constant__ SlotTableSegment segment, int64_t* slot_base) {
  for (int64_t i = threadIdx.x; i < segment.count; i += blockDim.x) slot_base[segment.first + i] = segment.values[i];
}

}  // namespace

void write_slot_table(const int64_t* host_table, int64_t num_entries, int64_t* slot_base, cudaStream_t stream) {
  constexpr int64_t kValuesPerLaunch = SlotTableSegment::kMaxValues;
  SlotTableSegment segment;
  for (int64_t first = 0; first < num_entries; first += kValuesPerLaunch) {
    segment.first = first;
    segment.count = num_entries - first < kValuesPerLaunch ? num_entries - first : kValuesPerLaunch;
    for (int64_t i = 0; i < segment.count; ++i) segment.values[i] = host_table[first + i];
    write_slot_table_kernel<<<1, kBlockThreads, 0, stream>>>(segment, slot_base);
    LTA_CUDA_CHECK_LAUNCH("write_slot_table_kernel");
  }
}

void l2_norm_partials(const PointerLists<1>& lists, const int64_t* slot_base, const float* inv_scale, double* partials,
                      cudaStream_t stream) {
  dispatch_dtype(lists.dtypes[0], [&](auto tag) {
    using T = decltype(tag);
    multi_tensor_apply<1>(lists, stream, SumOfSquaresFunctor<T>{}, slot_base, inv_scale, partials);
  });
}

void l2_norm_reduce(const double* partials, const int64_t* slot_base, int64_t num_tensors, int64_t num_slots,
                    float* total, float* per_tensor, float* found_inf, cudaStream_t stream) {
  const int64_t tensor_blocks = per_tensor != nullptr ? (num_tensors + kBlockWarps - 1) / kBlockWarps : 0;
  reduce_partials_kernel<<<static_cast<unsigned>(1 + tensor_blocks), kBlockThreads, 0, stream>>>(
      partials, slot_base, num_tensors, num_slots, total, per_tensor, found_inf);
  LTA_CUDA_CHECK_LAUNCH("reduce_partials_kernel");
}

void clip_by_norm(const PointerLists<1>& lists, const float* total_norm, float max_norm, cudaStream_t stream) {
  dispatch_dtype(lists.dtypes[0], [&](auto tag) {
    using T = decltype(tag);
    multi_tensor_apply<1>(lists, stream, ClipFunctor<T>{}, total_norm, max_norm);
  });
}

}  // namespace kernels::cuda
