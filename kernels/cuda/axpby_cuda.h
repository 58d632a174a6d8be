#pragma once

#include <cuda_runtime_api.h>

#include <kernels/pointer_lists.h>

namespace kernels::cuda {

/// out = a*x + b*y (fp32 arithmetic: fmaf(a, x, b*y)) for every entry of `lists` (list 0 = x, 1 = y, 2 = out,
/// each with its own dtype; out may be x or y). When found_inf is not null it is set to 1 if a checked input
/// (x when check_x, y when check_y) holds an inf or NaN. Device pointers; runs on `stream`, no host sync.
void axpby(const PointerLists<3>& lists, float a, float b, float* found_inf, bool check_x, bool check_y,
           cudaStream_t stream);

}  // namespace kernels::cuda
