#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace ddp::detail {

/// The launchers' shared record of a job's attempts, kept in a c10d TCPStore that the launcher of node 0 hosts on
/// the master port (as torchrun's agent does; the workers use it too, TORCHELASTIC_USE_AGENT_STORE, each attempt
/// under its own prefix). Every launcher learns from it that another node's workers failed, so that all nodes
/// restart together and name the same root cause: the failure that happened first.
/// How long a node's Heartbeat may stay still before the others take the node for lost (20 beats).
constexpr std::chrono::milliseconds kHeartbeatInterval{250};
constexpr std::chrono::milliseconds kSilentNode{5000};

class JobStore {
 public:
  /// Node 0: hosts the store on `port` (0: any free port, see port()), answering on `address` only (--master-addr:
  /// the loopback address for a one-node job; store_socket.h, which `one_node` goes to).
  static std::unique_ptr<JobStore> host(const std::string& address, int port, bool one_node);
  /// The other nodes: connect to node 0's store, retrying for up to `timeout`. Throws one line naming the address.
  static std::unique_ptr<JobStore> connect(const std::string& host, int port, std::chrono::milliseconds timeout);
  ~JobStore();
  JobStore(const JobStore&) = delete;
  JobStore& operator=(const JobStore&) = delete;

  int port() const;

  /// Records a failure of `attempt` on node `node` (its --node-rank), seen to happen at `when` (the wall clock: nodes
  /// compare them), with its one-line `cause`; the other nodes learn from failed() that the attempt failed. Each node
  /// reports once per failed attempt: this, or report_no_failure().
  void report_failure(int attempt, int node, std::chrono::system_clock::time_point when, const std::string& cause);
  /// Records that this node's workers did not fail by themselves in `attempt` (they were stopped, or had finished).
  void report_no_failure(int attempt, int node);
  /// Whether any node reported a failure of `attempt`.
  bool failed(int attempt);
  /// The causes of the failures of `attempt` reported so far, in the order they were reported.
  std::vector<std::string> reported_causes(int attempt);
  /// The cause every node names for `attempt`: of the failures reported, the one that happened first, decided once
  /// by the first node to ask (the others get the same answer). Waits until all `nodes` (their --node-rank) have
  /// reported (a node where the failure happened may report after one whose workers failed as a consequence, by
  /// seconds on a loaded machine), for up to `wait`, but not for a node whose Heartbeat has stopped for
  /// kSilentNode: a node that does not report was lost, and the cause is "node N lost: ...; first failure seen:
  /// <cause>". nullopt when no failure was reported.
  std::optional<std::string> cause_of(int attempt, const std::vector<int>& nodes, std::chrono::milliseconds wait);

  /// One beat of node `node`'s launcher (Heartbeat), and how many it has made.
  void beat(int node);
  int64_t beats(int node);
  /// Records that this node's workers finished `attempt`; returns how many nodes have.
  int64_t report_done(int attempt);
  int64_t nodes_done(int attempt);
  /// A node other than 0 says it is done with the store: a write that waits for no answer, so that node 0 may
  /// close the store once it has seen it. Never throws (the job is over for this node).
  void leave(int attempt) noexcept;
  /// Node 0: waits until `nodes` others have left, for up to `timeout` (a node that does not say so was lost).
  void wait_for_leavers(int attempt, int nodes, std::chrono::milliseconds timeout);

  // Rounds of an elastic job's membership (--nnodes MIN:MAX; the policy is detail::Rendezvous's). Round R decides
  // which nodes run attempt R: each node joins it, node 0 closes it with its outcome.

  /// Records that the node `id` (its --node-rank) joins round `round`; returns how many times that id joined it (more
  /// than 1: another node has the same id).
  int64_t join_round(int round, int id);
  /// How many joins round `round` has had (any id).
  int64_t joins(int round);
  /// Whether node `id` joined round `round`.
  bool joined(int round, int id);
  /// Node 0: sets round `round`'s outcome (once: returns the outcome that is set).
  std::string close_round(int round, const std::string& outcome);
  /// Round `round`'s outcome; nullopt while it is open.
  std::optional<std::string> round_outcome(int round);
  /// The round a node that starts now joins first (node 0 sets it as it opens each round); 0 before any.
  void set_current_round(int round);
  int current_round();
  /// A node that learnt a round's outcome and will not call node 0 again says so (a write that waits for no answer);
  /// node 0 counts them with round_leavers(). Never throws.
  void leave_round(int round) noexcept;
  int64_t round_leavers(int round);

 private:
  struct Impl;  ///< the c10d store, kept out of this header
  explicit JobStore(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

/// A launcher's sign of life in the job's store, from a thread with a connection of its own (so that it beats while
/// the launcher waits on its workers or on the store): the other nodes tell a lost node (killed, cut off) from a
/// slow one without waiting out their longest timeout. Stops beating when the store is gone.
class Heartbeat {
 public:
  Heartbeat(std::string host, int port, int node);
  ~Heartbeat();
  Heartbeat(const Heartbeat&) = delete;
  Heartbeat& operator=(const Heartbeat&) = delete;

 private:
  struct State;
  std::shared_ptr<State> state_;
  std::thread thread_;
};

}  // namespace ddp::detail
