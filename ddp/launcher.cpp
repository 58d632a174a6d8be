#include <ddp/launcher.h>

#include <sys/prctl.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <sstream>

#include <c10/util/Exception.h>
#include <CLI/CLI.hpp>

#include <ddp/worker_group.h>

extern char** environ;

namespace ddp {
namespace {

constexpr int kExitCannotExec = 127;  // the shell's code for "command not found / not executable"
constexpr int kSignalExitBase = 128;  // the shell's convention for "ended by signal N"
constexpr int kExitUsage = 2;         // CLI11's and most tools' code for a bad command line
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
  TORCH_CHECK(c.nproc_per_node >= 1, "--nproc-per-node must be >= 1, got ", c.nproc_per_node);
  TORCH_CHECK(c.nnodes >= 1, "--nnodes must be >= 1, got ", c.nnodes);
  TORCH_CHECK(c.node_rank >= 0 && c.node_rank < c.nnodes, "--node-rank must be in [0, ", c.nnodes, ") for --nnodes ",
              c.nnodes, ", got ", c.node_rank);
  TORCH_CHECK(c.master_port >= 0 && c.master_port <= kMaxPort, "--master-port must be in [0, ", kMaxPort, "], got ",
              c.master_port);
  TORCH_CHECK(c.master_port != 0 || c.nnodes == 1,
              "--master-port 0 (pick a free port) works only with --nnodes 1: the other nodes must know the port");
  TORCH_CHECK(!c.master_addr.empty(), "--master-addr is empty");
  TORCH_CHECK(!c.command.empty(), "no program given: ddp-launch [options] program [args...]");
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

ParsedLaunchArgs parse_launch_args(int argc, const char* const* argv) {
  LaunchConfig c;
  double kill_grace_s = std::chrono::duration<double>(c.kill_grace).count();
  CLI::App app{
      "ddp-launch: starts a data-parallel job's worker processes on this node with the torchrun environment "
      "contract (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK).\n"
      "Usage: ddp-launch [options] program [args...]",
      "ddp-launch"};
  app.add_option("--nproc-per-node,--nproc_per_node", c.nproc_per_node, "Worker processes on this node")
      ->required()
      ->check(CLI::PositiveNumber);
  app.add_option("--nnodes", c.nnodes, "Nodes in the job")->check(CLI::PositiveNumber);
  app.add_option("--node-rank,--node_rank", c.node_rank, "This node's rank; node 0 hosts the rendezvous")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--master-addr,--master_addr", c.master_addr, "Address of node 0");
  app.add_option("--master-port,--master_port", c.master_port, "Rendezvous port on node 0 (0: any free port)")
      ->check(CLI::Range(0, kMaxPort));
  app.add_flag("--local-rank-arg", c.local_rank_arg, "Also pass --local-rank=N to each worker");
  app.add_option("--kill-grace-s", kill_grace_s, "After a failure, seconds between SIGTERM and SIGKILL")
      ->check(CLI::NonNegativeNumber);
  app.prefix_command();  // everything from the program on belongs to the program

  ParsedLaunchArgs result;
  std::ostringstream out, err;
  try {
    app.parse(argc, argv);
    c.command = app.remaining();
    c.kill_grace = std::chrono::milliseconds(static_cast<int64_t>(kill_grace_s * 1000));
    validate(c);
  } catch (const CLI::ParseError& e) {
    result.exit_code = app.exit(e, out, err);
    result.output = out.str() + err.str();
    return result;
  } catch (const c10::Error& e) {
    result.exit_code = kExitUsage;
    result.output =
        std::string("ddp-launch: ") + e.what_without_backtrace() + "\nRun with --help for more information.\n";
    return result;
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
  return env;
}

std::vector<std::string> worker_command(const LaunchConfig& c, int local_rank) {
  std::vector<std::string> argv = c.command;
  if (c.local_rank_arg && !argv.empty()) {
    argv.insert(argv.begin() + 1, "--local-rank=" + std::to_string(local_rank));
  }
  return argv;
}

int run_launch(const LaunchConfig& c, std::ostream& log) {
  validate(c);
  const int port = c.master_port != 0 ? c.master_port : detail::find_free_port(c.master_addr);
  SignalForwarding forwarding;
  const pid_t parent = ::getpid();
  detail::WorkerGroup group;
  for (int local_rank = 0; local_rank < c.nproc_per_node; ++local_rank) {
    CStrings argv(worker_command(c, local_rank));
    CStrings envp = full_environment(worker_environment(c, local_rank, port));
    const pid_t pid = ::fork();
    TORCH_CHECK(pid >= 0, "fork() failed for local rank ", local_rank, ": ", std::strerror(errno));
    if (pid == 0) {
      ::setpgid(0, 0);
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);  // a launcher killed with SIGKILL takes its workers along
      if (::getppid() != parent) ::_exit(kExitCannotExec);
      ::signal(SIGINT, SIG_DFL);
      ::signal(SIGTERM, SIG_DFL);
      ::execvpe(argv.pointers[0], argv.pointers.data(), envp.pointers.data());
      const std::string message = "ddp-launch: cannot run '" + argv.strings[0] + "': " + std::strerror(errno) + "\n";
      (void)!::write(STDERR_FILENO, message.data(), message.size());
      ::_exit(kExitCannotExec);
    }
    group.add(c.node_rank * c.nproc_per_node + local_rank, local_rank, pid);
  }
  const auto failure = group.wait(c.kill_grace, &g_pending_signal);
  if (failure) {
    log << "ddp-launch: rank " << failure->rank << " (local rank " << failure->local_rank << ", pid " << failure->pid
        << ") " << detail::describe_status(failure->wait_status) << std::endl;
    return detail::exit_code_of(failure->wait_status);
  }
  if (g_received_signal != 0) return kSignalExitBase + g_received_signal;
  return 0;
}

}  // namespace ddp
