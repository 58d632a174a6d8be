#include <amp/fsdp/sharded_gradients.h>

#include <ATen/ATen.h>

#include <amp/loss_scaler.h>
#include <amp/optim/fused_optimizer.h>
#include <amp/state/param_slots.h>
#include <amp/state/sharded_norm.h>

namespace amp::detail {
namespace {

Options::Resolved without_masters(Options::Resolved policy) {
  policy.master_weights = false;
  return policy;
}

}  // namespace

ShardedGradients::ShardedGradients(const OwnerContext& context, ddp::ProcessGroup pg)
    : policy_(without_masters(context.policy)),
      shards_(OwnerContext{context.slots, context.optimizer, context.fused, policy_, context.untouched}),
      slots_(context.slots),
      fused_(context.fused),
      pg_(std::move(pg)) {}

bool ShardedGradients::end_loss(LossScaler& scaler, bool reduce_flag) {
  shards_.end_loss(scaler, /*reduce_flag=*/false);
  // Each rank checked only its slice of the reduced gradients (an inf in one rank's gradient reaches only the slice
  // it falls in): one allreduce makes the flag, the scale update and the skip agree. MAX, as ZeRO's: the flag stays
  // 0 or 1 on every rank, as on plain DDP + amp. reduce_flag false: the caller folds it into the FP8 amax reduction.
  if (!reduce_flag) return true;
  at::Tensor flag = scaler.found_inf();
  pg_.allreduce_max_(flag, "full sharding overflow flag allreduce");
  return false;
}

at::Tensor ShardedGradients::clip_grad_norm_(double max_norm, const at::Tensor& found_inf) {
  return sharded_clip_grad_norm_(grads(), max_norm, found_inf, pg_, "full sharding gradient norm allreduce");
}

HeldBytes ShardedGradients::held_bytes() const {
  HeldBytes bytes;
  std::vector<at::Tensor> shards, grads;
  for (const ParamSlot& slot : slots_) {
    shards.push_back(slot.model);
    grads.push_back(slot.model.grad());
  }
  bytes.masters = held_storage_bytes(shards);
  bytes.master_grads = held_storage_bytes(grads);
  if (fused_ != nullptr) bytes.optimizer_state = held_storage_bytes(fused_->state_tensors());
  return bytes;
}

}  // namespace amp::detail
