#pragma once

#include <kernels/optim/fused_optimizer_rules.h>
#include <kernels/pointer_lists.h>

namespace kernels::cpu {

// CPU twins of kernels::cuda::fused_adam / fused_sgd (same lists, same contract; host pointers). Each reads
// found_inf, lr and inv_scale from host memory once per call and each tensor's step count once per piece; the
// step counts are not advanced here.
void fused_adam(const PointerLists<5>& lists, const AdamArgs& args);
void fused_adam(const PointerLists<6>& lists, const AdamArgs& args);
void fused_adam(const PointerLists<7>& lists, const AdamArgs& args);
void fused_sgd(const PointerLists<2>& lists, const SgdArgs& args);
void fused_sgd(const PointerLists<3>& lists, const SgdArgs& args);
void fused_sgd(const PointerLists<4>& lists, const SgdArgs& args);
void fused_sgd(const PointerLists<5>& lists, const SgdArgs& args);

}  // namespace kernels::cpu
