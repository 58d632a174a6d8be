#include <ddp/launch/launcher.h>

#include <dirent.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fcntl.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cmath>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <sstream>
#include <thread>

#include <c10/util/Exception.h>

#include <ddp/launch/error_file.h>
#include <ddp/launch/exit_codes.h>
#include <ddp/launch/health_watch.h>
#include <ddp/launch/job_store.h>
#include <ddp/launch/progress_record.h>
#include <ddp/launch/rendezvous.h>
#include <ddp/launch/restart_policy.h>
#include <ddp/launch/signal_forwarding.h>
#include <ddp/launch/text.h>
#include <ddp/launch/worker_group.h>
#include <ddp/process_group.h>

extern char** environ;

namespace ddp {
namespace {

constexpr int kExitNotFound = 127;       // the shell's code for "command not found" (POSIX)
constexpr int kExitNotExecutable = 126;  // the shell's code for "found, but it cannot be executed" (POSIX)
constexpr int kSignalExitBase = 128;     // the shell's convention for "ended by signal N"
constexpr int kExitHung = 124;           // a worker hung (GNU timeout's code for "timed out"), not its SIGTERM's 143
/// How long a node whose workers finished waits for the other nodes' (with --max-restarts) when no rendezvous
/// timeout is given: the workers' own default rendezvous timeout.
constexpr std::chrono::milliseconds kDefaultNodesDoneWait{600000};
/// How long node 0's launcher waits for the other launchers to leave its store (at the end of the job; when it
/// failed, after their kill grace on top).
constexpr std::chrono::milliseconds kLeaveWait{10000};
/// How long, beyond the kill grace, a node waits for every node's report of a failed attempt before it names the
/// cause from those in (a node that never reports was lost with its launcher).
constexpr std::chrono::milliseconds kCauseWait{10000};
/// How often a finished node looks at the store while it waits for the others.
constexpr std::chrono::milliseconds kStorePollInterval{100};

/// Why `file` cannot be executed, as the end of "cannot run 'P': ..." with the shell's code; nullopt when it can.
std::optional<ProgramProblem> why_not_runnable(const std::string& file) {
  struct stat info {};
  if (::stat(file.c_str(), &info) != 0) {
    if (errno == ENOENT || errno == ENOTDIR) return ProgramProblem{kExitNotFound, "no such file"};
    return ProgramProblem{kExitNotExecutable, std::strerror(errno)};  // e.g. a folder on the way we may not enter
  }
  if (S_ISDIR(info.st_mode)) return ProgramProblem{kExitNotExecutable, "it is a folder, not a program"};
  if (!S_ISREG(info.st_mode)) return ProgramProblem{kExitNotExecutable, "it is not a regular file"};
  // The effective ids, as execve checks them (access() alone would use the real ones).
  if (::faccessat(AT_FDCWD, file.c_str(), X_OK, AT_EACCESS) != 0) {
    return ProgramProblem{kExitNotExecutable, "it is not executable (no execute permission)"};
  }
  return std::nullopt;
}

/// The folders execvp searches for a bare name: PATH, or the system's default path when PATH is unset.
std::vector<std::string> search_folders() {
  std::string path;
  if (const char* value = std::getenv("PATH")) {
    path = value;
  } else {
    path.resize(::confstr(_CS_PATH, nullptr, 0));
    if (!path.empty()) path.resize(::confstr(_CS_PATH, path.data(), path.size()) - 1);
  }
  std::vector<std::string> folders;
  for (size_t from = 0;;) {
    const size_t colon = path.find(':', from);
    folders.push_back(path.substr(from, colon == std::string::npos ? std::string::npos : colon - from));
    if (colon == std::string::npos) return folders;
    from = colon + 1;
  }
}

/// NUL-terminated argv/envp arrays, built before fork so that the child only calls exec.
struct CStrings {
  explicit CStrings(std::vector<std::string> s) : strings(std::move(s)) {
    for (auto& str : strings) pointers.push_back(str.data());
    pointers.push_back(nullptr);
  }
  std::vector<std::string> strings;
  std::vector<char*> pointers;
};

CStrings full_environment(const std::vector<std::pair<std::string, std::string>>& overrides) {
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string entry = *e;
    const std::string name = entry.substr(0, entry.find('='));
    bool overridden = false;
    for (const auto& [key, value] : overrides) overridden = overridden || key == name;
    if (!overridden) env.push_back(entry);
  }
  for (const auto& [key, value] : overrides) env.push_back(key + "=" + value);
  return CStrings(std::move(env));
}

}  // namespace

