#include <amp/amp.h>

#include <exception>
#include <sstream>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/serialize/archive.h>

#include <kernels/l2_norm.h>

namespace amp {

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
  return kernels::clip_grad_norm_(optimizer.gradients(), max_norm, optimizer.found_inf());
}

namespace detail {

void save_checkpoint(const std::string& path, State& state) {
  torch::serialize::OutputArchive model, optimizer, amp_state, all;
  state.save_model(model);
  state.optimizer().save(optimizer);
  state.save(amp_state);
  all.write("model", model);
  all.write("optimizer", optimizer);
  all.write("amp", amp_state);
  all.save_to(path);
}

void load_checkpoint(const std::string& path, State& state) {
  torch::serialize::InputArchive all, model, optimizer, amp_state;
  try {
    all.load_from(path, state.device());
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "cannot read checkpoint '", path, "': ", e.what());
  }
  for (const auto& [key, archive] : {std::pair<const char*, torch::serialize::InputArchive*>{"model", &model},
                                     {"optimizer", &optimizer},
                                     {"amp", &amp_state}}) {
    TORCH_CHECK(all.try_read(key, *archive), "checkpoint '", path, "' has no '", key,
                "' part: write it with amp::save_checkpoint");
  }
  // Check model and amp parts without changing anything; then the optimizer, restored on failure; then apply.
  auto model_copies = state.prepare_model_load(model);
  state.validate_amp_state(amp_state);
  torch::serialize::OutputArchive before;
  state.optimizer().save(before);
  try {
    state.optimizer().load(optimizer);
  } catch (const std::exception& e) {
    std::stringstream bytes;
    before.save_to(bytes);
    torch::serialize::InputArchive restore;
    restore.load_from(bytes);
    state.optimizer().load(restore);
    TORCH_CHECK(false, "checkpoint '", path, "': the optimizer part does not fit this optimizer: ", e.what());
  }
  {
    at::NoGradGuard no_grad;
    for (auto& [dest, value] : model_copies) dest.copy_(value);
  }
  state.load(amp_state);
}

}  // namespace detail
}  // namespace amp
