#pragma once

// Where a run's checkpoints go and which one a restarted run continues from (docs/run.md, "What each piece promises"):
// one file rewritten at each save, or a folder of them by step (amp::CheckpointDir), saved every K steps and at the
// end.

#include <cstdint>
#include <functional>
#include <optional>
#include <string>

#include <run/run_state.h>

namespace run {

/// What a run saves, where, and how often.
struct CheckpointOptions {
  /// One file, written at each save (atomically: the writer's, e.g. amp::save_checkpoint); empty: none.
  std::string file;
  /// A folder of checkpoints by step (step-<12 digits>.pt), the newest keep_last kept; replaces `file`. A run
  /// started on it continues from the newest checkpoint that loads.
  std::string folder;
  /// With a folder: how many of the newest checkpoints a save keeps (older ones are deleted). Must be > 0.
  int64_t keep_last = 3;
  /// Also save every this many optimizer steps of the run (counted over resumes), not only at the end.
  std::optional<int64_t> every;
};

/// A run's checkpoints:
///
///     run::CheckpointOptions where;
///     where.folder = "runs/cnn";
///     where.every = 100;
///     run::Checkpoints checkpoints(where);
///     if (const auto newest = checkpoints.newest(amp::verify_checkpoint)) load(*newest);
///     ... after each step:
///     if (checkpoints.due(position.steps)) checkpoints.save(position.steps, write);
///     ... after the loop:
///     if (checkpoints.final_save_needed(start, position)) checkpoints.save(position.steps, write);
///
/// One process writes (rank 0); under ZeRO every rank takes part in the save, and save() on the others only calls
/// `write` with the same path (the collective), pruning nothing. Saves run in a ddp::ProgressPause: the launcher's
/// hang detection does not time them.
class Checkpoints {
 public:
  /// Throws std::invalid_argument (one line) for keep_last or every not positive, and for a folder path that is a file.
  explicit Checkpoints(CheckpointOptions options);

  /// The options it was built with.
  const CheckpointOptions& options() const { return options_; }
  /// Whether the run saves anywhere (a file or a folder).
  bool enabled() const { return !options_.file.empty() || !options_.folder.empty(); }

  /// The checkpoint a (re)started run continues from: in the folder, the newest whose `check(path)` does not throw;
  /// a newer one that throws is skipped with one line to `warn` ("skipping <path>: <why>"). nullopt without a folder
  /// or in a folder that holds none (a fresh start). Throws std::runtime_error when the folder holds some and none
  /// passes. Every process that calls it on the same files makes the same choice.
  std::optional<std::string> newest(const std::function<void(const std::string& path)>& check,
                                    const std::function<void(const std::string& line)>& warn = {}) const;

  /// Whether the run saves after its step `steps` (a multiple of `every`).
  bool due(int64_t steps) const { return enabled() && options_.every && steps % *options_.every == 0; }

  /// Writes the checkpoint of step `steps` with `write(path)`: to the file, or to the folder's file for the step,
  /// the folder then pruned to keep_last (by the `writer`). Returns the path.
  std::string save(int64_t steps, const std::function<void(const std::string& path)>& write, bool writer = true) const;

  /// Whether a run that went from `start` to `end` must still save its end: it saves somewhere, and the last
  /// due() save did not write `end` already.
  bool final_save_needed(const TrainingPosition& start, const TrainingPosition& end) const;

 private:
  CheckpointOptions options_;
};

}  // namespace run
