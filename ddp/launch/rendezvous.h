#pragma once

#include <chrono>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace ddp::detail {

class JobStore;

/// How round R of an elastic job ended: the nodes that run attempt R, or the end of the job.
struct RoundOutcome {
  int round = 0;
  bool ended = false;        ///< node 0 ended the job in this round: no attempt follows
  int exit_code = 0;         ///< when ended: node 0's exit code
  std::vector<int> members;  ///< the node ids (--node-rank) that run the attempt, ascending: node rank = position
  std::string message;       ///< what node 0 says with it: its restart line, or how the job ended (may be empty)

  /// The node rank of node `id` in this attempt; -1 when it does not take part.
  int node_rank_of(int id) const;
};

/// The outcome as the store keeps it, and back (throws on text that is no outcome).
std::string encode_outcome(const RoundOutcome& outcome);
RoundOutcome decode_outcome(int round, const std::string& text);

/// The start of the cause of a restart for a change of the nodes (a node asked to join): such restarts are not
/// charged to --max-restarts.
constexpr const char* kMembershipChange = "membership change: ";

/// Elastic membership (--nnodes MIN:MAX), agreed through node 0's job store: before each attempt, every node joins
/// that attempt's round, and node 0 closes it as soon as all MAX nodes are in, or once MIN are and --rejoin-wait-s
/// has passed since it opened (a lost node gets that long to come back). The nodes' ranks follow their ids. A node
/// that joins a round already closed is admitted at the next; node 0 restarts the running attempt for it
/// (newcomer()). Node 0 hosts the store: it cannot be lost.
class Rendezvous {
 public:
  struct Options {
    int id = 0;  ///< this node's --node-rank
    int min_nodes = 1;
    int max_nodes = 1;
    std::chrono::milliseconds rejoin_wait{30000};
    std::chrono::milliseconds timeout{600000};  ///< how long a node waits for a round to close; node 0, for MIN nodes
    std::function<bool()> interrupted;          ///< polled while waiting: the launcher was asked to stop
  };
  Rendezvous(JobStore& store, Options options);

  /// Node 0: opens round `round` and closes it as described above, sending `message` with its outcome. Throws one
  /// line when fewer than MIN nodes joined within the timeout. nullopt when interrupted.
  std::optional<RoundOutcome> host(int round, const std::string& message);
  /// Any other node: joins round `round`, and the next ones while a round closes without it, until it is admitted or
  /// node 0 ends the job. Throws one line on a timeout or another node with this id. nullopt when interrupted.
  std::optional<RoundOutcome> join(int round);
  /// Node 0, while attempt `round` - 1 runs: the cause of a restart when a node waits to join round `round`.
  std::optional<std::string> newcomer(int round);
  /// Node 0: ends the job in round `round` (exit code and message for the nodes that come to it), and waits, up to
  /// `wait`, until those that joined it, and at least `expected` nodes, have read that.
  void end(int round, int exit_code, const std::string& message, int expected, std::chrono::milliseconds wait);

 private:
  JobStore& store_;
  Options options_;
};

}  // namespace ddp::detail
