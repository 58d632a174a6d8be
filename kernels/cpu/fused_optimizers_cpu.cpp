#include <kernels/cpu/fused_optimizers_cpu.h>

#include <kernels/cpu/dispatch_dtype.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include <ATen/cpu/vec/functional.h>  // convert_to_float / convert_from_float specializations
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <kernels/cpu/chunks.h>
#include <kernels/cpu/parallel.h>

// GCC 12 reports -Wuninitialized inside its own avx512fintrin.h when at::vec's AVX512 sqrt and maximum are
// inlined (_mm512_undefined_ps is uninitialized by design): the false positive the build already silences
// as -Wmaybe-uninitialized for AVX512 twins.
#if defined(CPU_CAPABILITY_AVX512) && defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

// Compiled once per capability (see kernels/cpu/capability.h).
namespace kernels::cpu::CPU_CAPABILITY {
namespace {

using fVec = at::vec::Vectorized<float>;
constexpr int64_t kHalfBlock = fVec::size();
/// Elements per iteration: two fp32 vectors, which is exactly one vector of a 16-bit dtype, so every list of
/// the mixed-dtype step is loaded with whole vectors.
constexpr int64_t kBlock = 2 * kHalfBlock;

struct VecMath {
  static fVec sqrt(const fVec& x) { return x.sqrt(); }
  static fVec max(const fVec& a, const fVec& b) { return at::vec::maximum(a, b); }  // propagates NaN
};

/// Loads `count` (<= kBlock) elements widened to fp32; lanes past `count` are zero (at::vec's partial loadu).
template <typename T>
inline void load_block(const T* src, int64_t count, fVec (&out)[2]) {
  if constexpr (std::is_same_v<T, float>) {
    out[0] = fVec::loadu(src, std::min(count, kHalfBlock));
    out[1] = count > kHalfBlock ? fVec::loadu(src + kHalfBlock, count - kHalfBlock) : fVec(0.0f);
  } else {
    using TVec = at::vec::Vectorized<T>;
    static_assert(TVec::size() == kBlock, "a 16-bit vector must hold two fp32 vectors");
    auto [lo, hi] = at::vec::convert_to_float<T>(TVec::loadu(src, count));
    out[0] = lo;
    out[1] = hi;
  }
}

/// Stores the first `count` (<= kBlock) lanes, rounded to T.
template <typename T>
inline void store_block(T* dst, int64_t count, const fVec (&in)[2]) {
  if constexpr (std::is_same_v<T, float>) {
    in[0].store(dst, std::min(count, kHalfBlock));
    if (count > kHalfBlock) in[1].store(dst + kHalfBlock, count - kHalfBlock);
  } else {
    at::vec::convert_from_float<T>(in[0], in[1]).store(dst, count);
  }
}

template <typename TParam, typename TGrad, bool kAmsgrad, bool kMaster>
void adam_span(const AdamCoefficients& c, TParam* param, const TGrad* grad, float* exp_avg, float* exp_avg_sq,
               float* max_exp_avg_sq, float* master, int64_t n) {
  for (int64_t i = 0; i < n; i += kBlock) {
    const int64_t count = std::min(kBlock, n - i);
    fVec p[2], g[2], m[2], v[2], v_max[2] = {fVec(0.0f), fVec(0.0f)};
    if constexpr (kMaster) {
      load_block(master + i, count, p);
    } else {
      load_block(param + i, count, p);
    }
    load_block(grad + i, count, g);
    load_block(exp_avg + i, count, m);
    load_block(exp_avg_sq + i, count, v);
    if constexpr (kAmsgrad) load_block(max_exp_avg_sq + i, count, v_max);
    for (int h = 0; h < 2; ++h) adam_update<kAmsgrad, VecMath>(c, p[h], g[h], m[h], v[h], v_max[h]);
    store_block(exp_avg + i, count, m);
    store_block(exp_avg_sq + i, count, v);
    if constexpr (kAmsgrad) store_block(max_exp_avg_sq + i, count, v_max);
    if constexpr (kMaster) store_block(master + i, count, p);
    store_block(param + i, count, p);
  }
}

template <typename TParam, typename TGrad, bool kMomentum, bool kMaster>
void sgd_span(const SgdCoefficients& c, TParam* param, const TGrad* grad, float* momentum_buffer, float* master,
              int64_t n) {
  for (int64_t i = 0; i < n; i += kBlock) {
    const int64_t count = std::min(kBlock, n - i);
    fVec p[2], g[2], buf[2] = {fVec(0.0f), fVec(0.0f)};
    if constexpr (kMaster) {
      load_block(master + i, count, p);
    } else {
      load_block(param + i, count, p);
    }
    load_block(grad + i, count, g);
    // On the parameter's first step the buffer is overwritten with the gradient: its contents are never read.
    if constexpr (kMomentum) {
      if (!c.first_step) load_block(momentum_buffer + i, count, buf);
    }
    for (int h = 0; h < 2; ++h) sgd_update<kMomentum>(c, p[h], g[h], buf[h]);
    if constexpr (kMomentum) store_block(momentum_buffer + i, count, buf);
    if constexpr (kMaster) store_block(master + i, count, p);
    store_block(param + i, count, p);
  }
}

/// Cuts every tensor of `lists` into chunks of kChunkElements (kernels/cpu/chunks.h: fixed by the data, not by
/// the thread count), spreads the chunks over the threads and calls span(entry, first element, element count) for
/// each. Every vector block then starts at the same offset from its tensor's start for any thread count. That is
/// what keeps the results bit-identical: an element's bits can depend on where in a block it sits (a block is two
/// fp32 vectors, each compiled on its own), and the split used before issue 44 (all elements cut into equal parts,
/// one per thread) moved the blocks with the thread count: at 2 threads it changed about one element in eight of a
/// tensor that straddled the cut by an ulp (CpuThreadsTest).
template <int kDepth, typename SpanFn>
void parallel_over_elements(const PointerLists<kDepth>& lists, const SpanFn& span) {
  const std::vector<CpuChunk> chunks = split_into_chunks(lists);
  ::kernels::cpu::parallel_for(0, static_cast<int64_t>(chunks.size()), 1, [&](int64_t first, int64_t last) {
    for (int64_t c = first; c < last; ++c) span(chunks[c].entry, chunks[c].begin, chunks[c].num_elements);
  });
}

using ::kernels::cpu::dispatch_dtype;

template <bool kAmsgrad, bool kMaster, int kDepth>
void adam_lists(const PointerLists<kDepth>& lists, const AdamArgs& args) {
  static_assert(kDepth == 5 + kAmsgrad + kMaster, "list depth and layout disagree");
  if (skip_step(args.found_inf)) return;
  dispatch_dtype(lists.dtypes[0], [&](auto param_tag) {
    dispatch_dtype(lists.dtypes[1], [&](auto grad_tag) {
      using TParam = decltype(param_tag);
      using TGrad = decltype(grad_tag);
      parallel_over_elements(lists, [&](int64_t t, int64_t begin, int64_t n) {
        const auto& a = lists.addresses[t];
        // The tensor's own step count (the last list), read, not written: bias corrections are per parameter.
        const AdamCoefficients c = adam_coefficients(args, static_cast<const float*>(a[kDepth - 1]));
        float* max_exp_avg_sq = nullptr;
        float* master = nullptr;
        if constexpr (kAmsgrad) max_exp_avg_sq = static_cast<float*>(a[4]) + begin;
        if constexpr (kMaster) master = static_cast<float*>(a[4 + kAmsgrad]) + begin;
        adam_span<TParam, TGrad, kAmsgrad, kMaster>(
            c, static_cast<TParam*>(a[0]) + begin, static_cast<const TGrad*>(a[1]) + begin,
            static_cast<float*>(a[2]) + begin, static_cast<float*>(a[3]) + begin, max_exp_avg_sq, master, n);
      });
    });
  });
}

template <bool kMomentum, bool kMaster, int kDepth>
void sgd_lists(const PointerLists<kDepth>& lists, const SgdArgs& args) {
  static_assert(kDepth == 2 + 2 * kMomentum + kMaster, "list depth and layout disagree");
  if (skip_step(args.found_inf)) return;
  dispatch_dtype(lists.dtypes[0], [&](auto param_tag) {
    dispatch_dtype(lists.dtypes[1], [&](auto grad_tag) {
      using TParam = decltype(param_tag);
      using TGrad = decltype(grad_tag);
      parallel_over_elements(lists, [&](int64_t t, int64_t begin, int64_t n) {
        const auto& a = lists.addresses[t];
        float* momentum_buffer = nullptr;
        float* master = nullptr;
        const float* step = nullptr;  // with momentum, the tensor's own step count (the last list)
        if constexpr (kMomentum) {
          momentum_buffer = static_cast<float*>(a[2]) + begin;
          step = static_cast<const float*>(a[kDepth - 1]);
        }
        if constexpr (kMaster) master = static_cast<float*>(a[2 + kMomentum]) + begin;
        sgd_span<TParam, TGrad, kMomentum, kMaster>(sgd_coefficients(args, step), static_cast<TParam*>(a[0]) + begin,
                                                    static_cast<const TGrad*>(a[1]) + begin, momentum_buffer, master,
                                                    n);
      });
    });
  });
}

}  // namespace

void fused_adam(const PointerLists<5>& lists, const AdamArgs& args) { adam_lists<false, false>(lists, args); }

void fused_adam(const PointerLists<6>& lists, const AdamArgs& args) {
  if (args.amsgrad) {
    adam_lists<true, false>(lists, args);
  } else {
    adam_lists<false, true>(lists, args);
  }
}

void fused_adam(const PointerLists<7>& lists, const AdamArgs& args) { adam_lists<true, true>(lists, args); }

void fused_sgd(const PointerLists<2>& lists, const SgdArgs& args) { sgd_lists<false, false>(lists, args); }

void fused_sgd(const PointerLists<3>& lists, const SgdArgs& args) { sgd_lists<false, true>(lists, args); }

void fused_sgd(const PointerLists<4>& lists, const SgdArgs& args) { sgd_lists<true, false>(lists, args); }

void fused_sgd(const PointerLists<5>& lists, const SgdArgs& args) { sgd_lists<true, true>(lists, args); }

}  // namespace kernels::cpu::CPU_CAPABILITY
