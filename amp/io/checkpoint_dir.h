#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace amp {

/// A folder of checkpoints named by step, for a job that resumes without a person's help (issue 23, item 2): save
/// every K steps into it, and on start load the newest checkpoint that loads, skipping a damaged newer one with a
/// warning that names it.
///
///     amp::CheckpointDir checkpoints("runs/cnn", /*keep_last=*/3);
///     const auto resumed = checkpoints.load_newest(
///         [&](const std::string& path) { amp::load_checkpoint(path, model, optimizer, extras); });
///     ...
///     if (step % save_every == 0) {
///       checkpoints.save(step, [&](const std::string& path) {
///         amp::save_checkpoint(path, model, optimizer, extras); });
///     }
///
/// Files are "step-<step, 12 digits>.pt"; other files in the folder (an atomic writer's ".step-...tmp.XXXXXX"
/// left by a killed writer included) are neither loaded nor removed. The writes themselves are the caller's:
/// amp::save_checkpoint (and write_file_atomically, save_archive_atomically) replace a file atomically, so a
/// checkpoint under its final name is whole. What "loads" means is the caller's too: amp::load_checkpoint verifies
/// every part's checksum before changing anything, so a truncated file or a flipped bit is skipped with the model
/// untouched. One process writes (with DDP: rank 0, or each rank its own folder); the folder is not a lock.
class CheckpointDir {
 public:
  /// One checkpoint in the folder.
  struct Entry {
    int64_t step = 0;  ///< the step in its file name (>= 0)
    std::string path;  ///< "<folder>/step-<step, 12 digits>.pt"
  };

  /// `keep_last` >= 1: save() removes all but the newest keep_last checkpoints after a write. The folder is created
  /// by the first save() (with its parents); a path that exists and is not a folder is refused here, one line.
  explicit CheckpointDir(std::string folder, int64_t keep_last = 3);

  /// The folder as given to the constructor.
  const std::string& folder() const { return folder_; }
  /// How many checkpoints save() and prune() keep (>= 1).
  int64_t keep_last() const { return keep_last_; }

  /// "<folder>/step-<step, 12 digits>.pt" (step >= 0).
  std::string path_for(int64_t step) const;

  /// The checkpoints in the folder, newest (highest step) first; none when the folder does not exist.
  std::vector<Entry> list() const;

  /// Calls `write(path_for(step))`, then removes the checkpoints older than the newest keep_last. A `write` that
  /// throws removes nothing (the exception goes on). Returns the path written.
  std::string save(int64_t step, const std::function<void(const std::string& path)>& write) const;

  /// Removes the checkpoints older than the newest keep_last (what save() does after its write), with their shard
  /// files when they are sharded ZeRO checkpoints ("<checkpoint>.zero-*", amp::save_checkpoint under ZeRO).
  void prune() const;

  /// Tries the checkpoints newest first with `load`; one whose `load` throws is skipped and `warn` gets one line
  /// naming its file and the reason ("skipping runs/cnn/step-000000000300.pt: <what load threw>"). Returns the one
  /// that loaded; nullopt when the folder holds none (a fresh run). When it holds some and none loads, throws
  /// std::runtime_error naming the folder and how many it tried (the warnings named each). `warn` defaults to one
  /// line on stderr.
  std::optional<Entry> load_newest(const std::function<void(const std::string& path)>& load,
                                   const std::function<void(const std::string& line)>& warn = {}) const;

 private:
  std::string in_folder(const std::string& name) const;  ///< "<folder>/<name>"

  std::string folder_;
  int64_t keep_last_;
};

/// Opens `path` as a LibTorch archive (torch::serialize::InputArchive) and reads every record in it, nested
/// archives included; throws std::runtime_error (one line: the path and a short reason) when it cannot. A check for
/// CheckpointDir::load_newest where the real load comes later: it finds a truncated or overwritten file, not a
/// flipped bit inside a tensor (amp::load_checkpoint's checksums do).
void check_archive_readable(const std::string& path);

}  // namespace amp
