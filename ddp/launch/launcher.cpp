#include <ddp/launch/launcher.h>

#include <sys/prctl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fcntl.h>

#include <cerrno>
#include <climits>
#include <cmath>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <sstream>

#include <c10/util/Exception.h>
#include <CLI/CLI.hpp>

#include <ddp/launch/worker_group.h>
#include <ddp/process_group.h>

extern char** environ;

namespace ddp {
namespace {

constexpr int kExitNotFound = 127;       // the shell's code for "command not found" (POSIX)
constexpr int kExitNotExecutable = 126;  // the shell's code for "found, but it cannot be executed" (POSIX)
constexpr int kSignalExitBase = 128;     // the shell's convention for "ended by signal N"
constexpr int kExitUsage = 2;            // CLI11's and most tools' code for a bad command line
constexpr int kMaxPort = 65535;

volatile std::sig_atomic_t g_pending_signal = 0;   // to forward, reset by the supervisor
volatile std::sig_atomic_t g_received_signal = 0;  // the last one received, for the exit code

extern "C" void on_forwarded_signal(int signal) {
  g_pending_signal = signal;
  g_received_signal = signal;
}

/// Installs the forwarding handler for SIGINT and SIGTERM for one launch, and restores the previous ones.
class SignalForwarding {
 public:
  SignalForwarding() {
    g_pending_signal = 0;
    g_received_signal = 0;
    struct sigaction action {};
    action.sa_handler = on_forwarded_signal;
    sigemptyset(&action.sa_mask);
    ::sigaction(SIGINT, &action, &old_int_);
    ::sigaction(SIGTERM, &action, &old_term_);
  }
  ~SignalForwarding() {
    ::sigaction(SIGINT, &old_int_, nullptr);
    ::sigaction(SIGTERM, &old_term_, nullptr);
  }
  SignalForwarding(const SignalForwarding&) = delete;
  SignalForwarding& operator=(const SignalForwarding&) = delete;

