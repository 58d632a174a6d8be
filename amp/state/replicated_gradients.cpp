#include <amp/state/replicated_gradients.h>

#include <unordered_set>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <amp/loss_scaler.h>
#include <amp/optim/fused_optimizer.h>
#include <amp/state/param_slots.h>
#include <ddp/distributed_data_parallel.h>
#include <ddp/reducer/bucket_copy.h>
#include <kernels/multi_tensor/l2_norm.h>
#include <kernels/multi_tensor/scaled_copy.h>
#include <kernels/multi_tensor/unscale.h>

namespace amp::detail {

int64_t held_storage_bytes(const std::vector<at::Tensor>& tensors) {
  std::unordered_set<const void*> seen;
  int64_t bytes = 0;
  for (const at::Tensor& t : tensors) {
    if (!t.defined()) continue;
    const c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
    if (seen.insert(storage).second) bytes += static_cast<int64_t>(t.storage().nbytes());
  }
  return bytes;
}

ReplicatedGradients::ReplicatedGradients(const OwnerContext& context)
    : slots_(context.slots),
      fused_(context.fused),
      master_weights_(context.policy.master_weights),
      bucket_scale_(at::empty({1}, at::TensorOptions().dtype(at::kFloat).device(context.slots.device()))) {}

void ReplicatedGradients::begin_loss(bool starts_cycle) {
  if (!starts_cycle) return;
  // Earlier losses' gradients are already unscaled: keep them aside so this backward produces only this loss's
  // scaled gradients; end_loss() adds them back (Apex's stash).
  for (size_t i = 0; i < slots_.size(); ++i) {
    auto& slot = slots_[i];
    if (slot.has_master) {
      slot.model.mutable_grad() = at::Tensor();  // already folded into the master's gradient
    } else {
      if (stash_.size() != slots_.size()) stash_.resize(slots_.size());
      if (slot.model.grad().defined()) {
        stash_[i] = stash_[i].defined() ? stash_[i].add_(slot.model.grad()) : slot.model.grad();
        slot.model.mutable_grad() = at::Tensor();
      }
    }
  }
  consumed_direct_.assign(slots_.size(), ConsumedGrad{});
}

bool ReplicatedGradients::consume_bucket(const ddp::ReducedBucket& bucket, LossScaler* scaler) {
  // Outside a scale_loss scope, or accumulating scaled gradients (delay_unscale): a plain average.
  if (scaler == nullptr) return false;
  // Checked for the whole bucket before anything is written, so declining or refusing leaves every gradient as it
  // was. A bucket the fused kernels cannot write (allreduce_dtype(kDouble), or a gradient written in place that is
  // non-contiguous) is declined: DDP writes it back tensor by tensor and the scope's end unscales it.
  std::vector<int64_t> slot_at(bucket.params.size(), -1);  // the optimizer's slot of each entry, -1 for none
  std::vector<at::Tensor> in_place;                        // gradients the fused pass would write
  for (size_t k = 0; k < bucket.params.size(); ++k) {
    slot_at[k] = slots_.index_of(bucket.params[k]);
    if (slot_at[k] < 0 || !slots_[static_cast<size_t>(slot_at[k])].has_master) in_place.push_back(bucket.grads[k]);
  }
  if (!ddp::detail::fusable(bucket.buffer, in_place)) return false;
  for (size_t k = 0; k < bucket.params.size(); ++k) {
    if (slot_at[k] < 0) continue;
    const ParamSlot& slot = slots_[static_cast<size_t>(slot_at[k])];
    // A second synchronized backward in the same scope would find this gradient already unscaled, add its
    // scaled local gradient to it, and reduce the mix: refuse rather than compute a wrong average.
    TORCH_CHECK(slot.has_master || consumed_direct_[static_cast<size_t>(slot_at[k])].grad == nullptr,
                "amp: a second synchronized backward pass inside one scale_loss scope reached '", slot.name,
                "' (which has no fp32 master) after DDP's bucket had been unscaled into it. Run the scope's earlier "
                "backward passes under no_sync, or give them their own scope with delay_unscale=true.");
  }
  // One fused pass per bucket: the reduced sum times (average_scale * inv_scale), checked, written to the
  // optimizer's gradient (in place for direct parameters, fp32 into the master's for half ones).
  std::vector<at::Tensor> src, dst, scratch, plain_src, plain_dst;
  std::vector<int64_t> index, scratch_slot, master_slot;
  int64_t offset = 0;
  for (size_t k = 0; k < bucket.params.size(); ++k) {
    const at::Tensor& grad = bucket.grads[k];
    at::Tensor reduced = bucket.buffer.narrow(0, offset, grad.numel());
    offset += grad.numel();
    const int64_t i = slot_at[k];
    if (i < 0) {  // a parameter the optimizer does not update: the average, as DDP would write it
      plain_src.push_back(reduced);
      plain_dst.push_back(grad);
      continue;
    }
    ParamSlot& slot = slots_[static_cast<size_t>(i)];
    src.push_back(reduced);
    index.push_back(i);
    if (!slot.has_master) {
      consumed_direct_[static_cast<size_t>(i)] = ConsumedGrad{grad.unsafeGetTensorImpl(), grad._version()};
      dst.push_back(grad);
      continue;
    }
    master_slot.push_back(i);
    at::Tensor& master_grad = slot.master.mutable_grad();
    if (master_grad.defined()) {  // an earlier loss of this step: add this loss's share
      scratch.push_back(at::empty_like(master_grad));
      scratch_slot.push_back(i);
      dst.push_back(scratch.back());
    } else {
      master_grad = at::empty_like(slot.master, at::MemoryFormat::Contiguous);
      // Allocated on DDP's communication stream, used and freed on the caller's.
      if (bucket.caller_stream) master_grad.record_stream(*bucket.caller_stream);
      dst.push_back(master_grad);
    }
  }
  if (!src.empty()) {
    // average * inv_scale in a tensor kept for the purpose: no allocation per bucket, no host read of the scale.
    bucket_scale_.copy_(scaler->inv_scale()).mul_(bucket.average_scale);
    kernels::scaled_copy_(src, dst, bucket_scale_, scaler->found_inf(), scaler->first_nonfinite_index(), index);
  }
  for (size_t k = 0; k < scratch.size(); ++k) {
    slots_[static_cast<size_t>(scratch_slot[k])].master.mutable_grad().add_(scratch[k]);
  }
  for (const int64_t i : master_slot) {
    slots_[static_cast<size_t>(i)].model.mutable_grad() = at::Tensor();  // folded into the master's
  }
  if (!plain_src.empty()) kernels::scaled_copy_(plain_src, plain_dst, bucket.average_scale);
  return true;
}

bool ReplicatedGradients::end_loss(LossScaler& s, bool /*reduce_flag: every rank checked the same gradients*/) {
  // Gradients unscaled in place by consume_bucket must not have changed since (that would mix scales): checked for
  // all of them before anything is written, so a refusal leaves every gradient as it was.
  for (size_t i = 0; i < consumed_direct_.size(); ++i) {
    const at::Tensor& grad = slots_[i].model.grad();
    if (consumed_direct_[i].grad == nullptr || !grad.defined()) continue;
    TORCH_CHECK(
        grad.unsafeGetTensorImpl() == consumed_direct_[i].grad && grad._version() == consumed_direct_[i].version,
        "amp: the gradient of '", slots_[i].name,
        "' changed after DDP's reduced bucket was unscaled into it in this scale_loss scope (a backward under "
        "no_sync after a synchronized one?), which would mix unscaled and scaled values. Run the scope's earlier "
        "backward passes under no_sync, or give them their own scope with delay_unscale=true.");
  }
  // Two fused calls: masterless gradients are unscaled in place; half gradients are unscaled in fp32 straight
  // into their masters' gradients. Both record slot indices, so a recorded index names a parameter.
  std::vector<at::Tensor> direct, model_grads, master_targets, scratch_of;
  std::vector<int64_t> direct_index, master_index;
  for (size_t i = 0; i < slots_.size(); ++i) {
    auto& slot = slots_[i];
    if (!slot.model.grad().defined()) continue;  // none, or folded into the master by consume_bucket
    if (i < consumed_direct_.size() && consumed_direct_[i].grad != nullptr) continue;  // unscaled by consume_bucket
    // The fused kernels take contiguous tensors: a gradient laid out like a non-contiguous parameter (stored
    // transposed, channels_last) is replaced by a contiguous copy, which backward keeps accumulating into.
    at::Tensor& grad = slot.model.mutable_grad();
    if (!grad.is_contiguous()) grad = grad.contiguous();
    if (!slot.has_master) {
      direct.push_back(slot.model.grad());
      direct_index.push_back(static_cast<int64_t>(i));
      continue;
    }
    model_grads.push_back(slot.model.grad());
    master_index.push_back(static_cast<int64_t>(i));
    // A master that already holds a gradient (an earlier loss of this step) gets this loss's share added.
    at::Tensor& master_grad = slot.master.mutable_grad();
    if (master_grad.defined()) {
      scratch_of.push_back(at::empty_like(master_grad));
      master_targets.push_back(scratch_of.back());
    } else {
      master_grad = at::empty_like(slot.master, at::MemoryFormat::Contiguous);
      scratch_of.push_back(at::Tensor());
      master_targets.push_back(master_grad);
    }
  }
  if (!direct.empty()) {
    kernels::unscale_and_check_(direct, s.inv_scale(), s.found_inf(), s.first_nonfinite_index(), direct_index);
  }
  if (!model_grads.empty()) {
    kernels::scaled_copy_(model_grads, master_targets, s.inv_scale(), s.found_inf(), s.first_nonfinite_index(),
                          master_index);
    for (size_t k = 0; k < master_index.size(); ++k) {
      auto& slot = slots_[static_cast<size_t>(master_index[k])];
      if (scratch_of[k].defined()) slot.master.mutable_grad().add_(scratch_of[k]);
      slot.model.mutable_grad() = at::Tensor();  // folded into the master's gradient; frees the half copy
    }
  }
  // Add back what earlier losses of this step left in the stash.
  for (size_t i = 0; i < stash_.size(); ++i) {
    if (!stash_[i].defined()) continue;
    auto& grad = slots_[i].model.mutable_grad();
    grad = grad.defined() ? grad.add_(stash_[i]) : stash_[i];
    stash_[i] = at::Tensor();
  }
  return false;
}

void ReplicatedGradients::step(FusedOptimizer& fused, const at::Tensor& found_inf) {
  // With masters, the fused step writes each updated master rounded into its model parameter.
  std::vector<at::Tensor> models;
  if (master_weights_) {
    for (const auto& slot : slots_) models.push_back(slot.model);
  }
  fused.fused_step(models, found_inf);
}

std::vector<at::Tensor> ReplicatedGradients::grads() const {
  std::vector<at::Tensor> grads;
  for (const auto& slot : slots_) {
    const at::Tensor& g = slot.master.grad();
    if (g.defined()) grads.push_back(g);
  }
  return grads;
}

at::Tensor ReplicatedGradients::clip_grad_norm_(double max_norm, const at::Tensor& found_inf) {
  return kernels::clip_grad_norm_(grads(), max_norm, found_inf);
}

HeldBytes ReplicatedGradients::held_bytes() const {
  HeldBytes bytes;
  std::vector<at::Tensor> masters, grads;
  for (const auto& slot : slots_) {
    if (slot.has_master) masters.push_back(slot.master);
    grads.push_back(slot.master.grad());
  }
  bytes.masters = held_storage_bytes(masters);
  bytes.master_grads = held_storage_bytes(grads);
  if (fused_ != nullptr) bytes.optimizer_state = held_storage_bytes(fused_->state_tensors());
  return bytes;
}

std::vector<at::Tensor> ReplicatedGradients::full_masters() const {
  std::vector<at::Tensor> values;
  for (const auto& slot : slots_) values.push_back(slot.has_master ? slot.master : slot.model);
  return values;
}

void ReplicatedGradients::master_copies(const std::vector<at::Tensor>& values,
                                        std::vector<std::pair<at::Tensor, at::Tensor>>& out) const {
  for (size_t i = 0; i < slots_.size(); ++i) {
    if (slots_[i].has_master && values[i].defined()) out.emplace_back(slots_[i].master, values[i]);
  }
}

}  // namespace amp::detail