std::vector<std::pair<std::string, std::string>> worker_environment(const LaunchConfig& c, int local_rank,
                                                                    int master_port, const WorkerAttempt& attempt) {
  const int world_size = c.nnodes * c.nproc_per_node;
  const int rank = c.node_rank * c.nproc_per_node + local_rank;
  std::vector<std::pair<std::string, std::string>> env = {
      {"MASTER_ADDR", c.master_addr},
      {"MASTER_PORT", std::to_string(master_port)},
      {"RANK", std::to_string(rank)},
      {"WORLD_SIZE", std::to_string(world_size)},
      {"LOCAL_RANK", std::to_string(local_rank)},
      {"LOCAL_WORLD_SIZE", std::to_string(c.nproc_per_node)},
      {"GROUP_RANK", std::to_string(c.node_rank)},
  };
  // torchrun's default: several workers each running a full-width OpenMP pool oversubscribe the node.
  if (c.nproc_per_node > 1 && std::getenv("OMP_NUM_THREADS") == nullptr) env.emplace_back("OMP_NUM_THREADS", "1");
  if (c.rendezvous_timeout) env.emplace_back(kRendezvousTimeoutEnv, detail::seconds_value(*c.rendezvous_timeout));
  if (c.collective_timeout) env.emplace_back(kCollectiveTimeoutEnv, detail::seconds_value(*c.collective_timeout));
  env.emplace_back("TORCHELASTIC_RESTART_COUNT", std::to_string(attempt.restart_count));
  env.emplace_back("TORCHELASTIC_MAX_RESTARTS", std::to_string(c.max_restarts));
  env.emplace_back("TORCHELASTIC_USE_AGENT_STORE", attempt.agent_store ? "True" : "False");
  if (!attempt.error_file.empty()) env.emplace_back(kErrorFileEnv, attempt.error_file);
  if (!attempt.progress_file.empty()) env.emplace_back(detail::kProgressFileEnv, attempt.progress_file);
  return env;
}

std::vector<std::string> worker_command(const LaunchConfig& c, int local_rank) {
  std::vector<std::string> argv = c.command;
  if (c.local_rank_arg && !argv.empty()) {
    argv.insert(argv.begin() + 1, "--local-rank=" + std::to_string(local_rank));
  }
  return argv;
}

std::optional<ProgramProblem> check_program(const std::string& program) {
  const std::string quoted = "cannot run '" + program + "': ";
  if (program.empty()) return ProgramProblem{kExitNotFound, quoted + "the program name is empty"};
  if (program.find('/') != std::string::npos) {
    std::optional<ProgramProblem> problem = why_not_runnable(program);
    if (problem) problem->message = quoted + problem->message;
    return problem;
  }
  // As execvp: the first executable match wins; a match that is not executable is reported only when none is.
  std::optional<ProgramProblem> first_unrunnable;
  for (const std::string& folder : search_folders()) {
    const std::string file = folder.empty() ? program : folder + "/" + program;  // empty entry: the current folder
    std::optional<ProgramProblem> problem = why_not_runnable(file);
    if (!problem) return std::nullopt;
    if (problem->exit_code != kExitNotFound && !first_unrunnable) {
      first_unrunnable = ProgramProblem{problem->exit_code, quoted + "PATH has " + file + ", but " + problem->message};
    }
  }
  if (first_unrunnable) return first_unrunnable;
  std::string message = quoted + "not found in PATH";
  if (!why_not_runnable(program)) message += " (the current folder has it: run it as ./" + program + ")";
  return ProgramProblem{kExitNotFound, message};
}

