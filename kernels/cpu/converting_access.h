#pragma once

// Mixed-dtype access for CPU twins whose lists have different dtypes (e.g. read fp16, write fp32): one step
// handles kStepElements elements, one Vectorized<Half/BFloat16> or two Vectorized<float>, always as a pair of
// fp32 vectors. Include only from sources compiled per capability (it uses at::vec).

#include <cmath>
#include <cstdint>
#include <type_traits>
#include <utility>

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <kernels/cpu/dispatch_dtype.h>
#include <kernels/dtype.h>

namespace kernels::cpu::CPU_CAPABILITY {

using fVec = at::vec::Vectorized<float>;
using FloatPair = std::pair<fVec, fVec>;

/// Elements per vector step: two fp32 vectors, which is exactly one vector of a 2-byte dtype.
constexpr int64_t kStepElements = 2 * fVec::size();
static_assert(at::vec::Vectorized<c10::Half>::size() == kStepElements &&
                  at::vec::Vectorized<c10::BFloat16>::size() == kStepElements,
              "a 2-byte vector must hold two fp32 vectors' worth of elements");

/// Loads kStepElements elements of T from p (any alignment) as fp32.
template <typename T>
FloatPair load_as_float(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return {fVec::loadu(p), fVec::loadu(p + fVec::size())};
  } else {
    auto [lo, hi] = at::vec::convert_to_float<T>(at::vec::Vectorized<T>::loadu(p));
    return {lo, hi};
  }
}

/// Rounds v to T and stores kStepElements elements at p (any alignment). With kReturnStored, returns the stored
/// values read back as fp32 (what a finiteness check of the result must look at: a finite fp32 can overflow
/// fp16); otherwise returns v and skips the read-back.
template <typename T, bool kReturnStored>
FloatPair store_from_float(T* p, const FloatPair& v) {
  if constexpr (std::is_same_v<T, float>) {
    v.first.store(p);
    v.second.store(p + fVec::size());
    return v;
  } else {
    const at::vec::Vectorized<T> stored = at::vec::convert_from_float<T>(v.first, v.second);
    stored.store(p);
    if constexpr (!kReturnStored) return v;
    auto [lo, hi] = at::vec::convert_to_float<T>(stored);
    return {lo, hi};
  }
}

using ::kernels::cpu::dispatch_dtype;

}  // namespace kernels::cpu::CPU_CAPABILITY
