#pragma once

#include <kernels/fused_optimizer_rules.h>
#include <kernels/pointer_lists.h>

namespace kernels::cpu {

// CPU twins of kernels::cuda::fused_adam / fused_sgd (same lists, same contract; host pointers). Each reads
// found_inf, step, lr and inv_scale from host memory once per call.
void fused_adam(const PointerLists<4>& lists, const AdamArgs& args);
void fused_adam(const PointerLists<5>& lists, const AdamArgs& args);
void fused_adam(const PointerLists<6>& lists, const AdamArgs& args);
void fused_sgd(const PointerLists<2>& lists, const SgdArgs& args);
void fused_sgd(const PointerLists<3>& lists, const SgdArgs& args);
void fused_sgd(const PointerLists<4>& lists, const SgdArgs& args);

}  // namespace kernels::cpu