namespace {

/// A folder for the workers' error files (TORCHELASTIC_ERROR_FILE) and progress files (DDP_PROGRESS_FILE), removed
/// with what is in it at the end.
class LaunchFolder {
 public:
  LaunchFolder() {
    const char* tmp = std::getenv("TMPDIR");
    std::string pattern = std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") + "/ddp-launch-XXXXXX";
    if (::mkdtemp(pattern.data()) != nullptr) dir_ = pattern;  // else the workers get no error file
  }
  ~LaunchFolder() {
    if (dir_.empty()) return;
    if (DIR* d = ::opendir(dir_.c_str())) {
      while (const dirent* entry = ::readdir(d)) {
        const std::string name = entry->d_name;
        if (name != "." && name != "..") ::unlink((dir_ + "/" + name).c_str());
      }
      ::closedir(d);
    }
    ::rmdir(dir_.c_str());
  }
  LaunchFolder(const LaunchFolder&) = delete;
  LaunchFolder& operator=(const LaunchFolder&) = delete;

  /// The error file of one worker in one attempt; "" when the folder could not be made.
  std::string error_file(int attempt, int rank) const {
    if (dir_.empty()) return "";
    return dir_ + "/attempt" + std::to_string(attempt) + "-rank" + std::to_string(rank) + ".json";
  }
  /// The folder; "" when it could not be made.
  const std::string& path() const { return dir_; }

 private:
  std::string dir_;
};

/// Starts this node's workers for one attempt into `group`.
void start_workers(const LaunchConfig& c, int port, const WorkerAttempt& base, int attempt_number,
                   const LaunchFolder& folder, const detail::HealthWatch* watch, detail::WorkerGroup& group) {
  const pid_t parent = ::getpid();
  for (int local_rank = 0; local_rank < c.nproc_per_node; ++local_rank) {
    const int rank = c.node_rank * c.nproc_per_node + local_rank;
    WorkerAttempt attempt = base;
    attempt.error_file = folder.error_file(attempt_number, rank);
    if (watch != nullptr) attempt.progress_file = watch->file(local_rank);
    CStrings argv(worker_command(c, local_rank));
    CStrings envp = full_environment(worker_environment(c, local_rank, port, attempt));
    const std::string exec_failed = "ddp-launch: cannot run '" + argv.strings[0] + "': ";  // (no allocation after fork)
    // The worker's stderr comes through us, so that a failure summary can quote its last line.
    int stderr_pipe[2];
    TORCH_CHECK(::pipe2(stderr_pipe, O_CLOEXEC) == 0, "pipe() failed for local rank ", local_rank, ": ",
                std::strerror(errno));
    const pid_t pid = ::fork();
    TORCH_CHECK(pid >= 0, "fork() failed for local rank ", local_rank, ": ", std::strerror(errno));
    if (pid == 0) {
      ::setpgid(0, 0);
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);  // a launcher killed with SIGKILL takes its workers along
      if (::getppid() != parent) ::_exit(kExitNotFound);
      for (const int forwarded : detail::kForwardedSignals) ::signal(forwarded, SIG_DFL);
      ::dup2(stderr_pipe[1], STDERR_FILENO);  // the copy does not inherit O_CLOEXEC; both originals close on exec
      ::execvpe(argv.pointers[0], argv.pointers.data(), envp.pointers.data());
      const char* why = std::strerror(errno);
      (void)!::write(STDERR_FILENO, exec_failed.data(), exec_failed.size());
      (void)!::write(STDERR_FILENO, why, std::strlen(why));
      (void)!::write(STDERR_FILENO, "\n", 1);
      ::_exit(kExitNotFound);
    }
    ::close(stderr_pipe[1]);
    group.add(rank, local_rank, pid, /*message_fd=*/-1, stderr_pipe[0], attempt.error_file);
  }
}

/// How one attempt ended on this node.
struct AttemptEnd {
  bool succeeded = false;
  bool resumable = false;      // (succeeded) workers stopped on their stop signal and saved: ddp::kExitResumable
  bool asked_to_stop = false;  // the launcher received SIGINT/SIGTERM
  int exit_code = 0;           // when it failed
  std::string cause;           // when it failed: one line, the cause every node agrees on
};

