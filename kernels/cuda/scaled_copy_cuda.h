#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include <kernels/pointer_lists.h>
#include <kernels/scalar_arg.h>

namespace kernels::cuda {

/// The scaled, converting copy behind scaled_copy_, flatten_into_ and unflatten_from_: for every entry of
/// `lists` (list 0 = source, list 1 = destination, each with its own dtype), dst[i] = src[i] * scale computed in
/// fp32 and rounded to the destination dtype. When found_inf is not null it is set to 1 if any source element or
/// stored result is inf or NaN; when first_index is not null it is atomicMin'd with the original index of each
/// such entry. 16-byte vector path for entries whose two addresses are both 16-byte aligned, element-wise
/// otherwise. All pointers are device pointers; runs on `stream`, no host sync.
void scaled_copy(const PointerLists<2>& lists, ScalarArg scale, float* found_inf, int32_t* first_index,
                 cudaStream_t stream);

}  // namespace kernels::cuda
