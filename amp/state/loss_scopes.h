#pragma once

// The scale_loss protocol's bookkeeping: one loss scaler per loss, which scope is being backpropagated, and which
// loss's scale delay_unscale gradients still carry. One of State's parts (Note [State's parts] in amp/state/state.h).
// Internal: users go through amp::scale_loss.

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <torch/serialize/archive.h>

#include <amp/loss_scaler.h>
#include <amp/options.h>

namespace amp::detail {

/// Steps between two overflow log lines (the first overflow is always logged): a line per step would drown
/// a log whenever the scale is settling.
inline constexpr int64_t kOverflowLogIntervalSteps = 100;

class LossScopes {
 public:
  LossScopes(const Options::Resolved& policy, const c10::Device& device);

  size_t size() const { return scalers_.size(); }
  /// The scaler of `loss_id`; throws naming num_losses when it is out of range.
  LossScaler& scaler(int64_t loss_id);

  /// scale_loss is about to scale `loss_id`'s loss: true when this starts a new unscale cycle, false when it
  /// continues the delay_unscale accumulation of the same loss (another loss is refused).
  bool starts_cycle(int64_t loss_id) const;
  /// The scope's backward may run from here until leave() or abandon().
  void enter(int64_t loss_id, bool delay_unscale);
  /// A scope left by an exception: none is active any more (nothing is unscaled).
  void abandon() { active_ = -1; }
  /// The scope ends: true when its gradients are to be unscaled now, false when delay_unscale leaves them scaled.
  bool leave(int64_t loss_id, bool delay_unscale);
  /// The gradients were unscaled (or dropped): none carries a scale any more.
  void clear_scaled() { scaled_ = -1; }
  /// A delay_unscale scope left scaled gradients behind.
  bool grads_scaled() const { return scaled_ >= 0; }
  /// Outside every scope (nothing is being backpropagated under scale_loss).
  bool idle() const { return active_ < 0; }
  /// The scaler of the scope being backpropagated when that scope unscales; null outside a scope or under
  /// delay_unscale (DDP then writes its plain average back).
  LossScaler* unscaling() { return active_ >= 0 && !active_delay_unscale_ ? scalers_[active_].get() : nullptr; }

  /// After each step: logs an overflow at most once per kOverflowLogIntervalSteps per loss, naming the first
  /// non-finite gradient's parameter, and throws when a loss overflowed `max_overflows_at_floor` consecutive steps
  /// at the floor (0: never). Reads the scalers' lazily copied diagnostics (no host sync on the step).
  void report_overflows(int64_t max_overflows_at_floor, const std::function<std::string(int64_t)>& name_of,
                        const std::function<void(const std::string&)>& logger);

  void save(torch::serialize::OutputArchive& archive) const;
  /// Checks that load() would succeed (every scaler loads into a scratch copy), changing nothing.
  void validate(torch::serialize::InputArchive& archive) const;
  /// Every scaler restored (after validate()); the overflow log's step bookkeeping restarts from the loaded steps.
  void load(torch::serialize::InputArchive& archive);

 private:
  std::vector<std::unique_ptr<LossScaler>> scalers_;
  int64_t active_ = -1;  ///< the loss of the scope being backpropagated, -1 outside one
  bool active_delay_unscale_ = false;
  int64_t scaled_ = -1;  ///< the loss whose scale delay_unscale gradients carry, -1 when none does
  std::vector<int64_t> last_logged_step_;
  std::vector<int64_t> overflows_since_log_;
};

}  // namespace amp::detail
