#pragma once

// What a training loop calls once per step to be watched: the progress line, the metrics JSON lines, the HTML report
// and the timeline (docs/run.md). One object, fed by the loop; it owns a run::Progress and a run::RunObserver.

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <optional>

#include <torch/optim/optimizer.h>
#include <torch/types.h>

#include <run/metrics.h>
#include <run/observer.h>
#include <run/progress.h>
#include <run/run_state.h>

namespace amp {
class Optimizer;
}

namespace run {

/// What the metrics log beside the loss for a run that steps `optimizer`: the learning rate of its first parameter
/// group and, with amp, `amp_optimizer`'s loss scale and skipped steps (read with a host sync: ObservedRun::values is
/// called on logged steps only).
StepValues step_values(torch::optim::Optimizer& optimizer, amp::Optimizer* amp_optimizer = nullptr);

/// How a run is watched.
struct MonitorOptions {
  /// The progress line (run::progress_style picks it from the output: a terminal, a file or a pipe); shown by rank 0
  /// only, on stdout.
  ProgressStyle progress = ProgressStyle::kLines;
  /// kLines: a line every this many seconds (0: every step) and at each epoch's end.
  double progress_every_seconds = 10.0;
  /// The run's epochs ("epoch E/N").
  int64_t epochs = 1;
  /// The files the run writes (rank 0): metrics JSON lines, HTML report, Chrome trace; none by default.
  ObserveOptions observe;
  /// The run's first step (counted over resumes, 1-based: > 1 when it continues a checkpoint) and its last (the
  /// metrics log it; the timeline's default window fits into them). Every rank passes the same.
  int64_t first_step = 1;
  int64_t last_step = 1;  ///< the run's last step (run::last_step computes it); see first_step
};

/// Watches one training run from a loop of the user's own:
///
///     run::Monitor monitor(options, group.rank(), group.size(), device, {header, values, &group, &ddp});
///     for (...epochs...) {
///       monitor.begin_epoch(epoch, sampler.batches_per_epoch(), sampler.batches_done());
///       while (const auto indices = sampler.next()) {
///         run::StepPhases& phases = monitor.begin_step();
///         ... forward; phases.end(run::Phase::kForward); backward; phases.end(run::Phase::kBackward); step ...
///         monitor.step(loss.item<double>(), indices->numel() * group.size());
///       }
///       monitor.end_epoch(test_accuracy);   // or std::nullopt
///     }
///     monitor.finish();                      // writes the report
///
/// Every rank makes one and calls it alike: a logged step gathers the ranks' times (one allgather), the timeline's
/// last step gathers the window. Only rank 0 prints and writes files. The loss passed to step() is a host value: the
/// loop's one sync per step (the progress line needs it); the monitor adds a sync on logged steps only
/// (ObservedRun::values, the phase times on CUDA).
class Monitor {
 public:
  using Clock = std::chrono::steady_clock;  ///< the clock of the epoch times and the progress line

  /// Opens the metrics file on rank 0 (appended to when options.observe.resumed). Throws as RunObserver does.
  Monitor(const MonitorOptions& options, int rank, int world_size, const torch::Device& device, ObservedRun run = {},
          std::FILE* out = stdout);
  Monitor(const Monitor&) = delete;
  Monitor& operator=(const Monitor&) = delete;

  /// Epoch `epoch` of `batches` steps begins at batch `first_batch` (> 0 in an epoch a resume continues), the losses
  /// of its steps before that being `so_far` (TrainingPosition::epoch_loss from the checkpoint): the epoch's mean
  /// loss then covers the whole epoch, as the unbroken run's does.
  void begin_epoch(int64_t epoch, int64_t batches, int64_t first_batch = 0, const EpochLoss& so_far = {});
  /// The next step begins: its phase timer, started (timed on logged steps, recorded in the timeline's window).
  StepPhases& begin_step();
  /// The step ended with this rank's `loss` and the job's `samples` (all ranks'). On a logged step: one allgather
  /// (collective) and rank 0 writes its metrics line. Updates the progress line; `last`: the loop stops after this
  /// step (the line is shown whatever its interval).
  void step(double loss, int64_t samples, bool last = false);
  /// Before a line of the loop's own in mid-epoch (a save's): ends a rewritten terminal line.
  void interrupt();
  /// The epoch's training has ended (its evaluation follows): ends the progress line. Returns the mean of this rank's
  /// step losses in the epoch (with the losses begin_epoch was given). Optional: end_epoch calls it.
  double epoch_trained();
  /// The epoch has ended, after its evaluation when it has one (`test_accuracy`, 0..1): rank 0 writes its metrics
  /// line and the report keeps it. The time since epoch_trained() is left out of the next logged step's samples/s.
  void end_epoch(std::optional<double> test_accuracy = std::nullopt);
  /// After the last step (every rank): gathers a timeline window the run stopped inside, writes the report.
  void finish();

  /// The step the next begin_step() starts (run steps, 1-based).
  int64_t next_step() const { return next_step_; }
  /// The mean of this rank's step losses so far in the epoch.
  double epoch_mean_loss() const;
  /// The RunObserver it feeds: the logged steps, the epochs and the gathered timeline.
  const RunObserver& observer() const { return observer_; }

 private:
  int64_t epochs_;
  Progress progress_;
  RunObserver observer_;
  int64_t next_step_;
  int64_t epoch_ = 0;
  int64_t batch_ = 0;  ///< batches of the epoch done
  EpochLoss loss_;
  int64_t samples_ = 0;  ///< the job's samples since begin_epoch
  Clock::time_point epoch_start_{};
  std::optional<Clock::time_point> trained_;  ///< epoch_trained() was called, then
  std::optional<StepPhases> phases_;          ///< the step in progress
};

}  // namespace run
