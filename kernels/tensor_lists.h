#pragma once

// Checks and grouping shared by every ATen-facing entry point of kernels/.

#include <array>
#include <cstdint>
#include <map>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>

#include <kernels/pointer_lists.h>

namespace kernels {

/// Maps a tensor dtype to the kernels' DType; throws naming `what` for anything but fp32/fp16/bf16.
DType to_kernel_dtype(c10::ScalarType type, const char* what);

/// Checks one tensor list argument of a multi-tensor op: every tensor defined, floating (fp32/fp16/bf16),
/// contiguous and on `device`. Errors name the argument, the index and the offending value.
void check_floating_contiguous_list(at::TensorList list, const char* arg_name, const c10::Device& device);

/// Checks that every tensor of `list` has dtype `dtype` (e.g. fp32 master weights); names index and dtype.
void check_list_dtype(at::TensorList list, const char* arg_name, c10::ScalarType dtype);

/// Checks a 1-element float32 flag tensor (found_inf) on `device`; names `arg_name` and what was wrong.
void check_flag_tensor(const at::Tensor& flag, const char* arg_name, const c10::Device& device);

/// Checks a 1-element tensor of `dtype` on `device` (a scalar the kernels read on device: inv_scale, lr, step).
void check_scalar_tensor(const at::Tensor& scalar, const char* arg_name, const c10::Device& device,
                         c10::ScalarType dtype);

/// The device a call runs on: that of lists[0][0] (or CPU for empty lists).
c10::Device device_of(at::TensorList first_list);

/// Checks `kDepth` parallel lists (same length; entry i has the same element count in every list; all
/// floating, contiguous, on `device`) and groups the entries by their tuple of dtypes, keeping the original
/// order within each group. Errors name the lists, the index and the offending value.
template <int kDepth>
std::vector<PointerLists<kDepth>> group_lists(const std::array<at::TensorList, kDepth>& lists,
                                              const std::array<const char*, kDepth>& names, const c10::Device& device) {
  for (int d = 0; d < kDepth; ++d) {
    TORCH_CHECK(lists[d].size() == lists[0].size(), names[d], " has ", lists[d].size(), " tensors but ", names[0],
                " has ", lists[0].size());
    check_floating_contiguous_list(lists[d], names[d], device);
  }
  std::map<std::array<DType, kDepth>, PointerLists<kDepth>> groups;
  for (size_t i = 0; i < lists[0].size(); ++i) {
    std::array<DType, kDepth> key{};
    std::array<void*, kDepth> ptrs{};
    for (int d = 0; d < kDepth; ++d) {
      const at::Tensor& t = lists[d][i];
      TORCH_CHECK(t.numel() == lists[0][i].numel(), names[d], "[", i, "] has ", t.numel(), " elements but ", names[0],
                  "[", i, "] has ", lists[0][i].numel());
      key[d] = to_kernel_dtype(t.scalar_type(), names[d]);
      ptrs[d] = t.data_ptr();
    }
    auto& group = groups[key];
    group.dtypes = key;
    group.push_back(ptrs, lists[0][i].numel(), static_cast<int64_t>(i));
  }
  std::vector<PointerLists<kDepth>> out;
  for (auto& entry : groups) out.push_back(std::move(entry.second));
  return out;
}

/// The int32 pointer of an optional first-non-finite index tensor (see Note [first non-finite index] in
/// kernels/multi_tensor/unscale.h): nullptr when `index` is undefined, else it must be a 1-element int32 tensor on
/// `device`.
int32_t* optional_index_tensor(const at::Tensor& index, const char* arg_name, const c10::Device& device);

/// Adds `offset` to every original index of `groups` (callers that split one logical list into several calls).
/// Throws when offset is negative or an index would not fit the int32 that devices record.
template <int kDepth>
void apply_index_offset(std::vector<PointerLists<kDepth>>& groups, int64_t offset) {
  TORCH_CHECK(offset >= 0, "index_offset must be >= 0, got ", offset);
  for (auto& group : groups) {
    for (auto& index : group.original_index) {
      index += offset;
      TORCH_CHECK(index < kNoNonFiniteIndex, "index_offset ", offset, " puts a tensor index at ", index,
                  ", beyond the int32 range recorded on device");
    }
  }
}

/// Replaces every original index i of `groups` by indices[i] (callers whose list positions are not the
/// indices they want recorded). Throws when `indices` does not have one entry per tensor or one is out of range.
template <int kDepth>
void apply_explicit_indices(std::vector<PointerLists<kDepth>>& groups, c10::ArrayRef<int64_t> indices,
                            size_t list_size) {
  TORCH_CHECK(indices.size() == list_size, "indices has ", indices.size(), " entries but the list has ", list_size,
              " tensors");
  for (auto& group : groups) {
    for (auto& index : group.original_index) {
      const int64_t mapped = indices[index];
      TORCH_CHECK(mapped >= 0 && mapped < kNoNonFiniteIndex, "indices[", index, "] = ", mapped,
                  " is outside [0, 2^31 - 1)");
      index = mapped;
    }
  }
}

/// Single-list form of group_lists.
std::vector<PointerLists<1>> group_by_dtype(at::TensorList list, const char* name, const c10::Device& device);

}  // namespace kernels
