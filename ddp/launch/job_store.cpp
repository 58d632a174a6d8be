#include <ddp/launch/job_store.h>
#include <ddp/launch/text.h>

#include <algorithm>
#include <condition_variable>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <ddp/launch/store_socket.h>

namespace ddp::detail {
namespace {

/// The launchers' keys; the workers' are under "libtorch_amp/<attempt>" (ddp/process_group.cpp).
constexpr const char* kPrefix = "ddp_launch";
/// How long a store call may wait for node 0's answer once connected.
constexpr std::chrono::milliseconds kCallTimeout{30000};

std::vector<uint8_t> bytes(const std::string& s) { return {s.begin(), s.end()}; }
std::string text(const std::vector<uint8_t>& b) { return {b.begin(), b.end()}; }

std::string failed_key(int attempt) { return "attempt/" + std::to_string(attempt) + "/failed"; }
std::string reports_key(int attempt) { return "attempt/" + std::to_string(attempt) + "/reports"; }
std::string cause_key(int attempt) { return "attempt/" + std::to_string(attempt) + "/cause"; }
std::string done_key(int attempt) { return "attempt/" + std::to_string(attempt) + "/done"; }
std::string left_key(int attempt) { return "attempt/" + std::to_string(attempt) + "/left"; }
std::string beat_key(int node) { return "alive/" + std::to_string(node); }
std::string round_key(int round, const std::string& what) { return "round/" + std::to_string(round) + "/" + what; }
constexpr const char* kCurrentRoundKey = "round/current";

/// The first line of an exception's message.
std::string why_of(const std::exception& e) {
  const std::string why = message_of(e);
  return why.substr(0, why.find('\n'));
}

}  // namespace

struct JobStore::Impl {
  c10::intrusive_ptr<c10d::TCPStore> tcp;
  c10::intrusive_ptr<c10d::Store> store;
  std::string where;

  /// A store call; its failure means node 0's launcher, which hosts the store, is gone.
  template <typename Fn>
  auto call(const Fn& fn) -> decltype(fn()) {
    try {
      return fn();
    } catch (const std::exception& e) {
      TORCH_CHECK(false, "lost the job's store at ", where,
                  " (node 0's launcher, which hosts it, is gone?): ", why_of(e));
    }
  }
};

JobStore::JobStore(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
JobStore::~JobStore() = default;

std::unique_ptr<JobStore> JobStore::host(const std::string& address, int port, bool one_node) {
  c10d::TCPStoreOptions options;
  options.port = static_cast<std::uint16_t>(port);
  options.isServer = true;
  options.waitWorkers = false;
  auto impl = std::make_unique<Impl>();
  try {
    if (const int fd = store_listen_socket(address, port, one_node); fd >= 0) options.masterListenFd = fd;
    impl->tcp = c10::make_intrusive<c10d::TCPStore>(address, options);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "cannot host the job's store on port ", port,
                " (--master-port; another job there? pick a free port): ", why_of(e));
  }
  impl->where = "port " + std::to_string(impl->tcp->getPort());
  impl->store = c10::make_intrusive<c10d::PrefixStore>(kPrefix, impl->tcp);
  return std::unique_ptr<JobStore>(new JobStore(std::move(impl)));
}

std::unique_ptr<JobStore> JobStore::connect(const std::string& host, int port, std::chrono::milliseconds timeout) {
  c10d::TCPStoreOptions options;
  options.port = static_cast<std::uint16_t>(port);
  options.isServer = false;
  options.waitWorkers = false;
  options.timeout = timeout;
  auto impl = std::make_unique<Impl>();
  impl->where = host + ":" + std::to_string(port);
  try {
    impl->tcp = c10::make_intrusive<c10d::TCPStore>(host, options);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "could not reach node 0's launcher at ", impl->where, " within ", timeout.count() / 1000.0,
                " s (--master-addr, --master-port; is node 0 started?): ", why_of(e));
  }
  // From here on a call that gets no answer (node 0's host cut off without closing the connection) fails within
  // this, rather than holding the supervision of this node's workers for the whole connect timeout.
  impl->tcp->setTimeout(kCallTimeout);
  impl->store = c10::make_intrusive<c10d::PrefixStore>(kPrefix, impl->tcp);
  return std::unique_ptr<JobStore>(new JobStore(std::move(impl)));
}

int JobStore::port() const { return impl_->tcp->getPort(); }

