// amp::detail::State, stepping: step(), zero_grad() and the gradients the optimizer reads.

#include <amp/state/state.h>

#include <vector>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <amp/fp8/fp8_state.h>
#include <amp/optim/fused_optimizer.h>
#include <amp/zero/zero_shard.h>
#include <kernels/capture.h>
#include <kernels/multi_tensor/scaled_copy.h>

namespace amp::detail {

std::vector<at::Tensor> State::optimizer_grads() const {
  if (zero_ != nullptr) return zero_->grads();
  std::vector<at::Tensor> grads;
  for (const auto& slot : slots_) {
    const at::Tensor& g = slot.master.grad();
    if (g.defined()) grads.push_back(g);
  }
  return grads;
}

void State::wait_for_parameters() {
  if (zero_ != nullptr) zero_->finish_publish();
}

at::Tensor State::step(const torch::optim::Optimizer::LossClosure& closure) {
  at::Tensor result;
  if (closure) {  // as torch.optim: evaluated once, with gradients enabled, before the step
    at::AutoGradMode enable_grad(true);
    result = closure();
  }
  TORCH_CHECK(!grads_scaled_,
              "step() while gradients are still scaled: the last scale_loss used delay_unscale=true; "
              "finish the accumulation with delay_unscale=false before stepping");
  // Note [capture-safe step] (kernels/capture.h): only the fused path launches nothing but device work.
  const bool capturing = kernels::is_capturing(device_);
  TORCH_CHECK(fused_ != nullptr || !capturing,
              "amp::Optimizer::step() with a plain torch::optim optimizer cannot be captured in a CUDA graph on ",
              device_,
              ": it reads the overflow flag on the host. Use amp::FusedAdam, FusedAdamW or FusedSGD, or step "
              "outside the capture");
  // Note [deferred publish]: the all-gathers would be waited for outside the graph, at the next forward.
  TORCH_CHECK(!capturing || zero_ == nullptr || zero_->publish_mode() == ZeroPublish::kInStep,
              "amp::Optimizer::step() under ZeroPublish::kAtNextForward cannot be captured in a CUDA graph on ",
              device_,
              ": the parameter all-gather it starts completes at the next forward, outside the capture. Attach with "
              "ZeroPublish::kInStep to capture the step");
  // The amaxes were reduced and checked at the end of the step's unscaling scope; a step without one does it here.
  if (fp8_ != nullptr && !fp8_->reduced()) fp8_->reduce_and_check(step_found_inf_);
  if (fused_ != nullptr) {
    std::vector<at::Tensor> models;
    if (policy_.master_weights) {
      for (const auto& slot : slots_) models.push_back(slot.model);
    }
    if (zero_ != nullptr) {
      zero_->step(*fused_, step_found_inf_);  // the shard, then the all-gather into the model
    } else {
      fused_->fused_step(models, step_found_inf_);
    }
    outcome_->record(steps_, step_found_inf_, capturing);
  } else {
    // A plain torch::optim optimizer cannot skip on device: this read is the one host sync per step.
    const bool overflow = (unscaled_this_step_ || fp8_ != nullptr) && step_found_inf_.item<float>() != 0.0f;
    if (!overflow) optimizer_->step();
    outcome_->record(steps_, overflow);
    if (policy_.master_weights) {
      std::vector<at::Tensor> from, to;
      for (const auto& slot : slots_) {
        if (slot.has_master) {
          from.push_back(slot.master);
          to.push_back(slot.model);
        }
      }
      if (!overflow && !from.empty()) {
        at::NoGradGuard no_grad;
        kernels::scaled_copy_(from, to, 1.0);
      }
    }
  }
  if (fp8_ != nullptr) fp8_->update(step_found_inf_);  // histories and scales for the next step
  step_found_inf_.zero_();
  unscaled_this_step_ = false;
  ++steps_;
  if (!capturing) check_diagnostics();  // host reads: outside the capture only (replays run no host code)
  return result;
}

void State::zero_grad() {
  for (auto& slot : slots_) {
    slot.model.mutable_grad() = at::Tensor();
    if (slot.has_master) slot.master.mutable_grad() = at::Tensor();
  }
  if (zero_ != nullptr) zero_->zero_grad();
  stash_.clear();
  grads_scaled_ = false;
}

}  // namespace amp::detail
