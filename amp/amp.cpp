#include <amp/amp.h>

#include <exception>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <amp/fp8/fp8_state.h>

namespace amp {

std::vector<std::string> Optimizer::fp8_report() const {
  return state_->fp8() != nullptr ? state_->fp8()->report() : std::vector<std::string>();
}

ScaledLoss::ScaledLoss(Optimizer& optimizer, const at::Tensor& loss, int64_t loss_id, bool delay_unscale)
    : state_(optimizer.state_ptr()),
      loss_id_(loss_id),
      delay_unscale_(delay_unscale),
      uncaught_at_start_(std::uncaught_exceptions()) {
  scaled_ = state_->begin_loss(loss, loss_id, delay_unscale);
}

ScaledLoss::ScaledLoss(ScaledLoss&& other) noexcept
    : state_(std::move(other.state_)),
      scaled_(std::move(other.scaled_)),
      loss_id_(other.loss_id_),
      delay_unscale_(other.delay_unscale_),
      uncaught_at_start_(other.uncaught_at_start_),
      active_(other.active_) {
  other.active_ = false;
}

ScaledLoss::~ScaledLoss() noexcept(false) {
  if (!active_ || !state_) return;
  // Leaving the scope because of an exception: the gradients may be half-written; leave them alone rather than
  // throw a second exception from here.
  if (std::uncaught_exceptions() > uncaught_at_start_) {
    state_->abandon_loss();
    return;
  }
  state_->end_loss(loss_id_, delay_unscale_);
}

void ScaledLoss::backward(bool retain_graph) { scaled_.backward({}, retain_graph); }

ScaledLoss scale_loss(const at::Tensor& loss, Optimizer& optimizer, int64_t loss_id, bool delay_unscale) {
  return ScaledLoss(optimizer, loss, loss_id, delay_unscale);
}

at::Tensor clip_grad_norm_(Optimizer& optimizer, double max_norm) {
  return optimizer.state().clip_grad_norm_(max_norm);  // over every rank's shard under ZeRO
}

}  // namespace amp
