#pragma once

#include <kernels/pointer_lists.h>

namespace kernels::cpu {

/// CPU twin of kernels::cuda::axpby (same contract; host pointers).
void axpby(const PointerLists<3>& lists, float a, float b, float* found_inf, bool check_x, bool check_y);

}  // namespace kernels::cpu
