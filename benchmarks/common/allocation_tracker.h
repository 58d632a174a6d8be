#pragma once

// Bytes a thread holds and the most it held, from the allocators themselves: the CPU allocator and CUDA's caching
// allocator report every allocation and free to the thread's memory profiler (c10::reportMemoryUsageToProfiler),
// which is what torch.profiler's profile_memory reads. Installed for the whole program, so that every block freed
// was seen allocated. Counts one device; the sizes are the allocations' (the caching allocator's rounding, not its
// reserved pool).

#include <algorithm>
#include <cstdint>
#include <memory>

#include <c10/core/Allocator.h>
#include <c10/core/Device.h>
#include <c10/util/ThreadLocalDebugInfo.h>

namespace bench {

class AllocationTracker final : public c10::MemoryReportingInfoBase {
 public:
  explicit AllocationTracker(c10::Device device) : device_(device) {}

  bool memoryProfilingEnabled() const override { return true; }
  void reportMemoryUsage(void* /*ptr*/, int64_t alloc_size, size_t /*total_allocated*/, size_t /*total_reserved*/,
                         c10::Device device) override {
    if (device.type() != device_.type()) return;
    current_ += alloc_size;
    peak_ = std::max(peak_, current_);
  }

  /// Bytes allocated and not freed since the tracker was installed.
  int64_t current() const { return current_; }
  /// The most current() was since the last reset_peak().
  int64_t peak() const { return peak_; }
  void reset_peak() { peak_ = current_; }

 private:
  c10::Device device_;
  int64_t current_ = 0;
  int64_t peak_ = 0;
};

/// Installs a tracker on this thread while alive.
class TrackAllocations {
 public:
  explicit TrackAllocations(c10::Device device)
      : tracker_(std::make_shared<AllocationTracker>(device)), guard_(c10::DebugInfoKind::PROFILER_STATE, tracker_) {}
  AllocationTracker& tracker() { return *tracker_; }

 private:
  std::shared_ptr<AllocationTracker> tracker_;
  c10::DebugInfoGuard guard_;
};

}  // namespace bench
