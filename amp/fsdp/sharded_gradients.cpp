#include <amp/fsdp/sharded_gradients.h>

#include <algorithm>
#include <unordered_map>

#include <ATen/ATen.h>

#include <amp/loss_scaler.h>
#include <amp/optim/fused_optimizer.h>
#include <amp/state/param_slots.h>
#include <amp/state/sharded_norm.h>
#include <ddp/fsdp/fully_sharded.h>

namespace amp::detail {
namespace {

Options::Resolved without_masters(Options::Resolved policy) {
  policy.master_weights = false;
  return policy;
}

}  // namespace

ShardedGradients::ShardedGradients(const OwnerContext& context, ddp::FullyShardedDataParallel& fsdp)
    : policy_(without_masters(context.policy)),
      shards_(OwnerContext{context.slots, context.optimizer, context.fused, policy_, context.untouched}),
      slots_(context.slots),
      optimizer_(context.optimizer),
      fused_(context.fused),
      pg_(fsdp.process_group()) {
  // Each slot's unit (by its shard), its place in the optimizer's groups, and its parameters' in the unsharded layout.
  const std::vector<at::Tensor> shards = fsdp.parameters();
  const std::vector<ddp::ShardedUnitInfo> all_units = fsdp.units();
  std::vector<const ddp::ShardedUnitInfo*> unit_of_shard;
  for (const ddp::ShardedUnitInfo& unit : all_units) {
    if (unit.shard_numel > 0) unit_of_shard.push_back(&unit);
  }
  std::unordered_map<std::string, int64_t> module_position;
  for (const auto& p : fsdp.module()->named_parameters(/*recurse=*/true)) {
    module_position.emplace(p.key(), static_cast<int64_t>(module_position.size()));
  }
  layout_.resize(slots_.size());
  size_t i = 0;
  const auto& groups = optimizer_.param_groups();
  for (size_t g = 0; g < groups.size(); ++g) {
    std::vector<std::pair<int64_t, LaidOut*>> in_group;  // (module position, parameter)
    for (size_t k = 0; k < groups[g].params().size(); ++k, ++i) {
      ShardLayout& shard = layout_[i];
      shard.group = static_cast<int64_t>(g);
      shard.index = static_cast<int64_t>(k);
      size_t u = 0;
      while (!shards[u].is_same(slots_[i].model)) ++u;  // every slot is a shard: ParamSlots checked it
      const ddp::ShardedUnitInfo& unit = *unit_of_shard[u];
      shard.chunk = unit.shard_numel;
      for (size_t q = 0; q < unit.parameter_names.size(); ++q) {
        shard.params.push_back(LaidOut{unit.parameter_names[q], unit.parameter_shapes[q], unit.parameter_offsets[q]});
      }
    }
    for (size_t s = i - groups[g].params().size(); s < i; ++s) {
      for (LaidOut& p : layout_[s].params) in_group.emplace_back(module_position.at(p.name), &p);
    }
    std::sort(in_group.begin(), in_group.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
    for (size_t j = 0; j < in_group.size(); ++j) in_group[j].second->index = static_cast<int64_t>(j);
  }
}

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