/// The root cause's line of a failure summary, without the prefix and role: what a restart is logged with.
std::string cause_line(const std::vector<detail::WorkerExit>& failures) {
  std::string line = detail::describe_failures(failures, "");
  line = line.substr(0, line.find('\n'));
  const std::string role = "root cause: ";
  if (line.rfind(role, 0) == 0) line.erase(0, role.size());
  return line;
}

/// The nodes of one attempt, by --node-rank: this one and all (ascending; node rank = position).
struct AttemptNodes {
  int self = 0;
  std::vector<int> all;
};

/// With several nodes, after this node's workers finished: waits until every node's have, or one node failed
/// (then returns its cause: the job is not done until all nodes are).
std::optional<std::string> wait_for_other_nodes(const LaunchConfig& c, detail::JobStore& store, int attempt,
                                                const AttemptNodes& nodes, bool even_if_signalled) {
  const auto deadline = std::chrono::steady_clock::now() + c.rendezvous_timeout.value_or(kDefaultNodesDoneWait);
  int64_t done = store.report_done(attempt);
  // (Asked to stop: not waited for, unless the workers stopped resumable, as every node's do within a few steps.)
  while (done < c.nnodes && (even_if_signalled || detail::SignalForwarding::received() == 0)) {
    if (store.failed(attempt)) {
      store.report_no_failure(attempt, nodes.self);
      return store.cause_of(attempt, nodes.all, c.kill_grace + kCauseWait).value_or("another node failed");
    }
    TORCH_CHECK(std::chrono::steady_clock::now() < deadline, "this node's workers finished, but only ", done, " of ",
                c.nnodes, " nodes reported theirs within ",
                detail::seconds_value(c.rendezvous_timeout.value_or(kDefaultNodesDoneWait)),
                " s (--rendezvous-timeout-s)");
    std::this_thread::sleep_for(kStorePollInterval);
    done = store.nodes_done(attempt);
  }
  // Node 0's launcher hosts the store: it leaves last, once every other node has no call to it waiting for an
  // answer (else theirs fails, and LibTorch prints a backtrace).
  if (c.node_rank == 0) {
    store.wait_for_leavers(attempt, c.nnodes - 1, kLeaveWait);
  } else {
    store.leave(attempt);
  }
  return std::nullopt;
}

/// When a failure happened, on the wall clock (which the nodes share, unlike their steady clocks).
std::chrono::system_clock::time_point wall_time_of(std::chrono::steady_clock::time_point when) {
  return std::chrono::system_clock::now() -
         std::chrono::duration_cast<std::chrono::system_clock::duration>(std::chrono::steady_clock::now() - when);
}

