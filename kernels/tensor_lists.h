#pragma once

#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

#include <kernels/pointer_lists.h>

namespace kernels {

/// Maps a tensor dtype to the kernels' DType; throws naming `what` for anything but fp32/fp16/bf16.
DType to_kernel_dtype(c10::ScalarType type, const char* what);

/// Checks one tensor list argument of a multi-tensor op: every tensor defined, floating (fp32/fp16/bf16),
/// contiguous and on `device`. Errors name the argument, the index and the offending value.
void check_floating_contiguous_list(at::TensorList list, const char* arg_name, const c10::Device& device);

/// Groups a list by dtype into one PointerLists<1> per dtype present, keeping the original order inside
/// each group. The list must have passed check_floating_contiguous_list.
std::vector<PointerLists<1>> group_by_dtype(at::TensorList list);

}  // namespace kernels
