#pragma once

// The signals a launcher (ddp-launch, ddp::spawn) takes for its workers and passes on to them.

#include <csignal>
#include <cstddef>
#include <iterator>

namespace ddp::detail {

/// The signals forwarded to the workers: a terminal's SIGINT, the SIGTERM of kill, Kubernetes and spot instances, and
/// the SIGUSR1/SIGUSR2 a cluster sends ahead of its time limit (`#SBATCH --signal=USR1@90`).
constexpr int kForwardedSignals[] = {SIGINT, SIGTERM, SIGUSR1, SIGUSR2};

/// While it lives, kForwardedSignals are caught (not fatal to this process) and recorded for the supervisor to
/// forward (WorkerGroup::wait's `pending_signal`); the previous handlers come back with its end, unless a signal
/// came and `ignore_after_signal` is set (ddp-launch, on its way out: a repeated signal must not kill it before it
/// reports how the job ended). One at a time per process.
class SignalForwarding {
 public:
  /// Installs the handler for kForwardedSignals (and clears what an earlier one recorded).
  explicit SignalForwarding(bool ignore_after_signal = false);
  /// Puts the previous handlers back, or (ignore_after_signal) leaves the signals ignored after one came.
  ~SignalForwarding();
  SignalForwarding(const SignalForwarding&) = delete;
  SignalForwarding& operator=(const SignalForwarding&) = delete;

  /// The signal to forward, 0 when none: WorkerGroup::wait forwards it and resets it.
  static volatile std::sig_atomic_t* pending();
  /// The last signal received while one lives (0: none), kept for the exit code.
  static int received();

 private:
  bool ignore_after_signal_;
  struct sigaction old_[std::size(kForwardedSignals)]{};
};

}  // namespace ddp::detail
