#pragma once

#include <cstdint>
#include <vector>

#include <kernels/pointer_lists.h>

namespace kernels::cpu {

/// Elements one CPU task handles: the same chunking as the CUDA launcher, so thousands of tiny tensors and
/// a few huge ones both spread over the threads of at::parallel_for.
constexpr int64_t kChunkElements = 65536;

struct CpuChunk {
  int64_t entry;  // index into the PointerLists
  int64_t begin;  // first element of the chunk
  int64_t num_elements;
};

/// Splits every non-empty entry of `lists` into chunks of at most kChunkElements elements.
template <int kDepth>
std::vector<CpuChunk> split_into_chunks(const PointerLists<kDepth>& lists) {
  std::vector<CpuChunk> chunks;
  for (int64_t t = 0; t < lists.size(); ++t) {
    const int64_t n = lists.num_elements[t];
    for (int64_t begin = 0; begin < n; begin += kChunkElements) {
      chunks.push_back({t, begin, n - begin < kChunkElements ? n - begin : kChunkElements});
    }
  }
  return chunks;
}

}  // namespace kernels::cpu
