#pragma once

// The multi-tensor launcher: applies a functor to every chunk of every tensor of `kDepth` parallel lists, one
// thread block per chunk, with tensor addresses and int64 sizes passed by value in the kernel parameters.
//
// Note [kernel parameter space]
// CUDA 12.1+ on sm_70+ allows 32,764 bytes of kernel parameters (4,096 before). ATen's multi_tensor_apply
// still sizes its tables for 4 KB (110 tensors / 320 blocks at depth 1), so a model with thousands of small
// tensors needs tens of launches; with the 32 KB table we need several times fewer. CUDA 13 supports only
// sm_75+, so the large table is always usable when CUDART_VERSION >= 12010; older toolkits get 4 KB.

#include <cstdint>
#include <cstring>

#include <cuda_runtime.h>

#include <kernels/cuda/check.h>
#include <kernels/pointer_lists.h>

namespace kernels::cuda {

/// Elements handled by one thread block.
constexpr int64_t kChunkElements = 65536;
/// Threads per block of every multi-tensor kernel.
constexpr int kBlockThreads = 512;

#if defined(CUDART_VERSION) && CUDART_VERSION >= 12010
constexpr int64_t kKernelParamBytes = 32764;
constexpr int kMaxBlocksPerLaunch = 2048;
#else
constexpr int64_t kKernelParamBytes = 4096;
constexpr int kMaxBlocksPerLaunch = 320;
#endif
/// Room left in the parameter space for the functor and its scalar arguments.
constexpr int64_t kReservedParamBytes = 256;

/// Tensors one launch can address for `kDepth` lists: each costs kDepth addresses, its size and its index.
template <int kDepth>
constexpr int max_tensors_per_launch() {
  constexpr int64_t block_bytes = kMaxBlocksPerLaunch * (sizeof(uint16_t) + sizeof(int32_t));
  constexpr int64_t per_tensor = kDepth * sizeof(void*) + sizeof(int64_t) + sizeof(int32_t);
  constexpr int64_t alignment_slack = 8;
  return static_cast<int>((kKernelParamBytes - kReservedParamBytes - block_bytes - alignment_slack) / per_tensor);
}

/// What one launch sees: the tensors it touches and, for each block, which tensor and chunk it owns.
template <int kDepth>
struct ChunkTable {
  static constexpr int kMaxTensors = max_tensors_per_launch<kDepth>();
  static_assert(kMaxTensors > 0 && kMaxTensors < 65536, "block_tensor is uint16_t");
  void* addresses[kDepth][kMaxTensors];
  int64_t num_elements[kMaxTensors];
  /// Index of each tensor in the caller's original list (for reporting which tensor held what).
  int32_t original_index[kMaxTensors];
  uint16_t block_tensor[kMaxBlocksPerLaunch];
  int32_t block_chunk[kMaxBlocksPerLaunch];
};

/// The piece of a tensor that one block owns.
struct Chunk {
  int tensor;            // slot in the ChunkTable
  int64_t begin;         // first element of the chunk within the tensor
  int64_t num_elements;  // elements in this chunk (<= kChunkElements)
};

template <int kDepth>
__device__ __forceinline__ Chunk chunk_of_block(const ChunkTable<kDepth>& table, int block) {
  const int tensor = table.block_tensor[block];
  const int64_t begin = static_cast<int64_t>(table.block_chunk[block]) * kChunkElements;
  const int64_t remaining = table.num_elements[tensor] - begin;
  return Chunk{tensor, begin, remaining < kChunkElements ? remaining : kChunkElements};
}

template <int kDepth, typename Functor, typename... Args>
__global__ void __launch_bounds__(kBlockThreads)
    multi_tensor_kernel(const __grid_constant__ ChunkTable<kDepth> table, Functor functor, Args... args) {
  functor(table, static_cast<int>(blockIdx.x), args...);
}

/// Runs `functor(table, block, args...)` over every chunk of `lists` on `stream`. Empty tensors are skipped;
/// an empty list launches nothing. Never synchronizes with the host. Throws on a launch error.
template <int kDepth, typename Functor, typename... Args>
void multi_tensor_apply(const PointerLists<kDepth>& lists, cudaStream_t stream, Functor functor, Args... args) {
  using Table = ChunkTable<kDepth>;
  static_assert(sizeof(Table) + kReservedParamBytes <= kKernelParamBytes, "chunk table exceeds parameter space");
  Table table;
  int n_tensors = 0;
  int n_blocks = 0;
  auto launch = [&] {
    multi_tensor_kernel<kDepth><<<n_blocks, kBlockThreads, 0, stream>>>(table, functor, args...);
    LTA_CUDA_CHECK_LAUNCH("multi_tensor_kernel");
    n_blocks = 0;
  };
  for (int64_t t = 0; t < lists.size(); ++t) {
    const int64_t numel = lists.num_elements[t];
    if (numel == 0) continue;
    for (int d = 0; d < kDepth; ++d) table.addresses[d][n_tensors] = lists.addresses[t][d];
    table.num_elements[n_tensors] = numel;
    table.original_index[n_tensors] = static_cast<int32_t>(lists.original_index.empty() ? t : lists.original_index[t]);
    const int64_t n_chunks = (numel + kChunkElements - 1) / kChunkElements;
    for (int64_t c = 0; c < n_chunks; ++c) {
      table.block_tensor[n_blocks] = static_cast<uint16_t>(n_tensors);
      table.block_chunk[n_blocks] = static_cast<int32_t>(c);
      ++n_blocks;
      const bool tensor_done = c == n_chunks - 1;
      const bool blocks_full = n_blocks == kMaxBlocksPerLaunch;
      const bool tensors_full = tensor_done && n_tensors + 1 == Table::kMaxTensors;
      if (blocks_full || tensors_full) {
        launch();
        if (tensor_done) {
          n_tensors = -1;
        } else {  // the tensor goes on in the next launch: it becomes slot 0
          for (int d = 0; d < kDepth; ++d) table.addresses[d][0] = table.addresses[d][n_tensors];
          table.num_elements[0] = table.num_elements[n_tensors];
          table.original_index[0] = table.original_index[n_tensors];
          n_tensors = 0;
        }
      }
    }
    ++n_tensors;
  }
  if (n_blocks > 0) launch();
}

}  // namespace kernels::cuda
