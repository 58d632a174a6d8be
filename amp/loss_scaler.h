#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/util/ArrayRef.h>

#include <amp/options.h>

namespace torch::serialize {
class InputArchive;
class OutputArchive;
}  // namespace torch::serialize

namespace amp {

/// Settings of one loss scaler (see Options and Note [loss-scale state machine] in
/// kernels/multi_tensor/loss_scale_rule.h).
struct LossScalerConfig {
  /// true: update() moves the scale (dynamic scaling); false: the scale stays static_scale.
  bool dynamic = true;
  double static_scale = 1.0;  ///< the scale when !dynamic
  /// The initial scale when dynamic.
  double init_scale = LossScaleDefaults::kInitScale;
  /// Multiplies the scale after growth_interval clean steps (> 1).
  double growth_factor = LossScaleDefaults::kGrowthFactor;
  /// Multiplies the scale when it backs off (in (0, 1)).
  double backoff_factor = LossScaleDefaults::kBackoffFactor;
  /// Consecutive clean steps before the scale grows (>= 1).
  int64_t growth_interval = LossScaleDefaults::kGrowthInterval;
  /// The scale backs off at the n-th overflow since it last grew and at each later one (>= 1; 1: torch.amp's rule).
  int64_t hysteresis = LossScaleDefaults::kHysteresis;
  /// Floor of the scale (>= 0; 0: none).
  double min_scale = LossScaleDefaults::kMinScale;
  /// Ceiling of the scale (>= min_scale; +inf: none).
  double max_scale = LossScaleDefaults::kMaxScale;

  /// The loss-scaler settings of resolved amp::Options: dynamic_loss_scale, static_loss_scale and the
  /// dynamic-scaling settings (min_loss_scale / max_loss_scale become min_scale / max_scale).
  static LossScalerConfig from(const Options::Resolved& options);
};

/// What a scaler knew at its last completed snapshot (see LossScaler::diagnostics).
struct ScalerDiagnostics {
  int64_t step = -1;                   ///< the update() this snapshot was taken at (-1: none yet)
  double scale = 0.0;                  ///< the scale after that update
  bool found_inf = false;              ///< whether that step overflowed
  int64_t first_nonfinite_index = -1;  ///< index of the first tensor with a non-finite gradient, -1 if none
  int64_t skipped_steps = 0;           ///< overflowing steps so far
  int64_t floor_overflows = 0;         ///< consecutive overflowing steps with the scale at its floor (static: any)
  int64_t growth_tracker = 0;          ///< clean steps since the scale last moved (torch.amp's _growth_tracker)
};

/// One loss's scale and overflow state, all on one device, updated without host synchronization.
///
/// Per step: begin_step() zeroes the overflow flag; scale_loss() multiplies the loss by the scale;
/// unscale_and_check() divides gradients by it in place (fused kernel) and raises the flag on any inf/NaN;
/// update() moves the scale (dynamic scaling), counts a skipped step and starts an asynchronous copy of the
/// state to pinned host memory, which diagnostics() reads later without stalling the device.
class LossScaler {
 public:
  /// A scaler with `config` whose state lives on `device`: the scale at init_scale (dynamic) or static_scale,
  /// counters at 0. Throws c10::Error unless `device` is CPU or CUDA and the initial scale is finite and > 0;
  /// the dynamic-scaling settings are checked by the first update().
  LossScaler(const LossScalerConfig& config, const c10::Device& device);

  /// loss (any floating dtype, on this scaler's device) * scale, in fp32. No host sync.
  at::Tensor scale_loss(const at::Tensor& loss) const;
  /// Zeroes found_inf and the first-non-finite index for a new step.
  void begin_step();
  /// In place g *= 1/scale over `grads`; raises found_inf on any non-finite value and records the index
  /// (index_offset + position) of the first tensor holding one. No host sync.
  void unscale_and_check(at::TensorList grads, int64_t index_offset = 0);
  /// Ends the step: dynamic scaling moves the scale; skipped_steps += found_inf; snapshot for diagnostics.
  void update();

  /// fp32 scale. This and the tensors below are 1-element tensors on device(), for fused consumers that read
  /// them on the device.
  const at::Tensor& scale() const { return scale_; }
  /// fp32 1/scale (the reciprocal taken in fp64, as torch.amp): the factor unscale_and_check() applies.
  const at::Tensor& inv_scale() const { return inv_scale_; }
  /// fp32 overflow flag of the current step, nonzero once a non-finite gradient was seen. Callers may write it in
  /// place (GradScaler::update() does).
  const at::Tensor& found_inf() const { return found_inf_; }
  /// int32 index of the first tensor with a non-finite gradient this step (kernels::kNoNonFiniteIndex: none).
  const at::Tensor& first_nonfinite_index() const { return first_index_; }
  /// int32 count of clean steps since the scale last grew or backed off (torch.amp's _growth_tracker).
  const at::Tensor& growth_tracker() const { return growth_tracker_; }
  /// The device the state lives on.
  const c10::Device& device() const { return device_; }
  /// The settings given at construction.
  const LossScalerConfig& config() const { return config_; }
  /// Number of update() calls so far: the `step` a snapshot taken by the latest update() will carry.
  int64_t diagnostics_step() const { return steps_; }

  /// The newest snapshot whose copy has completed: on CUDA usually the previous step's; never blocks. While the
  /// stream captures a CUDA graph, update() takes no snapshot and this returns the last one read without touching
  /// the device; once an update() has been captured, each call outside capture starts a fresh snapshot that a
  /// later call reads (replays run no host code, and `step` does not count them).
  ScalerDiagnostics diagnostics();
  /// Blocks until the latest snapshot is available and returns it (a host sync: not for the step path). Refused
  /// while the stream captures a CUDA graph.
  ScalerDiagnostics diagnostics_now();

  /// Saves scale, trackers and counters (bit for bit) with the config, which load() checks. Host syncs: copies
  /// the state to the CPU.
  void save(torch::serialize::OutputArchive& archive) const;
  /// Restores what save() wrote. Throws c10::Error, leaving this scaler unchanged, when the archive is incomplete,
  /// from a different config, or holds malformed tensors or an invalid scale. After a load everything derived from
  /// the state is the loaded state's: diagnostics() at once reports the loaded step, scale, counters and growth
  /// tracker with found_inf false (snapshots taken before the load are discarded), and found_inf /
  /// first_nonfinite_index are cleared. Host syncs: reads the loaded values (not for the step path).
  void load(torch::serialize::InputArchive& archive);

 private:
  void take_snapshot();
  ScalerDiagnostics read_snapshot(const at::Tensor& host) const;

  LossScalerConfig config_;
  c10::Device device_;
  at::Tensor scale_, inv_scale_, growth_tracker_, hysteresis_tracker_, found_inf_, first_index_;
  at::Tensor skipped_steps_;    ///< fp64 counter on device
  at::Tensor floor_overflows_;  ///< fp64 counter on device
  int64_t steps_ = 0;
  // Double-buffered pinned snapshots [step, scale, found_inf, first_index, skipped] with completion events.
  struct Snapshot;
  std::vector<std::shared_ptr<Snapshot>> snapshots_;
  int64_t snapshot_slot_ = 0;
  int64_t snapshots_taken_ = 0;
  int64_t last_read_sequence_ = -1;
  bool snapshot_on_read_ = false;  ///< an update() was captured in a CUDA graph: snapshots are taken by the reads
  ScalerDiagnostics last_read_;
};

}  // namespace amp