/// Runs one attempt: starts this node's workers, supervises them and, with a job store, agrees with the other
/// nodes on how it ended.
AttemptEnd run_attempt(const LaunchConfig& c, int port, int attempt, const AttemptNodes& nodes, detail::JobStore* store,
                       detail::Rendezvous* rendezvous, const LaunchFolder& folder, std::ostream& log) {
  std::optional<detail::HealthWatch> watch;
  if (c.hang_timeout.count() > 0 && !folder.path().empty()) {
    std::vector<int> ranks;
    for (int local_rank = 0; local_rank < c.nproc_per_node; ++local_rank) {
      ranks.push_back(c.node_rank * c.nproc_per_node + local_rank);
    }
    watch.emplace(folder.path(), attempt, ranks, c.hang_timeout);
  }
  detail::WorkerGroup group;  // (after the watch: the workers are gone before their progress files)
  start_workers(c, port, WorkerAttempt{attempt, store != nullptr, "", ""}, attempt, folder, watch ? &*watch : nullptr,
                group);
  // (Node 0 of an elastic job: shared even alone, so that it restarts for a node that asks to join.)
  const bool shared = store != nullptr && (c.nnodes > 1 || rendezvous != nullptr);
  const std::string node = "node " + std::to_string(nodes.self) + ": ";
  bool reported = false;  // (shared) this node's one report of a failed attempt is in the store
  detail::WaitHooks hooks;
  if (watch) {
    hooks.find_hang = [&](const std::vector<bool>& running) {
      return watch->check(std::chrono::steady_clock::now(), running);
    };
  }
  if (shared) {
    hooks.stop_requested = [&] {
      using detail::StopRequest;
      if (store->failed(attempt)) {
        // The first report is the one that stopped the attempt (the others may follow from it).
        const std::vector<std::string> causes = store->reported_causes(attempt);
        const bool membership = !causes.empty() && causes.front().rfind(detail::kMembershipChange, 0) == 0;
        return membership ? StopRequest::kMembershipChange : StopRequest::kFailure;
      }
      const std::optional<std::string> newcomer = rendezvous ? rendezvous->newcomer(attempt + 1) : std::nullopt;
      if (!newcomer) return StopRequest::kNone;
      store->report_failure(attempt, nodes.self, std::chrono::system_clock::now(), *newcomer);
      reported = true;
      return StopRequest::kMembershipChange;
    };
    // Reported at once, so that the other nodes stop their workers; which failure was first is decided after.
    hooks.first_failure = [&](const detail::WorkerExit& first) {
      store->report_failure(attempt, nodes.self, wall_time_of(first.observed), node + cause_line({first}));
      reported = true;
    };
  }
  group.set_stop_grace(c.stop_grace);
  const std::vector<detail::WorkerExit> failures =
      group.wait(c.kill_grace, detail::SignalForwarding::pending(), STDERR_FILENO, hooks);
  if (group.killed_after_stop_grace()) {
    log << "ddp-launch: the workers did not end within --stop-grace-s " << detail::seconds_value(c.stop_grace)
        << " s of the forwarded signal: killed them" << std::endl;
  }
  AttemptEnd end;
  // Workers that stopped resumable (ddp/launch/exit_codes.h) saved on their stop signal, this launcher's or their own:
  // the job stops, as done for now.
  end.resumable = failures.empty() && group.resumable_exits() > 0;
  end.asked_to_stop = detail::SignalForwarding::received() != 0 && !end.resumable &&
                      (failures.empty() || failures.front().after_forwarded_signal);
  if (end.asked_to_stop) return end;
  if (failures.empty()) {
    std::optional<std::string> failure;
    if (shared) failure = wait_for_other_nodes(c, *store, attempt, nodes, /*even_if_signalled=*/end.resumable);
    end.asked_to_stop =
        detail::SignalForwarding::received() != 0 && !end.resumable;  // while it waited for the other nodes
    if (!failure && !end.asked_to_stop) {
      end.succeeded = true;
      return end;
    }
    if (end.asked_to_stop) return end;
    log << "ddp-launch: this node's workers finished, but another node's failed: " << *failure << std::endl;
    end.exit_code = 1;
    end.cause = *failure;
    return end;
  }
  // The cause all nodes name: asked once every node's report is in.
  // (Node 0's store gone by then: this node's own account is all there is.)
  const auto agreed_cause = [&](const std::string& fallback) {
    try {
      if (!reported) {  // stopped for another node's failure, or failed only while being stopped
        if (failures.front().stopped_by_group) {
          store->report_no_failure(attempt, nodes.self);
        } else {
          store->report_failure(attempt, nodes.self, wall_time_of(failures.front().observed), fallback);
        }
      }
      return store->cause_of(attempt, nodes.all, c.kill_grace + kCauseWait).value_or(fallback);
    } catch (const c10::Error&) {
      return fallback;
    }
  };
  const bool local_failure = !failures.front().stopped_by_group;
  if (local_failure) {
    end.exit_code = failures.front().hang.empty() ? detail::exit_code_of(failures.front().wait_status) : kExitHung;
    end.cause = cause_line(failures);
    if (shared) end.cause = agreed_cause(node + end.cause);
    if (shared && end.cause.rfind(node, 0) != 0) {  // this node's workers failed after another node's
      log << "ddp-launch: another node failed first: " << end.cause << "\n"
          << detail::describe_failures(failures, "ddp-launch: this node: ");
    } else {
      log << detail::describe_failures(failures, "ddp-launch: ");
    }
  } else {
    end.exit_code = 1;
    end.cause = shared ? agreed_cause("another node failed") : "stopped";
    const bool membership = end.cause.rfind(detail::kMembershipChange, 0) == 0;
    log << "ddp-launch: stopped this node's " << c.nproc_per_node << " worker" << (c.nproc_per_node == 1 ? "" : "s")
        << (membership ? " for a " : " after another node's failed: ") << end.cause << std::endl;
  }
  return end;
}

