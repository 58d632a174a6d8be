#pragma once

// Helpers for CPU twins that check for inf/NaN: x - x is 0 for finite x and NaN otherwise, so summing it
// into an accumulator vector and testing the accumulator once per chunk keeps the hot loop branch-free.
// Include only from sources compiled per capability (it uses at::vec).

#include <cmath>
#include <cstdint>
#include <vector>

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <kernels/cpu/chunks.h>

namespace kernels::cpu::CPU_CAPABILITY {

/// Adds (v - v) to acc: acc turns NaN once v held an inf or NaN.
inline at::vec::Vectorized<float> accumulate_nonfinite(const at::vec::Vectorized<float>& acc,
                                                       const at::vec::Vectorized<float>& v) {
  return acc + (v - v);
}

/// True when any lane of acc is NaN, i.e. a non-finite value was accumulated.
inline bool any_nonfinite(const at::vec::Vectorized<float>& acc) {
  float lanes[at::vec::Vectorized<float>::size()];
  acc.store(lanes);
  bool bad = false;
  for (float lane : lanes) bad |= std::isnan(lane);
  return bad;
}

/// After a parallel pass that flagged chunks, sets *found_inf and lowers *first_index (if given) to the
/// smallest original index among flagged chunks. Runs on the calling thread.
template <int kDepth>
void report_nonfinite(const PointerLists<kDepth>& lists, const std::vector<CpuChunk>& chunks,
                      const std::vector<uint8_t>& chunk_bad, float* found_inf, int32_t* first_index) {
  for (size_t c = 0; c < chunks.size(); ++c) {
    if (!chunk_bad[c]) continue;
    *found_inf = 1.0f;
    if (first_index == nullptr) return;
    const auto index = static_cast<int32_t>(lists.original_index[chunks[c].entry]);
    if (index < *first_index) *first_index = index;
    return;  // chunks are in list order: the first flagged one has the smallest index of this group
  }
}

}  // namespace kernels::cpu::CPU_CAPABILITY
