// amp::detail::State, stepping: step() and zero_grad().

#include <amp/state/state.h>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <amp/fp8/fp8_state.h>
#include <amp/optim/fused_optimizer.h>
#include <kernels/capture.h>

namespace amp::detail {

at::Tensor State::step(const torch::optim::Optimizer::LossClosure& closure) {
  at::Tensor result;
  if (closure) {  // as torch.optim: evaluated once, with gradients enabled, before the step
    at::AutoGradMode enable_grad(true);
    result = closure();
  }
  TORCH_CHECK(!losses_.grads_scaled(),
              "step() while gradients are still scaled: the last scale_loss used delay_unscale=true; "
              "finish the accumulation with delay_unscale=false before stepping");
  // Note [capture-safe step] (kernels/capture.h): only the fused path launches nothing but device work.
  const c10::Device& device = slots_.device();
  const bool capturing = kernels::is_capturing(device);
  TORCH_CHECK(fused_ != nullptr || !capturing,
              "amp::Optimizer::step() with a plain torch::optim optimizer cannot be captured in a CUDA graph on ",
              device,
              ": it reads the overflow flag on the host. Use amp::FusedAdam, FusedAdamW or FusedSGD, or step "
              "outside the capture");
  if (capturing) owner_->check_capturable(device);
  at::Tensor& found_inf = progress_.found_inf;
  // The amaxes were reduced and checked at the end of the step's unscaling scope; a step without one does it here.
  if (fp8_ != nullptr && !fp8_->reduced()) fp8_->reduce_and_check(found_inf);
  if (fused_ != nullptr) {
    owner_->step(*fused_, found_inf);
    progress_.outcome->record(progress_.steps, found_inf, capturing);
  } else {
    // A plain torch::optim optimizer cannot skip on device: this read is the one host sync per step. Only the
    // replicated owner takes one (ZeRO refuses it), so the masters are the slots'.
    const bool overflow = (progress_.unscaled || fp8_ != nullptr) && found_inf.item<float>() != 0.0f;
    if (!overflow) optimizer_->step();
    progress_.outcome->record(progress_.steps, overflow);
    if (!overflow) slots_.copy_masters_to_models();
  }
  if (fp8_ != nullptr) fp8_->update(found_inf);  // histories and scales for the next step
  found_inf.zero_();
  progress_.unscaled = false;
  ++progress_.steps;
  // Host reads: outside the capture only (replays run no host code).
  if (!capturing) {
    losses_.report_overflows(
        policy_.max_overflows_at_floor, [this](int64_t index) { return slots_.name(index); }, logger_);
  }
  return result;
}

void State::zero_grad() {
  slots_.clear_grads();
  owner_->zero_grad();
  losses_.clear_scaled();
}

}  // namespace amp::detail
