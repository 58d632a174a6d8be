#include <kernels/cpu/scaled_copy_cpu.h>

#include <vector>

#include <kernels/cpu/chunks.h>
#include <kernels/cpu/converting_access.h>
#include <kernels/cpu/nonfinite.h>
#include <kernels/cpu/parallel.h>

// Compiled once per capability (see kernels/cpu/capability.h).
namespace kernels::cpu::CPU_CAPABILITY {
namespace {

/// dst[0, n) = src[0, n) * scale; with kCheck, returns whether any source element or stored result was
/// non-finite (else false).
template <bool kCheck, typename Src, typename Dst>
bool copy_span(const Src* src, Dst* dst, int64_t n, float scale) {
  const fVec s(scale);
  fVec acc(0.0f);
  int64_t i = 0;
  for (; i + kStepElements <= n; i += kStepElements) {
    const auto [x0, x1] = load_as_float(src + i);
    [[maybe_unused]] const auto [y0, y1] = store_from_float<Dst, kCheck>(dst + i, {x0 * s, x1 * s});
    if constexpr (kCheck) {
      acc = accumulate_nonfinite(accumulate_nonfinite(acc, x0), x1);
      acc = accumulate_nonfinite(accumulate_nonfinite(acc, y0), y1);
    }
  }
  bool bad = kCheck && any_nonfinite(acc);
  for (; i < n; ++i) {
    const auto x = static_cast<float>(src[i]);
    dst[i] = static_cast<Dst>(x * scale);
    if constexpr (kCheck) bad |= !std::isfinite(x) || !std::isfinite(static_cast<float>(dst[i]));
  }
  return bad;
}

template <bool kCheck, typename Src, typename Dst>
void copy_lists(const PointerLists<2>& lists, float scale, float* found_inf, int32_t* first_index) {
  const std::vector<CpuChunk> chunks = split_into_chunks(lists);
  std::vector<uint8_t> chunk_bad(chunks.size(), 0);
  ::kernels::cpu::parallel_for(0, static_cast<int64_t>(chunks.size()), 1, [&](int64_t first, int64_t last) {
    for (int64_t c = first; c < last; ++c) {
      const auto& entry = lists.addresses[chunks[c].entry];
      const Src* src = static_cast<const Src*>(entry[0]) + chunks[c].begin;
      Dst* dst = static_cast<Dst*>(entry[1]) + chunks[c].begin;
      chunk_bad[c] = copy_span<kCheck>(src, dst, chunks[c].num_elements, scale);
    }
  });
  if constexpr (kCheck) {
    float unused_flag = 0.0f;  // the caller asked for the index alone
    report_nonfinite(lists, chunks, chunk_bad, found_inf != nullptr ? found_inf : &unused_flag, first_index);
  }
}

}  // namespace

void scaled_copy(const PointerLists<2>& lists, ScalarArg scale, float* found_inf, int32_t* first_index) {
  const float scale_value = scale.device_value != nullptr ? *scale.device_value : scale.value;
  const bool check = found_inf != nullptr || first_index != nullptr;
  dispatch_dtype(lists.dtypes[0], [&](auto src_tag) {
    dispatch_dtype(lists.dtypes[1], [&](auto dst_tag) {
      using Src = decltype(src_tag);
      using Dst = decltype(dst_tag);
      if (check) {
        copy_lists<true, Src, Dst>(lists, scale_value, found_inf, first_index);
      } else {
        copy_lists<false, Src, Dst>(lists, scale_value, found_inf, first_index);
      }
    });
  });
}

}  // namespace kernels::cpu::CPU_CAPABILITY
