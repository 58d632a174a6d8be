#include <ddp/launch/rendezvous.h>

#include <algorithm>
#include <sstream>
#include <thread>

#include <c10/util/Exception.h>

#include <ddp/launch/job_store.h>
#include <ddp/launch/text.h>

namespace ddp::detail {
namespace {

/// How often a node looks at the store while it waits for a round.
constexpr std::chrono::milliseconds kPoll{50};

}  // namespace

int RoundOutcome::node_rank_of(int id) const {
  const auto it = std::find(members.begin(), members.end(), id);
  return it == members.end() ? -1 : static_cast<int>(it - members.begin());
}

std::string encode_outcome(const RoundOutcome& o) {
  const std::string head = o.ended ? "end " + std::to_string(o.exit_code) : "members " + id_list(o.members);
  return head + "\n" + o.message;
}

RoundOutcome decode_outcome(int round, const std::string& text) {
  RoundOutcome o;
  o.round = round;
  const size_t newline = text.find('\n');
  TORCH_CHECK(newline != std::string::npos, "round ", round, "'s outcome in the job store is malformed: ", text);
  std::istringstream head(text.substr(0, newline));
  o.message = text.substr(newline + 1);
  std::string kind, rest;
  head >> kind >> rest;
  if (kind == "end") {
    o.ended = true;
    o.exit_code = std::stoi(rest);
    return o;
  }
  TORCH_CHECK(kind == "members" && !rest.empty(), "round ", round, "'s outcome in the job store is malformed: ", text);
  std::istringstream ids(rest);
  for (std::string id; std::getline(ids, id, ',');) o.members.push_back(std::stoi(id));
  return o;
}

Rendezvous::Rendezvous(JobStore& store, Options options) : store_(store), options_(std::move(options)) {}

std::optional<RoundOutcome> Rendezvous::host(int round, const std::string& message) {
  store_.set_current_round(round);
  const auto opened = std::chrono::steady_clock::now();
  int64_t seen_joins = -1;
  std::vector<int> members{0};
  for (;;) {
    if (const int64_t joins = store_.joins(round); joins != seen_joins) {
      seen_joins = joins;
      members = {0};
      for (int id = 1; id < options_.max_nodes; ++id) {
        if (store_.joined(round, id)) members.push_back(id);
      }
    }
    const auto waited = std::chrono::steady_clock::now() - opened;
    const int have = static_cast<int>(members.size());
    if (have == options_.max_nodes || (have >= options_.min_nodes && waited >= options_.rejoin_wait)) break;
    TORCH_CHECK(waited < options_.timeout, "only ", have, " of at least ", options_.min_nodes, " nodes (--nnodes ",
                options_.min_nodes, ":", options_.max_nodes, ") joined within ", seconds_value(options_.timeout),
                " s (--rendezvous-timeout-s): node ids ", id_list(members));
    if (options_.interrupted && options_.interrupted()) return std::nullopt;
    std::this_thread::sleep_for(kPoll);
  }
  RoundOutcome outcome;
  outcome.members = members;
  outcome.message = message;
  return decode_outcome(round, store_.close_round(round, encode_outcome(outcome)));
}

std::optional<RoundOutcome> Rendezvous::join(int round) {
  for (;; ++round) {
    TORCH_CHECK(store_.join_round(round, options_.id) == 1, "another node joined with --node-rank ", options_.id,
                ": each node of an elastic job needs its own (in [1, ", options_.max_nodes,
                "); 0 is the store's host)");
    const auto deadline = std::chrono::steady_clock::now() + options_.timeout;
    std::optional<std::string> text;
    while (!(text = store_.round_outcome(round))) {
      TORCH_CHECK(std::chrono::steady_clock::now() < deadline, "node 0 did not admit this node within ",
                  seconds_value(options_.timeout), " s (--rendezvous-timeout-s)");
      if (options_.interrupted && options_.interrupted()) return std::nullopt;
      std::this_thread::sleep_for(kPoll);
    }
    RoundOutcome outcome = decode_outcome(round, *text);
    if (outcome.ended) store_.leave_round(round);
    if (outcome.ended || outcome.node_rank_of(options_.id) >= 0) return outcome;
    // Closed without this node (it came late): node 0 restarts the attempt for it, in the next round.
  }
}

std::optional<std::string> Rendezvous::newcomer(int round) {
  if (store_.joins(round) == 0) return std::nullopt;
  std::vector<int> ids;
  for (int id = 1; id < options_.max_nodes; ++id) {
    if (store_.joined(round, id)) ids.push_back(id);
  }
  return std::string(kMembershipChange) + "node " + (ids.empty() ? "?" : id_list(ids)) + " asked to join (--nnodes " +
         std::to_string(options_.min_nodes) + ":" + std::to_string(options_.max_nodes) + ")";
}

void Rendezvous::end(int round, int exit_code, const std::string& message, int expected,
                     std::chrono::milliseconds wait) {
  RoundOutcome outcome;
  outcome.ended = true;
  outcome.exit_code = exit_code;
  outcome.message = message;
  try {
    store_.close_round(round, encode_outcome(outcome));
    const auto deadline = std::chrono::steady_clock::now() + wait;
    while (std::chrono::steady_clock::now() < deadline) {
      const int64_t need = std::max<int64_t>(expected, store_.joins(round));
      if (store_.round_leavers(round) >= need) return;
      std::this_thread::sleep_for(kPoll);
    }
  } catch (const c10::Error&) {  // the job is over for node 0 either way
  }
}

}  // namespace ddp::detail
