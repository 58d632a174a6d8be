#pragma once

// What a training run records about itself (docs/observability.md): each step's phases, the records of the logged
// steps and of each epoch, and their JSON lines (--metrics FILE).

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <ddp/timeline.h>
#include <torch/types.h>

namespace run {

/// The parts of a training step, in the order they run.
enum class Phase { kForward, kBackward, kOptimizer };

/// Times the phases of one step. A step function calls end(kForward) when the loss is computed, end(kBackward)
/// after backward(), end(kOptimizer) after the optimizer step. Only a timed step takes times: the steps the metrics
/// log (there, on CUDA, each end() waits for the device, so the times are the device's: a host sync on logged steps
/// only) and the steps a timeline records (there, on CUDA, as events on the current stream, without a sync).
/// Otherwise end() does nothing.
class StepPhases {
 public:
  using Clock = std::chrono::steady_clock;  ///< the host clock the phases are timed on

  /// An untimed step.
  StepPhases() = default;
  /// A step timed when `timed` (metrics) and recorded into `timeline` when it is recording (may be null).
  StepPhases(bool timed, const torch::Device& device, ddp::Timeline* timeline);

  /// The step begins (train_epoch calls it before the step function).
  void begin();
  /// `phase` has ended now and the next one begins.
  void end(Phase phase);
  /// The whole step has ended (train_epoch calls it once the loss is on the host).
  void finish();

  /// Whether the step takes times (the `timed` it was built with; false for an untimed step).
  bool timed() const { return timed_; }
  /// Milliseconds of `phase` (0 when the step was not timed or the step function did not mark it).
  double milliseconds(Phase phase) const;
  /// Milliseconds of the whole step, from begin() to finish() (0 when the step was not timed).
  double step_milliseconds() const;

 private:
  Clock::time_point now() const;                      ///< waits for the device first on a timed CUDA step
  std::optional<c10::Stream> current_stream() const;  ///< CUDA: the device's current stream

  bool timed_ = false;
  std::optional<torch::Device> cuda_;  ///< the device, when it is a CUDA one
  ddp::Timeline* timeline_ = nullptr;  ///< recording this step, else null
  Clock::time_point begin_{};
  Clock::time_point ends_[3]{};  ///< per Phase: when it ended; begin_ when not marked
  Clock::time_point finished_{};
  ddp::Timeline::Mark last_mark_;  ///< where the timeline's current phase began
  int last_phase_ = -1;            ///< the last phase ended, -1: none yet
};

/// One rank's part of a logged step, in milliseconds.
struct RankStepTimes {
  double step_ms = 0;       ///< the whole step, from taking the batch to the loss on the host
  double forward_ms = 0;    ///< its forward phase (StepPhases::end(Phase::kForward))
  double backward_ms = 0;   ///< its backward phase
  double optimizer_ms = 0;  ///< its optimizer step
  double comm_wait_ms = 0;  ///< backward blocked on communication (DDP's allreduces_done - backward_finished)
  double loss = 0;          ///< the rank's own step loss
};

/// A logged step: what rank 0 writes (--metrics, one JSON object per line) and the report draws.
struct StepRecord {
  int64_t step = 0;   ///< of the run, 1-based, counted over resumes
  int64_t epoch = 0;  ///< 1-based
  double loss = 0;    ///< mean of the ranks' step losses
  /// The learning rate of the optimizer's first parameter group.
  double lr = 0;
  std::optional<double> loss_scale;      ///< amp runs
  std::optional<int64_t> skipped_steps;  ///< amp runs: steps skipped for overflow so far
  std::optional<double> grad_norm;       ///< runs that clip: the norm before clipping
  double samples_per_s = 0;              ///< the job's, since the previous logged step
  std::vector<RankStepTimes> ranks;      ///< rank r's times
};

/// The end of an epoch.
struct EpochRecord {
  int64_t epoch = 0;                    ///< the epoch that ended, 1-based
  int64_t step = 0;                     ///< the run's step the epoch ended at
  double mean_loss = 0;                 ///< rank 0's mean step loss over the epoch (as its line prints it)
  std::optional<double> test_accuracy;  ///< 0..1, when the example evaluates
  double seconds = 0;                   ///< wall time of the epoch's training
};

/// What the run knows beyond the loss (ObservedRun::values): read on logged steps only, so it may sync.
struct StepValues {
  double lr = 0;                         ///< the learning rate of the optimizer's first parameter group
  std::optional<double> loss_scale;      ///< amp runs: the scale after this step; nullopt without amp
  std::optional<int64_t> skipped_steps;  ///< amp runs: steps skipped for overflow so far; nullopt without amp
  std::optional<double> grad_norm;       ///< runs that clip: the norm before clipping; nullopt otherwise
};

/// The JSON lines of --metrics (the schema is in docs/observability.md): {"type": "step", ...} and
/// {"type": "epoch", ...}, each one line without a line break inside.
std::string metrics_json(const StepRecord& record);
std::string metrics_json(const EpochRecord& record);

}  // namespace run
