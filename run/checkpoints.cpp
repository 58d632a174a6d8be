#include <run/checkpoints.h>

#include <stdexcept>
#include <utility>

#include <amp/io/checkpoint_dir.h>
#include <ddp/progress.h>
#include <fmt/format.h>

namespace run {

Checkpoints::Checkpoints(CheckpointOptions options) : options_(std::move(options)) {
  if (options_.keep_last <= 0) {
    throw std::invalid_argument(fmt::format("keep_last must be positive, got {}", options_.keep_last));
  }
  if (options_.every && *options_.every <= 0) {
    throw std::invalid_argument(fmt::format("every must be a positive number of steps, got {}", *options_.every));
  }
  if (!options_.folder.empty()) amp::CheckpointDir(options_.folder, options_.keep_last);  // refuses a file
}

std::optional<std::string> Checkpoints::newest(const std::function<void(const std::string& path)>& check,
                                               const std::function<void(const std::string& line)>& warn) const {
  if (options_.folder.empty()) return std::nullopt;
  const auto entry = amp::CheckpointDir(options_.folder, options_.keep_last).load_newest(check, warn);
  if (!entry) return std::nullopt;
  return entry->path;
}

std::string Checkpoints::save(int64_t steps, const std::function<void(const std::string& path)>& write,
                              bool writer) const {
  const ddp::ProgressPause pause("a checkpoint save");  // not timed by the launcher's hang detection
  if (options_.folder.empty()) {
    write(options_.file);
    return options_.file;
  }
  const amp::CheckpointDir dir(options_.folder, options_.keep_last);
  if (writer) return dir.save(steps, write);
  const std::string path = dir.path_for(steps);
  write(path);  // a collective save's other ranks: the writer writes the file
  return path;
}

bool Checkpoints::final_save_needed(const TrainingPosition& start, const TrainingPosition& end) const {
  const bool saved_by_due = end.steps > start.steps && due(end.steps);
  return enabled() && !saved_by_due;
}

}  // namespace run
