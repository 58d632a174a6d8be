#pragma once

#include <kernels/pointer_lists.h>

namespace kernels::cpu {

/// CPU twin of kernels::cuda::multi_tensor_scale: in-place x *= scale in fp32 arithmetic, vectorized with
/// at::vec and spread over threads with at::parallel_for.
void multi_tensor_scale(const PointerLists<1>& lists, float scale);

}  // namespace kernels::cpu
