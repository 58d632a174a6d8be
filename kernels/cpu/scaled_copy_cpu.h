#pragma once

#include <cstdint>

#include <kernels/pointer_lists.h>
#include <kernels/scalar_arg.h>

namespace kernels::cpu {

/// CPU twin of kernels::cuda::scaled_copy (same contract; host pointers, scale.device_value a host pointer).
void scaled_copy(const PointerLists<2>& lists, ScalarArg scale, float* found_inf, int32_t* first_index);

}  // namespace kernels::cpu
