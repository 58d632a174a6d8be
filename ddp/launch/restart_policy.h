#pragma once

#include <string>
#include <utility>
#include <vector>

namespace ddp::detail {

/// ddp-launch's restart budget (--max-restarts, torchrun's meaning): a job may fail and be started again that many
/// times; each failure is kept, so that the launcher can list them all in order when it gives up.
class RestartBudget {
 public:
  explicit RestartBudget(int max_restarts) : max_restarts_(max_restarts) {}

  /// Records the failure of attempt `attempt` (its one-line cause); returns whether a restart is left for it. (The
  /// attempts are counted apart: an elastic job also restarts for a node that joins, which is not a failure.)
  bool record_failure(int attempt, const std::string& cause);

  /// The restarts made so far (TORCHELASTIC_RESTART_COUNT of the next attempt).
  int restarts() const { return restarts_; }
  int max_restarts() const { return max_restarts_; }
  const std::vector<std::pair<int, std::string>>& failures() const { return failures_; }  // attempt, cause

  /// "restart 1 of 3 after: <cause>": the line logged before starting the workers again.
  std::string restart_line() const;
  /// When the budget is spent: "gave up after N restarts (--max-restarts N); the failures in order:" and one
  /// "  attempt K: <cause>" line per failure, each line after `prefix`. Empty when --max-restarts is 0 (the
  /// failure's own summary says all).
  std::string give_up_summary(const std::string& prefix) const;

 private:
  int max_restarts_;
  int restarts_ = 0;
  std::vector<std::pair<int, std::string>> failures_;
};

}  // namespace ddp::detail
