#pragma once

#include <vector>

#include <cuda_runtime_api.h>

#include <kernels/optim/fused_optimizer_rules.h>
#include <kernels/pointer_lists.h>

namespace kernels::cuda {

// One Adam/AdamW step over one dtype group (see Note [fused optimizer step]). The lists are, in order:
// params, grads, exp_avgs, exp_avg_sqs, then max_exp_avg_sqs when args.amsgrad, then fp32 masters when present,
// and last each tensor's 1-element fp32 step count (its address is the count itself, not an array of numel
// elements). Depth 5: neither optional list; 6: one of them, told apart by args.amsgrad; 7: both. All pointers
// are device pointers; runs on `stream` and never syncs the host. The step counts are not advanced here: call
// advance_steps once after every group of the step has been launched.
void fused_adam(const PointerLists<5>& lists, const AdamArgs& args, cudaStream_t stream);
void fused_adam(const PointerLists<6>& lists, const AdamArgs& args, cudaStream_t stream);
void fused_adam(const PointerLists<7>& lists, const AdamArgs& args, cudaStream_t stream);

// One SGD step over one dtype group. Lists: params, grads, then momentum buffers when args.momentum != 0, then
// fp32 masters when present, then (with momentum) each tensor's step count as for fused_adam. Depth 2 / 3:
// without momentum, without / with masters; 4 / 5: with momentum, without / with masters. Same contract.
void fused_sgd(const PointerLists<2>& lists, const SgdArgs& args, cudaStream_t stream);
void fused_sgd(const PointerLists<3>& lists, const SgdArgs& args, cudaStream_t stream);
void fused_sgd(const PointerLists<4>& lists, const SgdArgs& args, cudaStream_t stream);
void fused_sgd(const PointerLists<5>& lists, const SgdArgs& args, cudaStream_t stream);

/// *steps[i] += 1 for every i unless *found_inf (if given) is nonzero: kernels on `stream` that take the
/// pointers by value (no host-to-device copy, capturable); one launch per 500 counts.
void advance_steps(const std::vector<float*>& steps, const float* found_inf, cudaStream_t stream);

}  // namespace kernels::cuda
