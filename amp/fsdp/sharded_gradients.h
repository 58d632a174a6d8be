#pragma once

// The gradient owner of full sharding (Note [gradient owner] in amp/state/gradient_owner.h): amp over a
// ddp::FullyShardedDataParallel. Internal: users go through amp::initialize(fsdp, ...) (amp/fsdp/fully_sharded_amp.h).

#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include <amp/options.h>
#include <amp/state/gradient_owner.h>
#include <amp/state/replicated_gradients.h>
#include <ddp/process_group.h>

namespace amp::detail {

/// The optimizer's parameters are the fp32 shards of a FullyShardedDataParallel (one flat 1-D tensor per unit): they
/// are the master weights (under O2 the units gather them cast to the half dtype), and backward leaves each rank the
/// average of its slice of the scaled gradients in the shards' fp32 .grad. So the replicated owner's arithmetic
/// applies to them unchanged (unscaled in place, stashed across losses, the fused step on the shards) with two
/// differences: each rank checked only its slice, so the overflow flag is reduced over the ranks (MAX, one
/// 1-element allreduce per scope that unscales), and clip_grad_norm_ takes the norm over every rank's shards.
class ShardedGradients final : public GradientOwner {
 public:
  ShardedGradients(const OwnerContext& context, ddp::ProcessGroup pg);

  void begin_loss(bool starts_cycle) override { shards_.begin_loss(starts_cycle); }
  /// No buckets: full sharding reduces each unit's gradients itself.
  bool consume_bucket(const ddp::ReducedBucket&, LossScaler*) override { return false; }
  bool end_loss(LossScaler& scaler, bool reduce_flag) override;
  void step(FusedOptimizer& fused, const at::Tensor& found_inf) override { shards_.step(fused, found_inf); }
  std::vector<at::Tensor> grads() const override { return shards_.grads(); }
  at::Tensor clip_grad_norm_(double max_norm, const at::Tensor& found_inf) override;
  void zero_grad() override { shards_.zero_grad(); }
  /// masters: the fp32 shards; master_grads: their gradients; optimizer_state: a fused optimizer's state.
  HeldBytes held_bytes() const override;
  /// The shards (each slot's value is its shard: the full values are FullyShardedDataParallel::full_parameters()).
  std::vector<at::Tensor> full_masters() const override { return shards_.full_masters(); }
  /// Nothing: the slots are the masters.
  void master_copies(const std::vector<at::Tensor>&, std::vector<std::pair<at::Tensor, at::Tensor>>&) const override {}

 private:
  Options::Resolved policy_;  ///< the opt level's, without master weights: the shards are fp32 already
  ReplicatedGradients shards_;
  const ParamSlots& slots_;
  FusedOptimizer* fused_;
  ddp::ProcessGroup pg_;
};

}  // namespace amp::detail
