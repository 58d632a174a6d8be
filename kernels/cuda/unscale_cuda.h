#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include <kernels/pointer_lists.h>

namespace kernels::cuda {

/// In-place g *= *inv_scale over `lists` (one dtype); sets *found_inf = 1 on any non-finite input or result
/// and, when first_index is not null, atomicMin's it with the original index of each such tensor.
/// All pointers are device pointers; runs on `stream`, no host sync.
void unscale_and_check(const PointerLists<1>& lists, const float* inv_scale, float* found_inf, int32_t* first_index,
                       cudaStream_t stream);

}  // namespace kernels::cuda
