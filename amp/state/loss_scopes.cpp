#include <amp/state/loss_scopes.h>

#include <sstream>

#include <c10/util/Exception.h>

namespace amp::detail {

LossScopes::LossScopes(const Options::Resolved& policy, const c10::Device& device) {
  for (int64_t i = 0; i < policy.num_losses; ++i) {
    scalers_.push_back(std::make_unique<LossScaler>(LossScalerConfig::from(policy), device));
  }
  last_logged_step_.assign(scalers_.size(), -kOverflowLogIntervalSteps);
  overflows_since_log_.assign(scalers_.size(), 0);
}

LossScaler& LossScopes::scaler(int64_t loss_id) {
  TORCH_CHECK(loss_id >= 0 && loss_id < static_cast<int64_t>(scalers_.size()), "loss_id ", loss_id,
              " is out of range: initialize was called with num_losses=", scalers_.size());
  return *scalers_[static_cast<size_t>(loss_id)];
}

bool LossScopes::starts_cycle(int64_t loss_id) const {
  if (scaled_ < 0) return true;
  TORCH_CHECK(loss_id == scaled_, "scale_loss with loss_id ", loss_id, " while gradients still carry loss ", scaled_,
              "'s scale (delay_unscale=true): finish that loss with delay_unscale=false first");
  return false;
}

void LossScopes::enter(int64_t loss_id, bool delay_unscale) {
  active_ = loss_id;
  active_delay_unscale_ = delay_unscale;
}

bool LossScopes::leave(int64_t loss_id, bool delay_unscale) {
  active_ = -1;
  if (!delay_unscale) return true;
  scaled_ = loss_id;
  return false;
}

void LossScopes::report_overflows(int64_t max_overflows_at_floor, const std::function<std::string(int64_t)>& name_of,
                                  const std::function<void(const std::string&)>& logger) {
  // With one loss its id says nothing ("loss 0" reads as a loss of 0); with several it says which.
  const auto which = [&](size_t id) {
    return scalers_.size() == 1 ? std::string() : " in loss_id " + std::to_string(id);
  };
  for (size_t id = 0; id < scalers_.size(); ++id) {
    const ScalerDiagnostics d = scalers_[id]->diagnostics();
    if (d.step < 0 || !d.found_inf) continue;
    ++overflows_since_log_[id];
    if (max_overflows_at_floor > 0 && d.floor_overflows >= max_overflows_at_floor) {
      TORCH_CHECK(false, "amp: the gradients", which(id), " have overflowed for ", d.floor_overflows,
                  " consecutive steps with the loss scale at the floor (", d.scale,
                  "); the first non-finite gradient is in '", name_of(d.first_nonfinite_index),
                  "'. Training is diverging: lower the learning rate, check the data, or raise min_loss_scale");
    }
    if (d.step - last_logged_step_[id] >= kOverflowLogIntervalSteps) {
      std::ostringstream line;
      line << "amp: gradient overflow" << which(id) << " at step " << d.step << ": loss scale now " << d.scale
           << ", first non-finite gradient in '" << name_of(d.first_nonfinite_index) << "'; "
           << overflows_since_log_[id] << " overflow(s) since the last report, " << d.skipped_steps
           << " skipped step(s) in total";
      if (logger) logger(line.str());
      last_logged_step_[id] = d.step;
      overflows_since_log_[id] = 0;
    }
  }
}

void LossScopes::save(torch::serialize::OutputArchive& archive) const {
  for (size_t id = 0; id < scalers_.size(); ++id) {
    torch::serialize::OutputArchive sub;
    scalers_[id]->save(sub);
    archive.write("loss_scaler" + std::to_string(id), sub);
  }
}

void LossScopes::validate(torch::serialize::InputArchive& archive) const {
  // Load every scaler into a scratch copy: a bad archive throws here, before anything changed.
  for (size_t id = 0; id < scalers_.size(); ++id) {
    torch::serialize::InputArchive sub;
    TORCH_CHECK(archive.try_read("loss_scaler" + std::to_string(id), sub), "amp checkpoint has no loss_scaler", id);
    LossScaler(scalers_[id]->config(), scalers_[id]->device()).load(sub);
  }
}

void LossScopes::load(torch::serialize::InputArchive& archive) {
  for (size_t id = 0; id < scalers_.size(); ++id) {
    torch::serialize::InputArchive sub;
    archive.try_read("loss_scaler" + std::to_string(id), sub);
    scalers_[id]->load(sub);
  }
  last_logged_step_.assign(scalers_.size(), -kOverflowLogIntervalSteps);
  overflows_since_log_.assign(scalers_.size(), 0);
}

}  // namespace amp::detail
