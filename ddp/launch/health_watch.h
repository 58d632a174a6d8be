#pragma once

#include <chrono>
#include <optional>
#include <string>
#include <vector>

namespace ddp::detail {

struct ProgressRecord;

/// A pause (ddp::ProgressPause) may last this many hang timeouts before the paused worker counts as hung itself (a
/// save to a mount that stopped answering).
constexpr int kPauseTimeoutFactor = 5;

/// ddp-launch's hang detection (--hang-timeout-s): watches the progress records of this node's workers (Note
/// [progress records]) and names the worker that holds the others up.
///
/// A hang is a worker that has waited in a collective for the hang timeout without progress: it waits for a peer
/// that does not come. Work without collectives (an evaluation on every rank, an export) is never a hang, however
/// long. The worker named is the one the others wait for: of the workers not waiting in a collective (stopped,
/// deadlocked elsewhere, busy on their own), the one whose last event is oldest; when every worker waits in one
/// (the one they wait for is on another node), the oldest of them. A worker is watched once it has begun its second
/// training step (the first one, with its rendezvous, model broadcast and bucket rebuild, is not timed) and while it
/// runs. While a worker is paused (ddp::ProgressPause: a checkpoint save, an evaluation on rank 0) the others'
/// waits are not timed (they wait for it), for up to kPauseTimeoutFactor hang timeouts; a longer pause is a hang of
/// the paused worker. (Another node's pause is not seen here.)
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
    /// "made no progress for 60 s (--hang-timeout-s 60) while rank 0 waited for it; last seen after <event> in
    /// training step 12"
    std::string message;
    Clock::time_point last_progress;  ///< the named worker's last event
  };
  /// Looks at the records at `now` (call it every kStopPollInterval or so); `running[i]` says whether local worker i
  /// still runs (one that ended is not watched).
  std::optional<Hang> check(Clock::time_point now, const std::vector<bool>& running);

 private:
  struct Watched {
    int rank = 0;
    std::string path;
    ProgressRecord* record = nullptr;
    std::optional<Clock::time_point> last_progress;  ///< its last event
    int64_t steps = 0;                               ///< from its last whole record
    bool in_collective = false;
    bool paused = false;
    std::optional<Clock::time_point> paused_since;
    std::string where;
  };
  std::string describe(const Watched& w, Clock::time_point now, const std::string& waiting) const;

  std::vector<Watched> workers_;
  std::chrono::milliseconds timeout_;
  std::optional<Clock::time_point> last_pause_;  ///< when a worker was last seen paused: waits before it are not timed
};

}  // namespace ddp::detail
