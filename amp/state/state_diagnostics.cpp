// amp::detail::State, diagnostics: parameter names and the lazily read overflow reports.

#include <amp/state/state.h>

#include <sstream>
#include <string>

#include <c10/util/Exception.h>

namespace amp::detail {

std::string State::param_name(int64_t index) const {
  if (index < 0 || index >= static_cast<int64_t>(slots_.size())) return "<none>";
  return slots_[index].name;
}

void State::check_diagnostics() {
  for (size_t id = 0; id < scalers_.size(); ++id) {
    const ScalerDiagnostics d = scalers_[id]->diagnostics();
    if (d.step < 0 || !d.found_inf) continue;
    ++overflows_since_log_[id];
    if (policy_.max_overflows_at_floor > 0 && d.floor_overflows >= policy_.max_overflows_at_floor) {
      TORCH_CHECK(false, "amp: loss ", id, " has overflowed for ", d.floor_overflows,
                  " consecutive steps with its loss scale at the floor (", d.scale,
                  "); the first non-finite gradient is in '", param_name(d.first_nonfinite_index),
                  "'. Training is diverging: lower the learning rate, check the data, or raise min_loss_scale");
    }
    if (d.step - last_logged_step_[id] >= kOverflowLogIntervalSteps) {
      std::ostringstream line;
      line << "amp: gradient overflow (loss " << id << ", step " << d.step << "): scale now " << d.scale
           << ", first non-finite gradient in '" << param_name(d.first_nonfinite_index) << "'; "
           << overflows_since_log_[id] << " overflow(s) since the last report, " << d.skipped_steps
           << " skipped step(s) in total";
      if (logger_) logger_(line.str());
      last_logged_step_[id] = d.step;
      overflows_since_log_[id] = 0;
    }
  }
}

}  // namespace amp::detail