void JobStore::report_failure(int attempt, int node, std::chrono::system_clock::time_point when,
                              const std::string& cause) {
  const int64_t ns = std::chrono::duration_cast<std::chrono::nanoseconds>(when.time_since_epoch()).count();
  const std::string line = std::to_string(ns) + " " + std::to_string(node) + " " + cause + "\n";
  impl_->call([&] { impl_->store->append(reports_key(attempt), bytes(line)); });
  impl_->call([&] { return impl_->store->compareSet(failed_key(attempt), std::vector<uint8_t>{}, bytes("1")); });
}

void JobStore::report_no_failure(int attempt, int node) {
  impl_->call([&] { impl_->store->append(reports_key(attempt), bytes("- " + std::to_string(node) + "\n")); });
}

bool JobStore::failed(int attempt) {
  const std::string key = failed_key(attempt);
  return impl_->call([&] { return impl_->store->check({key}); });
}

namespace {

/// A report's line: "<ns> <node> <cause>" (a failure) or "- <node>".
struct Report {
  std::string when;
  int node = -1;
  std::string cause;
};

std::vector<Report> parse_reports(const std::string& all) {
  std::vector<Report> reports;
  std::istringstream lines(all);
  for (std::string line; std::getline(lines, line);) {
    std::istringstream fields(line);
    Report r;
    fields >> r.when >> r.node;
    std::getline(fields >> std::ws, r.cause);
    reports.push_back(r);
  }
  return reports;
}

}  // namespace

std::vector<std::string> JobStore::reported_causes(int attempt) {
  const std::string key = reports_key(attempt);
  std::vector<std::string> causes;
  if (!impl_->call([&] { return impl_->store->check({key}); })) return causes;
  for (const Report& r : parse_reports(text(impl_->call([&] { return impl_->store->get(key); })))) {
    if (r.when != "-") causes.push_back(r.cause);
  }
  return causes;
}