/// An elastic job's round before an attempt (node 0 hosts it, the others join it): which nodes run the attempt
/// (`nodes.all`) and this node's rank among them (`here`), logged when they differ from the last attempt's
/// (`members`, then updated); `attempt` becomes the round's. Returns the exit code when the job ends for this node
/// instead: node 0 ended it, or a signal came while waiting.
std::optional<int> take_round(const LaunchConfig& c, detail::Rendezvous& rendezvous, const std::string& restart_line,
                              int& attempt, LaunchConfig& here, AttemptNodes& nodes, std::vector<int>& members,
                              std::ostream& log) {
  const bool host = c.node_rank == 0;
  const std::optional<detail::RoundOutcome> round =
      host ? rendezvous.host(attempt, restart_line) : rendezvous.join(attempt);
  if (!round) {  // asked to stop while waiting for the nodes
    const int received = detail::SignalForwarding::received();
    log << "ddp-launch: asked to stop by signal " << received << " (" << ::strsignal(received) << ")" << std::endl;
    if (host) rendezvous.end(attempt, kSignalExitBase + received, "ddp-launch: node 0 was asked to stop\n", 0, {});
    return kSignalExitBase + received;
  }
  attempt = round->round;
  if (!host) log << round->message << std::flush;
  if (round->ended) return round->exit_code;
  here.nnodes = static_cast<int>(round->members.size());
  here.node_rank = round->node_rank_of(c.node_rank);
  if (round->members != members) {
    log << "ddp-launch: attempt " << attempt << " runs on " << here.nnodes << " of at most " << c.nnodes
        << " nodes (--node-rank " << detail::id_list(round->members) << "), world size "
        << here.nnodes * c.nproc_per_node << "; this node is node " << here.node_rank << std::endl;
  }
  members = round->members;
  nodes.all = members;
  return std::nullopt;
}

}  // namespace

