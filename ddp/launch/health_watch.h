#pragma once

#include <chrono>
#include <optional>
#include <string>
#include <vector>

namespace ddp::detail {

struct ProgressRecord;

/// ddp-launch's hang detection (--hang-timeout-s): watches the progress records of this node's workers (Note
/// [progress records]) and names a worker that made no progress for the hang timeout.
///
/// A worker is watched once it has begun its second training step (the first step, with its rendezvous, model
/// broadcast and bucket rebuild, is not timed). While a worker is paused (ddp::ProgressPause: a checkpoint save, an
/// evaluation on rank 0), no worker of this node is timed: the others wait for it in their next collective; the
/// clocks start again when the pause ends. (Another node's pause is not seen here.) A worker that never reports (a
/// program without DistributedDataParallel) is never watched. When several watched workers are stuck, the one whose
/// last progress is oldest is named: the others stopped after it, waiting for it in a collective.
class HealthWatch {
 public:
  using Clock = std::chrono::steady_clock;

  /// Creates one progress file per worker in `folder` for this attempt ("attempt<k>-rank<r>.progress") and maps
  /// them; `ranks` are the workers' global ranks, in local-rank order.
  HealthWatch(const std::string& folder, int attempt, const std::vector<int>& ranks, std::chrono::milliseconds timeout);
  ~HealthWatch();
  HealthWatch(const HealthWatch&) = delete;
  HealthWatch& operator=(const HealthWatch&) = delete;

  /// The progress file of local worker `local_rank` (for its DDP_PROGRESS_FILE); "" when it could not be made.
  std::string file(int local_rank) const;

  struct Hang {
    int local_rank = 0;
    std::string message;  // "made no progress for 60 s (--hang-timeout-s 60); last seen waiting for <collective>
                          // in training step 12"
  };
  /// Looks at the records at `now` (call it every kStopPollInterval or so); a hang when a watched worker made no
  /// progress for the timeout.
  std::optional<Hang> check(Clock::time_point now);

 private:
  struct Watched {
    int rank = 0;
    std::string path;
    ProgressRecord* record = nullptr;
    std::optional<Clock::time_point> last_progress;  // its last event (now, while it is paused)
    int64_t steps = 0;                               // from its last whole record
    bool in_collective = false;
    std::string where;
  };
  std::vector<Watched> workers_;
  std::chrono::milliseconds timeout_;
  std::optional<Clock::time_point> last_pause_;  // when a worker was last seen paused: no worker hangs before
};

}  // namespace ddp::detail
