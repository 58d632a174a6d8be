#pragma once

#include <limits>
#include <map>
#include <memory>
#include <optional>

#include <ATen/core/Tensor.h>
#include <torch/arg.h>

#include <amp/loss_scaler.h>

namespace torch::optim {
class Optimizer;
}  // namespace torch::optim

namespace amp {

/// Options of amp::GradScaler. Defaults are torch.amp.GradScaler's: no floor (min_scale 0) and no ceiling
/// (max_scale +inf), so the scale follows torch.amp's trajectory bit for bit (a scale that backs off below the
/// smallest float becomes 0, as in torch.amp). min_scale / max_scale add a floor and a ceiling, e.g. amp::Options'
/// LossScaleDefaults (1 and 2^24); hysteresis > 1 tolerates overflows before backing off (Megatron's rule).
struct GradScalerOptions {
  /// The initial scale, in [min_scale, max_scale]. Default 2^16.
  TORCH_ARG(double, init_scale) = LossScaleDefaults::kInitScale;
  /// Multiplies the scale after growth_interval clean steps; > 1. Default 2.
  TORCH_ARG(double, growth_factor) = LossScaleDefaults::kGrowthFactor;
  /// Multiplies the scale when it backs off; in (0, 1). Default 0.5.
  TORCH_ARG(double, backoff_factor) = LossScaleDefaults::kBackoffFactor;
  /// Consecutive clean steps before the scale grows, >= 1. Default 2000.
  TORCH_ARG(int64_t, growth_interval) = LossScaleDefaults::kGrowthInterval;
  /// The scale backs off at the n-th overflow since it last grew and at each later one; n >= 1. Default 1
  /// (torch.amp's rule).
  TORCH_ARG(int64_t, hysteresis) = LossScaleDefaults::kHysteresis;
  /// Floor of the scale, finite and >= 0. Default 0 (none).
  TORCH_ARG(double, min_scale) = 0.0;
  /// Ceiling of the scale, >= min_scale. Default +inf (none).
  TORCH_ARG(double, max_scale) = std::numeric_limits<double>::infinity();
  /// false: scale() returns the loss unchanged, step() just steps, update() does nothing.
  TORCH_ARG(bool, enabled) = true;
};

/// torch.amp.GradScaler for LibTorch, for code that wants loss scaling without opt levels:
///
///   amp::GradScaler scaler;
///   scaler.scale(loss).backward();
///   scaler.unscale_(optimizer);            // optional, e.g. before clipping
///   scaler.step(optimizer);                // skips the step if a gradient is inf/NaN
///   scaler.update();
///
/// State lives on the loss's device (created at the first scale()). The only host synchronization is the one
/// step() needs to decide whether to call a plain torch::optim optimizer, as in torch.amp; amp's fused
/// optimizers skip on device instead. Options are validated at construction.
class GradScaler {
 public:
  /// With `device`, the state is created at once (needed to load() a checkpoint before the first scale()).
  explicit GradScaler(GradScalerOptions options = {}, std::optional<c10::Device> device = std::nullopt);

  /// loss * scale in fp32 (the loss itself when disabled). Creates the scaler state on loss.device().
  at::Tensor scale(const at::Tensor& loss);
  /// Divides the gradients of `optimizer`'s parameters by the scale in place and records overflow for it.
  /// Once per optimizer between update()s; throws on a second call.
  void unscale_(torch::optim::Optimizer& optimizer);
  /// Unscales if not yet done, then calls optimizer.step() unless a gradient was inf/NaN. Returns whether it
  /// stepped. Reads the overflow flag on the host (one sync per call). Once per optimizer between update()s.
  bool step(torch::optim::Optimizer& optimizer);
  /// Ends the iteration: overflow from every optimizer unscaled since the last update moves the scale.
  void update();

  /// The current scale (a host sync). 1.0 when disabled.
  double get_scale();
  /// Whether scaling is on (GradScalerOptions::enabled).
  bool is_enabled() const { return options_.enabled(); }
  /// The underlying device state; nullptr before the first scale().
  LossScaler* loss_scaler() { return scaler_.get(); }

  /// Saves the scaler state (LossScaler::save); writes nothing when disabled. Throws c10::Error when enabled
  /// and the state does not exist yet (no scale() and no device at construction).
  void save(torch::serialize::OutputArchive& archive) const;
  /// Restores the scaler state (LossScaler::load) and ends the iteration in progress: every optimizer may be
  /// unscaled and stepped again before the next update(). Throws c10::Error when the state does not exist yet
  /// (construct with the training device, or call scale() first), which is always the case when disabled.
  void load(torch::serialize::InputArchive& archive);

 private:
  enum class Stage { kReady, kUnscaled, kStepped };
  struct PerOptimizer {
    Stage stage = Stage::kReady;
    at::Tensor found_inf;
  };
  LossScaler& require_scaler(const char* caller);
  PerOptimizer& per_optimizer(torch::optim::Optimizer& optimizer);

  GradScalerOptions options_;
  std::unique_ptr<LossScaler> scaler_;
  std::map<const torch::optim::Optimizer*, PerOptimizer> optimizers_;
};

}  // namespace amp
