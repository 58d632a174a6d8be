#pragma once

#include <cstdint>

#include <kernels/pointer_lists.h>

namespace kernels::cpu {

/// CPU twin of kernels::cuda::unscale_and_check (same contract; host pointers).
void unscale_and_check(const PointerLists<1>& lists, const float* inv_scale, float* found_inf, int32_t* first_index);

}  // namespace kernels::cpu