std::optional<std::string> JobStore::cause_of(int attempt, const std::vector<int>& nodes,
                                              std::chrono::milliseconds wait) {
  const std::string key = reports_key(attempt);
  const auto start = std::chrono::steady_clock::now();
  std::vector<Report> reports;
  std::vector<int> missing = nodes;
  struct Sign {
    int64_t beats = -1;
    std::chrono::steady_clock::time_point changed;
  };
  std::vector<Sign> signs(nodes.size(), Sign{-1, start});
  bool silent = false;  // every node missing has stopped beating
  for (;;) {            // every node's report, or what there is when the others are silent or at the deadline
    if (impl_->call([&] { return impl_->store->check({key}); })) {
      reports = parse_reports(text(impl_->call([&] { return impl_->store->get(key); })));
    }
    missing.clear();
    for (const int node : nodes) {
      const bool in = std::any_of(reports.begin(), reports.end(), [&](const Report& r) { return r.node == node; });
      if (!in) missing.push_back(node);
    }
    const auto now = std::chrono::steady_clock::now();
    silent = !missing.empty();
    for (size_t i = 0; i < nodes.size(); ++i) {
      if (std::find(missing.begin(), missing.end(), nodes[i]) == missing.end()) continue;
      const int64_t beats = impl_->call([&] { return impl_->store->add(beat_key(nodes[i]), 0); });
      if (beats != signs[i].beats) signs[i] = Sign{beats, now};
      silent = silent && now - signs[i].changed >= kSilentNode;
    }
    if (missing.empty() || silent || now - start >= wait) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  std::string first;
  int64_t first_ns = 0;
  for (const Report& r : reports) {
    if (r.when == "-") continue;
    const int64_t ns = std::stoll(r.when);
    if (first.empty() || ns < first_ns) {
      first_ns = ns;
      first = r.cause;
    }
  }
  if (first.empty()) return std::nullopt;
  // A node that never reported was lost with its launcher (killed, or cut off): that is the cause, and what the
  // nodes that did report saw follows from it.
  if (!missing.empty()) {
    std::ostringstream why;
    why << "node ";
    for (size_t i = 0; i < missing.size(); ++i) why << (i > 0 ? ", " : "") << missing[i];
    if (silent) {
      why << " lost: its launcher gave no sign of life for " << static_cast<double>(kSilentNode.count()) / 1000.0
          << " s";
    } else {
      why << " lost: its launcher did not report the attempt's end within "
          << static_cast<double>(wait.count()) / 1000.0 << " s";
    }
    why << "; first failure seen: " << first;
    first = why.str();
  }
  // Decided once: a report that arrives later does not change what a node already printed.
  return text(impl_->call([&] { return impl_->store->compareSet(cause_key(attempt), {}, bytes(first)); }));
}

int64_t JobStore::report_done(int attempt) {
  return impl_->call([&] { return impl_->store->add(done_key(attempt), 1); });
}

int64_t JobStore::nodes_done(int attempt) {
  return impl_->call([&] { return impl_->store->add(done_key(attempt), 0); });
}

void JobStore::leave(int attempt) noexcept {
  try {
    // An append is answered by nothing, unlike add (TCPStore's protocol): node 0 may go as soon as it sees it. Each
    // node appends one byte to the same key; node 0 counts the bytes.
    impl_->store->append(left_key(attempt), {'.'});
  } catch (...) {
  }
}

void JobStore::wait_for_leavers(int attempt, int nodes, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  const std::string key = left_key(attempt);
  while (std::chrono::steady_clock::now() < deadline) {
    if (impl_->call([&] { return impl_->store->check({key}); })) {
      const auto left = impl_->call([&] { return impl_->store->get(key); });
      if (static_cast<int>(left.size()) >= nodes) return;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

int64_t JobStore::join_round(int round, int id) {
  const int64_t same_id =
      impl_->call([&] { return impl_->store->add(round_key(round, "node/" + std::to_string(id)), 1); });
  impl_->call([&] { return impl_->store->add(round_key(round, "joins"), 1); });
  return same_id;
}

int64_t JobStore::joins(int round) {
  return impl_->call([&] { return impl_->store->add(round_key(round, "joins"), 0); });
}

bool JobStore::joined(int round, int id) {
  const std::string key = round_key(round, "node/" + std::to_string(id));
  return impl_->call([&] { return impl_->store->check({key}); });
}

std::string JobStore::close_round(int round, const std::string& outcome) {
  return text(impl_->call([&] { return impl_->store->compareSet(round_key(round, "outcome"), {}, bytes(outcome)); }));
}

std::optional<std::string> JobStore::round_outcome(int round) {
  const std::string key = round_key(round, "outcome");
  if (!impl_->call([&] { return impl_->store->check({key}); })) return std::nullopt;
  return text(impl_->call([&] { return impl_->store->get(key); }));
}

void JobStore::set_current_round(int round) {
  impl_->call([&] { impl_->store->set(kCurrentRoundKey, bytes(std::to_string(round))); });
}

int JobStore::current_round() {
  if (!impl_->call([&] { return impl_->store->check({kCurrentRoundKey}); })) return 0;
  return std::stoi(text(impl_->call([&] { return impl_->store->get(kCurrentRoundKey); })));
}

void JobStore::leave_round(int round) noexcept {
  try {
    impl_->store->append(round_key(round, "left"), {'.'});  // as leave(): no answer awaited
  } catch (...) {
  }
}

int64_t JobStore::round_leavers(int round) {
  const std::string key = round_key(round, "left");
  if (!impl_->call([&] { return impl_->store->check({key}); })) return 0;
  return static_cast<int64_t>(impl_->call([&] { return impl_->store->get(key); }).size());
}

void JobStore::beat(int node) {
  impl_->call([&] { return impl_->store->add(beat_key(node), 1); });
}

int64_t JobStore::beats(int node) {
  return impl_->call([&] { return impl_->store->add(beat_key(node), 0); });
}

struct Heartbeat::State {
  std::mutex mutex;
  std::condition_variable changed;
  bool stop = false;
  bool finished = false;  // the thread is past its last store call
};

Heartbeat::Heartbeat(std::string host, int port, int node) : state_(std::make_shared<State>()) {
  thread_ = std::thread([state = state_, host = std::move(host), port, node] {
    try {
      const auto store = JobStore::connect(host, port, kSilentNode);
      std::unique_lock<std::mutex> lock(state->mutex);
      while (!state->stop) {
        lock.unlock();
        store->beat(node);
        lock.lock();
        state->changed.wait_for(lock, kHeartbeatInterval, [&] { return state->stop; });
      }
    } catch (const std::exception&) {  // the store is gone: so is the job, for this node
    }
    std::lock_guard<std::mutex> lock(state->mutex);
    state->finished = true;
    state->changed.notify_all();
  });
}

Heartbeat::~Heartbeat() {
  std::unique_lock<std::mutex> lock(state_->mutex);
  state_->stop = true;
  state_->changed.notify_all();
  // A beat held by a store that stopped answering (its host cut off) ends only at the call's timeout: leave it then.
  if (state_->changed.wait_for(lock, std::chrono::seconds(1), [&] { return state_->finished; })) {
    lock.unlock();
    thread_.join();
  } else {
    thread_.detach();
  }
}

}  // namespace ddp::detail
