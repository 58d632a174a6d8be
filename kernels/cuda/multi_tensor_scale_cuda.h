#pragma once

#include <cuda_runtime_api.h>

#include <kernels/pointer_lists.h>

namespace kernels::cuda {

/// In-place x *= scale (fp32 arithmetic) over every tensor of `lists` (one dtype), on `stream`. No host sync.
void multi_tensor_scale(const PointerLists<1>& lists, float scale, cudaStream_t stream);

}  // namespace kernels::cuda
