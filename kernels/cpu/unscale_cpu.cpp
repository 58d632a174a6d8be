#include <kernels/cpu/unscale_cpu.h>

#include <type_traits>

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <kernels/cpu/chunks.h>
#include <kernels/cpu/nonfinite.h>
#include <kernels/cpu/parallel.h>

// Compiled once per capability (see kernels/cpu/capability.h).
namespace kernels::cpu::CPU_CAPABILITY {
namespace {

using fVec = at::vec::Vectorized<float>;

/// Unscales data[0, n) in place; returns whether any input or stored result was non-finite. With
/// inv_scale <= 1 a finite input cannot overflow (|x * inv| <= |x| and rounding cannot pass a representable
/// |x|), so only inputs are checked; with inv_scale > 1 the stored results are checked as well.
template <typename T, bool kCheckResults>
bool unscale_span(T* data, int64_t n, float inv_scale) {
  const fVec inv(inv_scale);
  fVec acc(0.0f);
  int64_t d = 0;
  if constexpr (std::is_same_v<T, float>) {
    for (; d + fVec::size() <= n; d += fVec::size()) {
      const fVec x = fVec::loadu(data + d);
      const fVec y = x * inv;
      y.store(data + d);
      acc = accumulate_nonfinite(acc, x);
      if constexpr (kCheckResults) acc = accumulate_nonfinite(acc, y);
    }
  } else {
    using bVec = at::vec::Vectorized<T>;
    for (; d + bVec::size() <= n; d += bVec::size()) {
      auto [x0, x1] = at::vec::convert_to_float<T>(bVec::loadu(data + d));
      const bVec stored = at::vec::convert_from_float<T>(x0 * inv, x1 * inv);
      stored.store(data + d);
      acc = accumulate_nonfinite(accumulate_nonfinite(acc, x0), x1);
      if constexpr (kCheckResults) {
        auto [y0, y1] = at::vec::convert_to_float<T>(stored);
        acc = accumulate_nonfinite(accumulate_nonfinite(acc, y0), y1);
      }
    }
  }
  bool bad = any_nonfinite(acc);
  for (; d < n; ++d) {
    const float x = static_cast<float>(data[d]);
    data[d] = static_cast<T>(x * inv_scale);
    bad |= !std::isfinite(x) || !std::isfinite(static_cast<float>(data[d]));
  }
  return bad;
}

template <typename T>
void unscale_lists(const PointerLists<1>& lists, float inv_scale, float* found_inf, int32_t* first_index) {
  const std::vector<CpuChunk> chunks = split_into_chunks(lists);
  std::vector<uint8_t> chunk_bad(chunks.size(), 0);
  const bool check_results = !(inv_scale <= 1.0f);  // NaN inv_scale: check everything
  ::kernels::cpu::parallel_for(0, static_cast<int64_t>(chunks.size()), 1, [&](int64_t first, int64_t last) {
    for (int64_t c = first; c < last; ++c) {
      T* data = static_cast<T*>(lists.addresses[chunks[c].entry][0]) + chunks[c].begin;
      chunk_bad[c] = check_results ? unscale_span<T, true>(data, chunks[c].num_elements, inv_scale)
                                   : unscale_span<T, false>(data, chunks[c].num_elements, inv_scale);
    }
  });
  report_nonfinite(lists, chunks, chunk_bad, found_inf, first_index);
}

}  // namespace

void unscale_and_check(const PointerLists<1>& lists, const float* inv_scale, float* found_inf, int32_t* first_index) {
  switch (lists.dtypes[0]) {
    case DType::kFloat32:
      return unscale_lists<float>(lists, *inv_scale, found_inf, first_index);
    case DType::kFloat16:
      return unscale_lists<c10::Half>(lists, *inv_scale, found_inf, first_index);
    case DType::kBFloat16:
      return unscale_lists<c10::BFloat16>(lists, *inv_scale, found_inf, first_index);
  }
}

}  // namespace kernels::cpu::CPU_CAPABILITY
