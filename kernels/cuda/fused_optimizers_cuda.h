#pragma once

#include <cuda_runtime_api.h>

#include <kernels/fused_optimizer_rules.h>
#include <kernels/pointer_lists.h>

namespace kernels::cuda {

// One Adam/AdamW step over one dtype group (see Note [fused optimizer step]). The lists are, in order:
// params, grads, exp_avgs, exp_avg_sqs, then max_exp_avg_sqs when args.amsgrad, then fp32 masters when present
// (depth 4: neither; 5: one of them, told apart by args.amsgrad; 6: both). All pointers are device pointers;
// runs on `stream` and never syncs the host. The step count is not advanced here: call advance_step once after
// every group of the step has been launched.
void fused_adam(const PointerLists<4>& lists, const AdamArgs& args, cudaStream_t stream);
void fused_adam(const PointerLists<5>& lists, const AdamArgs& args, cudaStream_t stream);
void fused_adam(const PointerLists<6>& lists, const AdamArgs& args, cudaStream_t stream);

// One SGD step over one dtype group. Lists: params, grads, then momentum buffers when args.momentum != 0, then
// fp32 masters when present (depth 3 is told apart by args.momentum). Same contract as fused_adam.
void fused_sgd(const PointerLists<2>& lists, const SgdArgs& args, cudaStream_t stream);
void fused_sgd(const PointerLists<3>& lists, const SgdArgs& args, cudaStream_t stream);
void fused_sgd(const PointerLists<4>& lists, const SgdArgs& args, cudaStream_t stream);

/// *step += 1 unless *found_inf (if given) is nonzero: a one-thread kernel on `stream`.
void advance_step(float* step, const float* found_inf, cudaStream_t stream);

}  // namespace kernels::cuda
