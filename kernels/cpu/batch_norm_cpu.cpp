#include <kernels/cpu/batch_norm_cpu.h>

#include <algorithm>

#include <kernels/cpu/converting_access.h>
#include <kernels/cpu/parallel.h>

// Compiled once per capability (see kernels/cpu/capability.h). Values are read as fp32 vectors (fp16 / bf16
// converted exactly) and results rounded once to the tensor's dtype.
namespace kernels::cpu::CPU_CAPABILITY {
namespace {

// Note [batch-norm twin sums]
// Each (sample, channel) run is summed in chunks of kChunk elements; inside a chunk, kStepElements fp32 lanes
// (16 with AVX2 and the generic build, 32 with AVX512) each add at most kChunk / kStepElements terms, and the
// lanes and the chunks are then added in fp64. A lane's error is at most 16 fp32 ulps of the sum of its |terms|
// (about 1e-6 relative), so the sum is within that of the sum of all |terms|, and usually far closer. The last
// bits depend on the instruction set (the number of lanes), as with ATen's own kernels.
constexpr int64_t kChunk = 512;
static_assert(kChunk % kStepElements == 0, "a chunk must hold whole vector steps");

/// The fp64 total of `sum` lanes.
double lanes_total(const FloatPair& sum) {
  float lanes[kStepElements];
  sum.first.store(lanes);
  sum.second.store(lanes + fVec::size());
  double total = 0;
  for (const float v : lanes) total += v;
  return total;
}

/// Sum over n elements of term(vector pair at i) in vector steps, and of scalar_term(i) for the tail, as the Note.
template <typename VectorTerm, typename ScalarTerm>
double run_sum(int64_t n, const VectorTerm& vector_term, const ScalarTerm& scalar_term) {
  double total = 0;
  int64_t i = 0;
  for (; i + kStepElements <= n;) {
    const int64_t end = std::min(n - (n - i) % kStepElements, i + kChunk);
    FloatPair sum{fVec(0.0f), fVec(0.0f)};
    for (; i < end; i += kStepElements) {
      const FloatPair t = vector_term(i);
      sum.first = sum.first + t.first;
      sum.second = sum.second + t.second;
    }
    total += lanes_total(sum);
  }
  for (; i < n; ++i) total += scalar_term(i);
  return total;
}

/// Runs fn(c) for every channel, in parallel.
template <typename Fn>
void for_each_channel(int64_t channels, const Fn& fn) {
  ::kernels::cpu::parallel_for(0, channels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) fn(c);
  });
}

/// Runs fn(run, channel) over the samples * channels runs, in parallel (about 32 Ki elements per task).
template <typename Fn>
void for_each_run(const ChannelLayout& l, const Fn& fn) {
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 15) / std::max<int64_t>(l.inner, 1));
  ::kernels::cpu::parallel_for(0, l.samples * l.channels, grain, [&](int64_t begin, int64_t end) {
    for (int64_t run = begin; run < end; ++run) fn(run, run % l.channels);
  });
}

template <typename T>
void stats(const T* x, ChannelLayout l, double* mean, double* var) {
  const auto count = static_cast<double>(l.samples * l.inner);
  for_each_channel(l.channels, [&](int64_t c) {
    double sum = 0;
    for (int64_t s = 0; s < l.samples; ++s) {
      const T* run = x + (s * l.channels + c) * l.inner;
      sum += run_sum(
          l.inner, [run](int64_t i) { return load_as_float(run + i); },
          [run](int64_t i) { return static_cast<double>(static_cast<float>(run[i])); });
    }
    const double mu = sum / count;
    const auto shift = static_cast<float>(mu);
    const fVec vshift(shift);
    double squares = 0;
    for (int64_t s = 0; s < l.samples; ++s) {
      const T* run = x + (s * l.channels + c) * l.inner;
      squares += run_sum(
          l.inner,
          [run, &vshift](int64_t i) {
            const auto [lo, hi] = load_as_float(run + i);
            const fVec dlo = lo - vshift;
            const fVec dhi = hi - vshift;
            return FloatPair{dlo * dlo, dhi * dhi};
          },
          [run, shift](int64_t i) {
            const float d = static_cast<float>(run[i]) - shift;
            return static_cast<double>(d * d);
          });
    }
    mean[c] = mu;
    var[c] = squares / count;
  });
}