 private:
  struct sigaction old_int_ {};
  struct sigaction old_term_ {};
};

void validate(const LaunchConfig& c) {
  TORCH_CHECK(c.nproc_per_node >= 1, "--nproc-per-node must be a positive integer, got ", c.nproc_per_node);
  TORCH_CHECK(c.nnodes >= 1, "--nnodes must be a positive integer, got ", c.nnodes);
  TORCH_CHECK(c.node_rank >= 0 && c.node_rank < c.nnodes, "--node-rank must be in [0, ", c.nnodes, ") for --nnodes ",
              c.nnodes, ", got ", c.node_rank);
  TORCH_CHECK(c.master_port >= 0 && c.master_port <= kMaxPort, "--master-port must be in [0, ", kMaxPort, "], got ",
              c.master_port);
  TORCH_CHECK(c.master_port != 0 || c.nnodes == 1,
              "--master-port 0 (pick a free port) works only with --nnodes 1: the other nodes must know the port");
  TORCH_CHECK(!c.master_addr.empty(), "--master-addr is empty");
  TORCH_CHECK(c.kill_grace.count() >= 0, "--kill-grace-s must be a non-negative number of seconds, got ",
              c.kill_grace.count() / 1000.0);
  TORCH_CHECK(!c.rendezvous_timeout || c.rendezvous_timeout->count() > 0,
              "--rendezvous-timeout-s must be a positive number of seconds");
  TORCH_CHECK(!c.collective_timeout || c.collective_timeout->count() > 0,
              "--collective-timeout-s must be a positive number of seconds");
  TORCH_CHECK(!c.command.empty(), "no program given: ddp-launch [options] program [args...]");
}

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

/// The whole of `text` as an integer in [min_value, max_value]; else an error "<flag> must be <what>, got <text>".
int int_flag(const std::string& flag, const std::string& text, long min_value, long max_value, const char* what) {
  errno = 0;
  char* end = nullptr;
  const long value = std::strtol(text.c_str(), &end, 10);
  const bool whole = !text.empty() && *end == '\0' && errno == 0;
  TORCH_CHECK(whole && value >= min_value && value <= max_value, flag, " must be ", what, ", got ",
              whole ? text : "'" + text + "'");
  return static_cast<int>(value);
}

/// The whole of `text` as seconds (a finite number, > 0 or >= 0 as `positive` says), in milliseconds.
std::chrono::milliseconds seconds_flag(const std::string& flag, const std::string& text, bool positive) {
  char* end = nullptr;
  const double seconds = std::strtod(text.c_str(), &end);
  constexpr double kMaxSeconds = 1e9;  // ~30 years: more is a typo, and would overflow the milliseconds
  const bool whole = !text.empty() && *end == '\0' && std::isfinite(seconds);
  TORCH_CHECK(whole && (positive ? seconds > 0 : seconds >= 0) && seconds <= kMaxSeconds, flag, " must be a ",
              positive ? "positive" : "non-negative", " number of seconds, got ", whole ? text : "'" + text + "'");
  return std::chrono::milliseconds(std::llround(seconds * 1000));
}

std::string seconds_value(std::chrono::milliseconds duration) {
  std::ostringstream out;
  out << static_cast<double>(duration.count()) / 1000.0;
  return out.str();
}

constexpr const char* kUsage = "Usage: ddp-launch [options] [--] program [args...]";

/// CLI11's help with our usage line (its own would read "ddp-launch [OPTIONS]", and a second one in the
/// description made two).
class LaunchHelpFormatter : public CLI::Formatter {
 public:
  std::string make_usage(const CLI::App*, std::string) const override { return std::string(kUsage) + "\n"; }
};

ParsedLaunchArgs usage_error(const std::string& message) {
  ParsedLaunchArgs result;
  result.exit_code = kExitUsage;
  result.output = "ddp-launch: " + message + " (run ddp-launch --help for usage)\n";
  return result;
}

}  // namespace

ParsedLaunchArgs parse_launch_args(int argc, const char* const* argv) {
  LaunchConfig c;
  // Numbers are taken as text and checked here, so that errors read "--nnodes must be a positive integer, got 0"
  // rather than CLI11's "Value 0 not in range 0.000000 to 1797693134862315708145...".
  std::string nproc_per_node, nnodes = "1", node_rank = "0", master_port = std::to_string(c.master_port);
  std::string kill_grace_s = seconds_value(c.kill_grace), rendezvous_timeout_s, collective_timeout_s;
  CLI::App app{
      "ddp-launch: starts a data-parallel job's worker processes on this node with the torchrun environment "
      "contract (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK). Options "
      "come before the program; -- ends them.",
      "ddp-launch"};
  app.formatter(std::make_shared<LaunchHelpFormatter>());
  app.option_defaults()->always_capture_default();  // --help shows each default: "--master-port TEXT=29500"
  app.add_option("--nproc-per-node,--nproc_per_node", nproc_per_node, "Worker processes on this node")->required();
  app.add_option("--nnodes", nnodes, "Nodes in the job");
  app.add_option("--node-rank,--node_rank", node_rank, "This node's rank; node 0 hosts the rendezvous");
  app.add_option("--master-addr,--master_addr", c.master_addr, "Address of node 0");
  app.add_option("--master-port,--master_port", master_port,
                 "Rendezvous port on node 0 (0: any free port, one node only)");
  app.add_flag("--local-rank-arg", c.local_rank_arg, "Also pass --local-rank=N to each worker");
  app.add_option("--kill-grace-s", kill_grace_s, "After a failure, seconds between SIGTERM and SIGKILL");
  app.add_option("--rendezvous-timeout-s,--rdzv-timeout-s", rendezvous_timeout_s,
                 "Seconds the workers wait for all ranks to join before giving up (DDP_RENDEZVOUS_TIMEOUT_S; "
                 "default 600)");
  app.add_option("--collective-timeout-s", collective_timeout_s,
                 "Seconds a collective may take before the workers give up (DDP_COLLECTIVE_TIMEOUT_S; default "
                 "1800)");
  app.prefix_command();  // everything from the program on belongs to the program

  ParsedLaunchArgs result;
  try {
    app.parse(argc, argv);
    std::vector<std::string> rest = app.remaining();
    // CLI11 moves an unknown option into the remaining arguments and parses on; "--" stays in them as a marker.
    if (!rest.empty() && rest.front() == "--") {
      rest.erase(rest.begin());
    } else if (!rest.empty() && rest.front().size() > 1 && rest.front().front() == '-') {
      return usage_error("unknown option '" + rest.front() +
                         "': launcher options come before the program (put -- before a program whose name "
                         "starts with '-')");
    }
    c.command = std::move(rest);
    c.nproc_per_node = int_flag("--nproc-per-node", nproc_per_node, 1, INT_MAX, "a positive integer");
    c.nnodes = int_flag("--nnodes", nnodes, 1, INT_MAX, "a positive integer");
    c.node_rank = int_flag("--node-rank", node_rank, 0, INT_MAX, "a non-negative integer");
    c.master_port = int_flag("--master-port", master_port, 0, kMaxPort, "an integer in [0, 65535]");
    c.kill_grace = seconds_flag("--kill-grace-s", kill_grace_s, /*positive=*/false);
    if (!rendezvous_timeout_s.empty()) {
      c.rendezvous_timeout = seconds_flag("--rendezvous-timeout-s", rendezvous_timeout_s, /*positive=*/true);
    }
    if (!collective_timeout_s.empty()) {
      c.collective_timeout = seconds_flag("--collective-timeout-s", collective_timeout_s, /*positive=*/true);
    }
    validate(c);
  } catch (const CLI::CallForHelp&) {
    result.output = app.help();
    return result;
  } catch (const CLI::ParseError& e) {
    return usage_error(e.what());
  } catch (const c10::Error& e) {
    return usage_error(e.what_without_backtrace());
  }
  result.config = std::move(c);
  return result;
}

std::vector<std::pair<std::string, std::string>> worker_environment(const LaunchConfig& c, int local_rank,
                                                                    int master_port) {
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
  if (c.rendezvous_timeout) env.emplace_back(kRendezvousTimeoutEnv, seconds_value(*c.rendezvous_timeout));
  if (c.collective_timeout) env.emplace_back(kCollectiveTimeoutEnv, seconds_value(*c.collective_timeout));
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

int run_launch(const LaunchConfig& c, std::ostream& log) {
  validate(c);
  // Before any worker starts: a program that cannot run is one line, not the same error from every worker.
  if (const std::optional<ProgramProblem> problem = check_program(c.command.front())) {
    log << "ddp-launch: " << problem->message << std::endl;
    return problem->exit_code;
  }
  const int port = c.master_port != 0 ? c.master_port : detail::find_free_port(c.master_addr);
  SignalForwarding forwarding;
  const pid_t parent = ::getpid();
  detail::WorkerGroup group;
  for (int local_rank = 0; local_rank < c.nproc_per_node; ++local_rank) {
    CStrings argv(worker_command(c, local_rank));
    CStrings envp = full_environment(worker_environment(c, local_rank, port));
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
      ::signal(SIGINT, SIG_DFL);
      ::signal(SIGTERM, SIG_DFL);
      ::dup2(stderr_pipe[1], STDERR_FILENO);  // the copy does not inherit O_CLOEXEC; both originals close on exec
      ::execvpe(argv.pointers[0], argv.pointers.data(), envp.pointers.data());
      const std::string message = "ddp-launch: cannot run '" + argv.strings[0] + "': " + std::strerror(errno) + "\n";
      (void)!::write(STDERR_FILENO, message.data(), message.size());
      ::_exit(kExitNotFound);
    }
    ::close(stderr_pipe[1]);
    group.add(c.node_rank * c.nproc_per_node + local_rank, local_rank, pid, /*message_fd=*/-1, stderr_pipe[0]);
  }
  const std::vector<detail::WorkerExit> failures = group.wait(c.kill_grace, &g_pending_signal, STDERR_FILENO);
  const int received = g_received_signal;
  const bool asked_to_stop = received != 0 && (failures.empty() || failures.front().after_forwarded_signal);
  if (!failures.empty() && !asked_to_stop) log << detail::describe_failures(failures, "ddp-launch: ");
  if (received != 0) {
    log << "ddp-launch: asked to stop by signal " << received << " (" << ::strsignal(received)
        << "): forwarded it to its " << c.nproc_per_node << " worker" << (c.nproc_per_node == 1 ? "" : "s")
        << " and stopped them" << std::endl;
  }
  log.flush();
  if (!failures.empty() && !asked_to_stop) return detail::exit_code_of(failures.front().wait_status);
  if (received != 0) return kSignalExitBase + received;
  return 0;
}

}  // namespace ddp
