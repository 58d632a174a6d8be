#pragma once

// The exit codes a worker and its launcher agree on beyond 0 and failure (docs/clusters.md, "Preemption").

#include <stdexcept>
#include <string>

namespace ddp {

/// A worker that stopped on its stop signal at a step boundary after every rank saved its checkpoint exits with
/// this: "stopped, resumable; start the same command again to continue". It is sysexits.h's EX_TEMPFAIL ("a
/// temporary failure; the user is invited to retry"). ddp-launch and ddp::spawn do not count it as a failure: they
/// stop the job (no restart, nothing charged to --max-restarts) and exit with it too.
constexpr int kExitResumable = 75;

/// Thrown by a function run under ddp::spawn to end its worker with kExitResumable (a spawned worker has no main
/// to return from): spawn() then reports the job as stopped, resumable, instead of failed.
class ResumableStop : public std::runtime_error {
 public:
  /// `what`: how it stopped, e.g. "stopped on SIGTERM".
  explicit ResumableStop(const std::string& what) : std::runtime_error(what) {}
};

}  // namespace ddp
