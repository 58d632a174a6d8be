#pragma once

#include <array>
#include <cstdint>
#include <vector>

#include <kernels/dtype.h>

namespace kernels {

/// A raw, framework-free view of `kDepth` parallel tensor lists of one dtype: entry i holds the i-th tensor
/// of each list (same element count in every list). This is what crosses from the ATen-facing entry points
/// into the CUDA implementations and the CPU twins.
template <int kDepth>
struct PointerLists {
  DType dtype = DType::kFloat32;
  std::vector<std::array<void*, kDepth>> addresses;
  std::vector<int64_t> num_elements;
  /// Position of each entry in the caller's original list (dtype grouping reorders), for error reports.
  std::vector<int64_t> original_index;

  int64_t size() const { return static_cast<int64_t>(num_elements.size()); }
  void push_back(const std::array<void*, kDepth>& ptrs, int64_t n, int64_t index) {
    addresses.push_back(ptrs);
    num_elements.push_back(n);
    original_index.push_back(index);
  }
};

}  // namespace kernels
