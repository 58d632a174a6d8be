#pragma once

// Progress a worker reports to its launcher, for hang detection (ddp-launch --hang-timeout-s; docs/launcher.md,
// "Faults"). DistributedDataParallel and ProcessGroup report their steps and collectives themselves; a program adds
// nothing unless it does long work of its own on one rank while the others wait (an evaluation or a save on rank 0
// only, a long data load): it wraps that in a ProgressPause. Without the launcher's DDP_PROGRESS_FILE every call
// here does nothing.

#include <string>

namespace ddp {

/// While alive, this rank is busy with work that hang detection must not time (a checkpoint save, an evaluation):
/// the launcher does not count the time as a hang of this rank. Pauses nest.
class ProgressPause {
 public:
  /// `what` says what the rank is doing ("saving a checkpoint"), shown if it is seen last before a hang.
  explicit ProgressPause(const char* what) noexcept;
  ~ProgressPause();
  ProgressPause(const ProgressPause&) = delete;
  ProgressPause& operator=(const ProgressPause&) = delete;
};

/// Reports progress of the program's own (a step of a loop that uses no DistributedDataParallel), `where` naming it.
void report_progress(const char* where) noexcept;

namespace detail {
/// A training step begins (DistributedDataParallel's forward with grad mode on).
void report_step() noexcept;
/// Waiting for the collective `what` begins; collective_end() when it completed (or failed).
void report_collective_begin(const std::string& what) noexcept;
void report_collective_end() noexcept;
}  // namespace detail

}  // namespace ddp
