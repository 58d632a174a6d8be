#pragma once

#include <chrono>
#include <cstdint>
#include <cstdio>

namespace run {

/// How a training loop shows its progress (issue 24, item 1), chosen by where the output goes.
enum class ProgressStyle {
  /// stdout is a terminal: one line that rewrites itself with a carriage return.
  kTerminal,
  /// stdout is a file or a pipe: a plain line every --progress-every seconds and at each epoch's end, never a
  /// carriage return (a log keeps one readable line per report, not one long line per epoch).
  kLines,
  /// --quiet: no progress at all (the header, the saves and each epoch's result still print).
  kQuiet,
};

/// kQuiet when `quiet`, else kTerminal when `out` is a terminal, else kLines.
ProgressStyle progress_style(bool quiet, std::FILE* out);

/// The progress of one process's epochs: "epoch E/N [###...] S/T mean loss L | R samples/s | ETA m:ss" on a
/// terminal, "epoch E/N step S/T mean loss L | R samples/s | ETA m:ss" as plain lines. The mean loss is the running
/// mean of this process's step losses in the epoch; samples/s counts every rank's samples; the ETA is the epoch's
/// remaining steps at the epoch's mean step time so far. Times come from the caller, so that a test can drive it
/// with a clock of its own (no sleeps).
class Progress {
 public:
  using Clock = std::chrono::steady_clock;  ///< the clock of the `now` arguments

  /// `every_seconds`: kLines's interval (0: a line after every step); a terminal redraws at most every 0.2 s.
  Progress(ProgressStyle style, double every_seconds, std::FILE* out = stdout);

  /// An epoch of `steps` steps starts at step `first_step` (> 0 in an epoch a --resume continues), at `now`.
  void begin_epoch(int epoch, int epochs, int64_t steps, int64_t first_step, Clock::time_point now);
  /// Step `done` (1-based, of the epoch's steps) has ended at `now`. Shows it when its interval has passed, at the
  /// epoch's last step, or when `last` (the loop stops here).
  void step_done(int64_t done, double mean_loss, double samples_per_second, Clock::time_point now, bool last);
  /// Before other output in the middle of an epoch (a save's line): ends a rewritten terminal line.
  void interrupt();
  /// After the epoch's last step_done: ends a rewritten terminal line.
  void end_epoch();

 private:
  void show(int64_t done, double mean_loss, double samples_per_second, Clock::time_point now);

  ProgressStyle style_;
  Clock::duration every_;
  std::FILE* out_;
  int epoch_ = 0;
  int epochs_ = 0;
  int64_t steps_ = 0;
  int64_t first_step_ = 0;
  Clock::time_point start_{};
  Clock::time_point last_shown_{};
  bool shown_any_ = false;
  size_t open_line_width_ = 0;  ///< characters of the terminal line being rewritten; 0: none open
};

}  // namespace run
