// amp::detail::State, the scale_loss protocol: begin_loss / end_loss (see ScaledLoss in amp/amp.h).

#include <amp/state/state.h>

#include <vector>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <amp/fp8/fp8_state.h>
#include <amp/zero/zero_shard.h>
#include <kernels/multi_tensor/scaled_copy.h>
#include <kernels/multi_tensor/unscale.h>

namespace amp::detail {

at::Tensor State::begin_loss(const at::Tensor& loss, int64_t loss_id, bool delay_unscale) {
  if (zero_ != nullptr) zero_->check_published("scale_loss began");  // Note [deferred publish]
  LossScaler& s = scaler(loss_id);
  if (grads_scaled_) {
    TORCH_CHECK(loss_id == scaled_loss_id_, "scale_loss with loss_id ", loss_id, " while gradients still carry loss ",
                scaled_loss_id_, "'s scale (delay_unscale=true): finish that loss with delay_unscale=false first");
  } else {
    // Earlier losses' gradients are already unscaled: keep them aside so this backward produces only this
    // loss's scaled gradients; end_loss() adds them back (Apex's stash). Under ZeRO they are in the shard already.
    for (size_t i = 0; zero_ == nullptr && i < slots_.size(); ++i) {
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
    // A new unscale cycle: the overflow flag starts clear here, before backward, because with a data parallel
    // wrapper attached the buckets are unscaled and checked during backward (consume_bucket).
    s.begin_step();
    consumed_direct_.assign(slots_.size(), ConsumedGrad{});
  }
  at::Tensor scaled = s.scale_loss(loss);  // may throw (bad loss): then no loss is active
  active_loss_id_ = loss_id;
  active_delay_unscale_ = delay_unscale;
  return scaled;
}

void State::end_loss(int64_t loss_id, bool delay_unscale) {
  active_loss_id_ = -1;
  if (delay_unscale) {
    grads_scaled_ = true;
    scaled_loss_id_ = loss_id;
    return;
  }
  LossScaler& s = scaler(loss_id);
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
  if (zero_ != nullptr) {  // the sharded sibling: this rank's pieces, then one collective for the flag
    // With FP8 the flag rides in the amax reduction (one collective, MAX) instead of its own.
    zero_->end_loss(s, /*reduce_flag=*/fp8_ == nullptr);
    if (fp8_ != nullptr) fp8_->reduce_and_check(s.found_inf(), /*reduce_flag=*/true);
    s.update();
    step_found_inf_.add_(s.found_inf());
    grads_scaled_ = false;
    unscaled_this_step_ = true;
    return;
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
      auto& slot = slots_[master_index[k]];
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
  // A non-finite FP8 amax (an overflowing output gradient the saturating cast clipped, or an inf input) counts as
  // this loss's overflow: the scaler backs off and the step is skipped, on every rank alike.
  if (fp8_ != nullptr) fp8_->reduce_and_check(s.found_inf());
  s.update();
  step_found_inf_.add_(s.found_inf());
  grads_scaled_ = false;
  unscaled_this_step_ = true;
}

}  // namespace amp::detail
