#pragma once

#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>

namespace amp {

/// RAII autocast region for one device type, the C++ counterpart of `with torch.autocast(...)`.
///
/// On entry it saves the thread's autocast state for `device_type` (enabled flag, dtype) and the cast-cache
/// flag, then sets them and increments the nesting depth. On exit it restores all three and, when the
/// outermost region closes, clears the cast cache: otherwise cached low-precision copies of fp32 weights would
/// outlive an optimizer step and the next forward would use stale weights (see Note [autocast cache]).
///
/// device_type: kCUDA or kCPU. dtype: kHalf or kBFloat16 (kHalf on CPU is accepted: LibTorch's CPU autocast
/// supports it for the ops that have fp16 CPU kernels). enabled=false opens a region with autocast off,
/// to run a piece of a model in full precision inside an autocast region. State is thread-local, like
/// at::autocast: open the region on the thread that runs forward; backward needs none.
/// Not copyable or movable: it is a scope.
class AutocastScope {
 public:
  /// Opens the region: saves the thread's autocast state for `device_type`, then sets it to `enabled` and `dtype`
  /// and the cast cache to `cache_enabled`. Throws (c10::Error) for a device type other than kCUDA or kCPU, or a
  /// dtype other than kHalf or kBFloat16.
  AutocastScope(c10::DeviceType device_type, c10::ScalarType dtype, bool enabled = true, bool cache_enabled = true);
  ~AutocastScope();
  AutocastScope(const AutocastScope&) = delete;
  AutocastScope& operator=(const AutocastScope&) = delete;
  AutocastScope(AutocastScope&&) = delete;
  AutocastScope& operator=(AutocastScope&&) = delete;

 private:
  c10::DeviceType device_type_;
  bool saved_enabled_;
  c10::ScalarType saved_dtype_;
  bool saved_cache_enabled_;
};

/// The low-precision dtype autocast uses for `device_type` by default (CUDA: kHalf, CPU: kBFloat16).
c10::ScalarType default_autocast_dtype(c10::DeviceType device_type);

}  // namespace amp
