#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

namespace amp {

/// What amp::Optimizer::step() did, as read on the host (see StepOutcome::latest).
struct StepReport {
  int64_t step = -1;     ///< 0-based index of the step() call this describes (-1: none yet)
  bool skipped = false;  ///< whether that step was skipped because a gradient (or the clipped norm) was inf/NaN
};

/// Whether the last optimizer step was skipped: a device tensor written in the step (no host sync), and a copy of
/// it read lazily on the host, double-buffered like the loss scaler's diagnostics.
class StepOutcome {
 public:
  /// Allocates the flag on `device` (1-element fp32, 0: not skipped) and the host copies (pinned memory on CUDA).
  explicit StepOutcome(const c10::Device& device);
  ~StepOutcome();
  StepOutcome(const StepOutcome&) = delete;
  StepOutcome& operator=(const StepOutcome&) = delete;

  /// Records step `step`: skipped = (found_inf != 0), found_inf a 1-element fp32 flag on the device. No host sync:
  /// the host copy is asynchronous on CUDA. capturing (the stream captures a CUDA graph): only the device flag is
  /// written (a graph cannot record an event for the host to query; Note [capture-safe step] in kernels/capture.h),
  /// so latest() does not see captured steps; skipped() does, at each replay.
  void record(int64_t step, const at::Tensor& found_inf, bool capturing = false);
  /// Records step `step` whose outcome the host already knows.
  void record(int64_t step, bool skipped);
  /// 1-element fp32 on the device: 1 when the last recorded step was skipped, else 0. Kept until the next record.
  const at::Tensor& skipped() const { return skipped_; }
  /// The newest report whose host copy has completed; never blocks (on CUDA usually the previous step's).
  StepReport latest();
  /// Waits for the newest report (a host sync: not for the step path).
  StepReport latest_now();

 private:
  struct Slot;
  c10::Device device_;
  at::Tensor skipped_;
  std::vector<std::unique_ptr<Slot>> slots_;
  int64_t next_slot_ = 0;
  StepReport last_read_;
};

}  // namespace amp