int run_launch(const LaunchConfig& c, std::ostream& log) {
  detail::validate_launch_config(c);
  // Before any worker starts: a program that cannot run is one line, not the same error from every worker.
  if (const std::optional<ProgramProblem> problem = check_program(c.command.front())) {
    log << "ddp-launch: " << problem->message << std::endl;
    return problem->exit_code;
  }
  const bool host = c.node_rank == 0;
  // With restarts or elastic membership, the launchers share a store on the master port (node 0's hosts it; the
  // workers use it too).
  std::unique_ptr<detail::JobStore> store;
  if (c.max_restarts > 0 || c.elastic()) {
    store = host ? detail::JobStore::host(c.master_addr, c.master_port, c.nnodes == 1)
                 : detail::JobStore::connect(c.master_addr, c.master_port,
                                             c.rendezvous_timeout.value_or(kDefaultNodesDoneWait));
  }
  const int port = store ? store->port() : c.master_port != 0 ? c.master_port : detail::find_free_port(c.master_addr);
  // With several nodes, a sign of life for the others (a lost node is then named in seconds).
  std::optional<detail::Heartbeat> heartbeat;
  if (store && c.nnodes > 1) heartbeat.emplace(c.master_addr, port, c.node_rank);
  const detail::SignalForwarding forwarding(/*ignore_after_signal=*/true);
  const LaunchFolder folder;
  if (folder.path().empty()) {
    log << "ddp-launch: warning: could not make a folder in " << (std::getenv("TMPDIR") ? "TMPDIR" : "/tmp")
        << " for the workers' error and progress files: errors are quoted from stderr only, hangs are not watched"
        << std::endl;
  }
  std::optional<detail::Rendezvous> rendezvous;
  if (c.elastic()) {
    rendezvous.emplace(*store, detail::Rendezvous::Options{c.node_rank, *c.min_nodes, c.nnodes, c.rejoin_wait,
                                                           c.rendezvous_timeout.value_or(kDefaultNodesDoneWait),
                                                           [] { return detail::SignalForwarding::received() != 0; }});
  }
  detail::RestartBudget budget(c.max_restarts);
  std::string restart_line;  // node 0 of an elastic job: sent to the other nodes with the next round's outcome
  std::vector<int> members;  // elastic: the node ids of the last attempt
  for (int attempt = rendezvous && !host ? store->current_round() : 0;; ++attempt) {
    LaunchConfig here = c;  // elastic: this attempt's nodes and this node's rank among them
    AttemptNodes nodes{c.node_rank, {}};
    for (int id = 0; id < c.nnodes; ++id) nodes.all.push_back(id);
    if (rendezvous) {
      if (const std::optional<int> exit_code =
              take_round(c, *rendezvous, restart_line, attempt, here, nodes, members, log)) {
        return *exit_code;
      }
    }
    const AttemptEnd end =
        run_attempt(here, port, attempt, nodes, store.get(), rendezvous && host ? &*rendezvous : nullptr, folder, log);
    // Node 0 of an elastic job ends it for the nodes that come to the next round (`expected` of them at least).
    const auto end_job = [&](int exit_code, const std::string& message, int expected) {
      if (rendezvous && host) rendezvous->end(attempt + 1, exit_code, message, expected, c.kill_grace + kLeaveWait);
    };
    if (end.succeeded && end.resumable) {  // not a failure: nothing charged to --max-restarts, and no restart
      log << "ddp-launch: the workers stopped at a step boundary and saved (exit code " << kExitResumable
          << ": resumable); the same command continues the job" << std::endl;
      end_job(kExitResumable, "ddp-launch: the job stopped, resumable, before this node was admitted\n", 0);
      return kExitResumable;
    }
    if (end.succeeded) {
      end_job(0, "ddp-launch: the job finished before this node was admitted\n", 0);
      return 0;
    }
    // The job ends here for this node: node 0, which hosts the store, stays until the others no longer need it.
    const auto leave_the_others = [&] {
      if (!store || here.nnodes == 1) return;
      if (host) {
        try {
          store->wait_for_leavers(attempt, here.nnodes - 1, c.kill_grace + kLeaveWait);
        } catch (const c10::Error&) {
        }
      } else {
        store->leave(attempt);
      }
    };
    // Asked to stop (SIGINT/SIGTERM): never restarted. A worker that had failed before keeps its summary and code.
    if (const int received = detail::SignalForwarding::received(); received != 0) {
      log << "ddp-launch: asked to stop by signal " << received << " (" << ::strsignal(received)
          << "): forwarded it to its " << c.nproc_per_node << " worker" << (c.nproc_per_node == 1 ? "" : "s")
          << " and stopped them" << std::endl;
      const int exit_code = end.asked_to_stop ? kSignalExitBase + received : end.exit_code;
      if (rendezvous) {
        end_job(exit_code, "ddp-launch: node 0 was asked to stop; the job ended\n", here.nnodes - 1);
      } else {
        leave_the_others();
      }
      return exit_code;
    }
    // Elastic: node 0 decides whether and why the job goes on; the next round's outcome tells the other nodes.
    if (rendezvous && !host) continue;
    if (end.cause.rfind(detail::kMembershipChange, 0) == 0) {  // not a failure: not charged to the budget
      restart_line = "ddp-launch: restart for a " + end.cause + "\n";
      log << restart_line << std::flush;
      continue;
    }
    if (!budget.record_failure(attempt, end.cause)) {
      const std::string summary = budget.give_up_summary("ddp-launch: ");
      log << summary << std::flush;
      if (rendezvous) {
        end_job(end.exit_code, summary, here.nnodes - 1);
      } else {
        leave_the_others();
      }
      return end.exit_code;
    }
    restart_line = "ddp-launch: " + budget.restart_line() + "\n";
    log << restart_line << std::flush;
  }
}

}  // namespace ddp