template <typename T>
void grad_sums(const T* dy, const T* x, ChannelLayout l, const float* mean, double* sum_dy, double* sum_dy_xmu) {
  for_each_channel(l.channels, [&](int64_t c) {
    const float m = mean[c];
    const fVec vm(m);
    double s_dy = 0;
    double s_dy_xmu = 0;
    for (int64_t s = 0; s < l.samples; ++s) {
      const T* dr = dy + (s * l.channels + c) * l.inner;
      const T* xr = x + (s * l.channels + c) * l.inner;
      s_dy += run_sum(
          l.inner, [dr](int64_t i) { return load_as_float(dr + i); },
          [dr](int64_t i) { return static_cast<double>(static_cast<float>(dr[i])); });
      s_dy_xmu += run_sum(
          l.inner,
          [dr, xr, &vm](int64_t i) {
            const auto [dlo, dhi] = load_as_float(dr + i);
            const auto [xlo, xhi] = load_as_float(xr + i);
            return FloatPair{dlo * (xlo - vm), dhi * (xhi - vm)};
          },
          [dr, xr, m](int64_t i) {
            return static_cast<double>(static_cast<float>(dr[i]) * (static_cast<float>(xr[i]) - m));
          });
    }
    sum_dy[c] = s_dy;
    sum_dy_xmu[c] = s_dy_xmu;
  });
}

template <typename T>
void normalize(const T* x, T* y, ChannelLayout l, const float* mean, const float* scale, const float* shift) {
  for_each_run(l, [&](int64_t run, int64_t c) {
    const float m = mean[c];
    const float sc = scale[c];
    const float sh = shift != nullptr ? shift[c] : 0.0f;
    const fVec vm(m);
    const fVec vs(sc);
    const fVec vh(sh);
    const T* xr = x + run * l.inner;
    T* yr = y + run * l.inner;
    int64_t i = 0;
    for (; i + kStepElements <= l.inner; i += kStepElements) {
      const auto [lo, hi] = load_as_float(xr + i);
      store_from_float<T, false>(yr + i, {(lo - vm) * vs + vh, (hi - vm) * vs + vh});
    }
    for (; i < l.inner; ++i) yr[i] = static_cast<T>((static_cast<float>(xr[i]) - m) * sc + sh);
  });
}

template <typename T>
void input_grad(const T* dy, const T* x, T* dx, ChannelLayout l, const float* mean, const float* mean_dy,
                const float* k, const float* scale) {
  for_each_run(l, [&](int64_t run, int64_t c) {
    const float m = mean[c];
    const float md = mean_dy[c];
    const float kc = k[c];
    const float sc = scale[c];
    const fVec vm(m);
    const fVec vmd(md);
    const fVec vk(kc);
    const fVec vs(sc);
    const T* dr = dy + run * l.inner;
    const T* xr = x + run * l.inner;
    T* out = dx + run * l.inner;
    int64_t i = 0;
    for (; i + kStepElements <= l.inner; i += kStepElements) {
      const auto [dlo, dhi] = load_as_float(dr + i);
      const auto [xlo, xhi] = load_as_float(xr + i);
      store_from_float<T, false>(out + i, {(dlo - vmd - (xlo - vm) * vk) * vs, (dhi - vmd - (xhi - vm) * vk) * vs});
    }
    for (; i < l.inner; ++i) {
      out[i] = static_cast<T>((static_cast<float>(dr[i]) - md - (static_cast<float>(xr[i]) - m) * kc) * sc);
    }
  });
}

}  // namespace

void batch_norm_stats(const void* x, DType dtype, ChannelLayout layout, double* mean, double* var) {
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    stats(static_cast<const T*>(x), layout, mean, var);
  });
}

void batch_norm_grad_sums(const void* dy, const void* x, DType dtype, ChannelLayout layout, const float* mean,
                          double* sum_dy, double* sum_dy_xmu) {
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    grad_sums(static_cast<const T*>(dy), static_cast<const T*>(x), layout, mean, sum_dy, sum_dy_xmu);
  });
}

void batch_norm_normalize(const void* x, void* y, DType dtype, ChannelLayout layout, const float* mean,
                          const float* scale, const float* shift) {
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    normalize(static_cast<const T*>(x), static_cast<T*>(y), layout, mean, scale, shift);
  });
}

void batch_norm_input_grad(const void* dy, const void* x, void* dx, DType dtype, ChannelLayout layout,
                           const float* mean, const float* mean_dy, const float* k, const float* scale) {
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    input_grad(static_cast<const T*>(dy), static_cast<const T*>(x), static_cast<T*>(dx), layout, mean, mean_dy, k,
               scale);
  });
}

}  // namespace kernels::cpu::CPU_CAPABILITY
