#include <kernels/cpu/axpby_cpu.h>

#include <cmath>
#include <vector>

#include <kernels/cpu/chunks.h>
#include <kernels/cpu/converting_access.h>
#include <kernels/cpu/nonfinite.h>
#include <kernels/cpu/parallel.h>

// Compiled once per capability (see kernels/cpu/capability.h).
namespace kernels::cpu::CPU_CAPABILITY {
namespace {

// Note [axpby rounding]
// out = fma(a, x, b*y): one rounding of b*y, one of the fused multiply-add, identical on CUDA (fmaf) and here,
// so the twins agree bit for bit. at::vec::fmadd is a true FMA on AVX2/AVX512 but a*b+c (two roundings) in the
// generic DEFAULT implementation, so that build fuses lane by lane with std::fma instead.
inline fVec fused_multiply_add(const fVec& a, const fVec& x, const fVec& c) {
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
  return at::vec::fmadd(a, x, c);
#else
  float as[fVec::size()];
  float xs[fVec::size()];
  float cs[fVec::size()];
  a.store(as);
  x.store(xs);
  c.store(cs);
  for (int k = 0; k < fVec::size(); ++k) cs[k] = std::fma(as[k], xs[k], cs[k]);
  return fVec::loadu(cs);
#endif
}

/// out[0, n) = a*x + b*y; returns whether a checked input held an inf or NaN.
template <typename X, typename Y, typename Out>
bool axpby_span(const X* x, const Y* y, Out* out, int64_t n, float a, float b, bool check_x, bool check_y) {
  const fVec va(a);
  const fVec vb(b);
  // Both inputs are accumulated (branch-free loop); check_x / check_y decide which accumulator counts.
  fVec acc_x(0.0f);
  fVec acc_y(0.0f);
  int64_t i = 0;
  for (; i + kStepElements <= n; i += kStepElements) {
    const auto [x0, x1] = load_as_float(x + i);
    const auto [y0, y1] = load_as_float(y + i);
    store_from_float<Out, false>(out + i, {fused_multiply_add(va, x0, vb * y0), fused_multiply_add(va, x1, vb * y1)});
    acc_x = accumulate_nonfinite(accumulate_nonfinite(acc_x, x0), x1);
    acc_y = accumulate_nonfinite(accumulate_nonfinite(acc_y, y0), y1);
  }
  bool bad = (check_x && any_nonfinite(acc_x)) || (check_y && any_nonfinite(acc_y));
  for (; i < n; ++i) {
    const auto xv = static_cast<float>(x[i]);
    const auto yv = static_cast<float>(y[i]);
    bad |= (check_x && !std::isfinite(xv)) || (check_y && !std::isfinite(yv));
    out[i] = static_cast<Out>(std::fma(a, xv, b * yv));
  }
  return bad;
}

template <typename X, typename Y, typename Out>
void axpby_lists(const PointerLists<3>& lists, float a, float b, float* found_inf, bool check_x, bool check_y) {
  const std::vector<CpuChunk> chunks = split_into_chunks(lists);
  std::vector<uint8_t> chunk_bad(chunks.size(), 0);
  ::kernels::cpu::parallel_for(0, static_cast<int64_t>(chunks.size()), 1, [&](int64_t first, int64_t last) {
    for (int64_t c = first; c < last; ++c) {
      const auto& entry = lists.addresses[chunks[c].entry];
      const int64_t begin = chunks[c].begin;
      chunk_bad[c] = axpby_span(static_cast<const X*>(entry[0]) + begin, static_cast<const Y*>(entry[1]) + begin,
                                static_cast<Out*>(entry[2]) + begin, chunks[c].num_elements, a, b, check_x, check_y);
    }
  });
  if (found_inf != nullptr) report_nonfinite(lists, chunks, chunk_bad, found_inf, nullptr);
}

}  // namespace

void axpby(const PointerLists<3>& lists, float a, float b, float* found_inf, bool check_x, bool check_y) {
  dispatch_dtype(lists.dtypes[0], [&](auto x_tag) {
    dispatch_dtype(lists.dtypes[1], [&](auto y_tag) {
      dispatch_dtype(lists.dtypes[2], [&](auto out_tag) {
        axpby_lists<decltype(x_tag), decltype(y_tag), decltype(out_tag)>(lists, a, b, found_inf, check_x, check_y);
      });
    });
  });
}

}  // namespace kernels::cpu::CPU_CAPABILITY
