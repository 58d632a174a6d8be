#pragma once

// What one training run records (docs/observability.md): which steps are logged and recorded, the one gather per
// logged step, the timeline's window, and the files rank 0 writes (metrics JSON lines, the HTML report, the Chrome
// trace). The examples' --metrics, --report and --timeline flags fill ObserveOptions; run::Monitor holds one.

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ddp/distributed_data_parallel.h>
#include <ddp/process_group.h>
#include <ddp/timeline.h>
#include <torch/types.h>

#include <run/metrics.h>

namespace run {

/// What a run records and where. The messages of check_observe_options() name the examples' flags (--metrics,
/// --metrics-every, --report, --timeline, --timeline-steps), one per field.
struct ObserveOptions {
  std::string metrics;                   ///< --metrics: JSON lines, rank 0; empty: none
  std::optional<int64_t> metrics_every;  ///< --metrics-every: log every this many steps (default_metrics_every)
  std::string report;                    ///< --report: the HTML report, rank 0; empty: none
  std::string timeline;                  ///< --timeline: Chrome trace JSON of the window, rank 0; empty: none
  std::string timeline_steps;  ///< --timeline-steps "A:B" (steps of the run, inclusive) or "A"; empty: the default
  bool resumed = false;        ///< the run continues a checkpoint: --metrics is appended to, not started over
};

/// Throws std::invalid_argument "<flag> '<path>': ..." unless `path` can be written: its folder exists and is
/// writable, and it is not a folder nor an existing file this process may not write. An empty path passes.
void check_output_path(const char* flag, const std::string& path);

/// --metrics-every's default aims at this many logged steps in a run, so that the report's curves have enough points
/// for a short run and not too many for a long one.
constexpr int64_t kLoggedStepsPerRun = 100;
/// --metrics-every's default for a run whose last step is `last_step` (counted from the run's start, so that a
/// resumed run logs the steps the unbroken one logs): last_step / kLoggedStepsPerRun rounded up, at least 1. A run of
/// 16 steps logs each, one of 1000 every 10th, one of 100000 every 1000th.
int64_t default_metrics_every(int64_t last_step);

/// Checks ObserveOptions before anything runs: each file can be written (check_output_path), --metrics-every positive
/// and only with --metrics or --report, --timeline-steps of the form A or A:B with 1 <= A <= B, at most
/// ddp::kMaxTimelineSteps steps, and only with --report or --timeline. Throws std::invalid_argument naming the flag
/// and its value.
void check_observe_options(const ObserveOptions& options);

/// The steps of the run (1-based, counted over resumes) the timeline records: --timeline-steps, or by default 3
/// steps after 3 of warm-up (the bucket rebuild), fitted into a short run; nullopt when neither --report nor
/// --timeline asks for one or the run has no step left. `first_step` is the first step this run takes,
/// `last_step` its last. Throws std::invalid_argument naming --timeline-steps when its window is not inside
/// first_step..last_step.
std::optional<ddp::TimelineWindow> timeline_window(const ObserveOptions& options, int64_t first_step,
                                                   int64_t last_step);

/// The run's parts the observer reads.
struct ObservedRun {
  std::string description;                      ///< the run's header line, for the report's configuration
  std::function<StepValues()> values;           ///< lr, loss scale, ...: called by rank 0 on logged steps
  const ddp::ProcessGroup* group = nullptr;     ///< per-rank times are gathered over it (null: one process)
  ddp::DistributedDataParallel* ddp = nullptr;  ///< its buckets go into the timeline, its wait into comm_wait_ms
};

/// Watches one training run. Every rank makes one; the logged steps and the timeline's window are the same
/// on every rank (chosen by the run's step count), so the gathers pair up.
class RunObserver {
 public:
  /// A run that takes steps `first_step`..`last_step` on `device`. Opens --metrics on rank 0 (appending when the run
  /// resumes) and attaches the timeline to `run.ddp`. Throws as timeline_window does.
  RunObserver(const ObserveOptions& options, int rank, int world_size, const torch::Device& device, ObservedRun run,
              int64_t first_step, int64_t last_step);
  ~RunObserver();
  RunObserver(const RunObserver&) = delete;
  RunObserver& operator=(const RunObserver&) = delete;

  /// Whether step `step` is logged (with --metrics or --report: a multiple of --metrics-every, and the run's last).
  bool logged(int64_t step) const;
  /// Before step `step`: its phase timer (timed on logged steps, recorded in the timeline's window).
  StepPhases begin_step(int64_t step);
  /// After step `step` of `epoch` with this rank's `loss`, `phases` and the job's `samples` in it. On a logged step:
  /// one allgather of the ranks' times (collective), and rank 0 writes the step's line. After the window's last step:
  /// the timeline is gathered (collective) and --timeline written.
  void end_step(int64_t step, int64_t epoch, double loss, const StepPhases& phases, int64_t samples);
  /// An epoch ended (rank 0 writes its line; the report keeps it). `paused_seconds` (its evaluation) is left out of
  /// the next logged step's samples/s.
  void end_epoch(const EpochRecord& record, double paused_seconds = 0.0);
  /// After the last step (every rank): gathers a window the run stopped inside, and writes --report on rank 0.
  void finish();

  /// The logged steps' records, in order (rank 0; empty on the other ranks).
  const std::vector<StepRecord>& steps() const { return steps_; }
  /// The ended epochs' records, in order (rank 0; empty on the other ranks).
  const std::vector<EpochRecord>& epochs() const { return epochs_; }
  /// The gathered window (rank r's events at [r]); empty before it is gathered.
  const std::vector<std::vector<ddp::TimelineEvent>>& timeline() const { return gathered_; }

 private:
  void write_line(const std::string& line);
  void open_metrics(int64_t first_step);
  void gather_window();

  ObserveOptions options_;
  int rank_;
  int world_size_;
  torch::Device device_;
  ObservedRun run_;
  int64_t first_step_;
  int64_t last_step_;
  int metrics_fd_ = -1;  ///< --metrics, opened for appending (rank 0)
  int64_t metrics_every_;
  std::shared_ptr<ddp::Timeline> timeline_;
  bool gathered_window_ = false;
  std::vector<StepRecord> steps_;
  std::vector<EpochRecord> epochs_;
  std::vector<std::vector<ddp::TimelineEvent>> gathered_;
  std::chrono::steady_clock::time_point last_logged_;
  double paused_seconds_ = 0.0;  ///< since last_logged_, not training (evaluations)
  int64_t samples_since_logged_ = 0;
};

}  // namespace run
