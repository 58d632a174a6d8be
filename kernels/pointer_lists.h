#pragma once

#include <array>
#include <cstdint>
#include <vector>

#include <kernels/dtype.h>

namespace kernels {

/// A raw, framework-free view of `kDepth` parallel tensor lists: entry i holds the i-th tensor of each list
/// (the same element count in every list), and list d has dtype dtypes[d] throughout. This is what crosses
/// from the ATen-facing entry points into the CUDA implementations and the CPU twins.
template <int kDepth>
struct PointerLists {
  std::array<DType, kDepth> dtypes{};                ///< dtype of list d, shared by all its entries
  std::vector<std::array<void*, kDepth>> addresses;  ///< per entry, the data pointer of its tensor in each list
  std::vector<int64_t> num_elements;                 ///< per entry, the element count shared by its tensors
  /// Position of each entry in the caller's original lists (dtype grouping reorders), for error reports and
  /// for recording which tensor held a non-finite value.
  std::vector<int64_t> original_index;

  /// Number of entries.
  int64_t size() const { return static_cast<int64_t>(num_elements.size()); }
  /// Appends an entry: one data pointer per list, their element count `n` and the original position `index`.
  void push_back(const std::array<void*, kDepth>& ptrs, int64_t n, int64_t index) {
    addresses.push_back(ptrs);
    num_elements.push_back(n);
    original_index.push_back(index);
  }
};

/// The value a first-non-finite index tensor holds when no non-finite value has been seen: ops record the
/// smallest original index with atomicMin (see Note [first non-finite index] in kernels/multi_tensor/unscale.h).
constexpr int32_t kNoNonFiniteIndex = 2147483647;

}  // namespace kernels
