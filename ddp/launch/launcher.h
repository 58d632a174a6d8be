#pragma once

#include <chrono>
#include <optional>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

namespace ddp {

/// torchrun's default rendezvous port.
constexpr int kDefaultMasterPort = 29500;

/// --hang-timeout-s's default: PyTorch's default timeout for NCCL collectives (10 minutes), the time a stuck rank
/// may already take there; Gloo's collectives here time out after 30. docs/launcher.md, "Faults".
constexpr std::chrono::milliseconds kDefaultHangTimeout{600000};

/// What ddp-launch was asked to do.
struct LaunchConfig {
  int nproc_per_node = 1;  ///< workers on this node
  int nnodes = 1;          ///< nodes in the job (elastic: at most)
  int node_rank = 0;       ///< this node's place, 0 <= node_rank < nnodes; node 0 hosts the rendezvous
  /// Elastic (--nnodes MIN:MAX, torchrun's syntax), when set below nnodes: each attempt runs with the nodes present,
  /// at least this many (detail::Rendezvous). A node's rank in an attempt is its place among the node ranks present.
  std::optional<int> min_nodes;
  /// Elastic: how long node 0 waits for missing nodes before an attempt starts with fewer (at least min_nodes).
  std::chrono::milliseconds rejoin_wait{30000};
  std::string master_addr = "127.0.0.1";       ///< node 0's address, where the rendezvous store listens
  int master_port = kDefaultMasterPort;        ///< 0: pick a free port (single node only)
  bool local_rank_arg = false;                 ///< also pass --local-rank=N to each worker (the legacy launcher's way)
  std::chrono::milliseconds kill_grace{5000};  ///< after a failure: SIGTERM to the others, SIGKILL after this
  /// After a signal the launcher forwards (SIGINT, SIGTERM, SIGUSR1, SIGUSR2), how long the workers get to stop on
  /// their own (a preemption-aware worker saves then) before SIGKILL. torchrun's is a fixed 30 s.
  std::chrono::milliseconds stop_grace{30000};
  /// The workers' rendezvous timeout, passed as DDP_RENDEZVOUS_TIMEOUT_S (see ddp::InitOptions); unset: not passed,
  /// the workers' default applies.
  std::optional<std::chrono::milliseconds> rendezvous_timeout;
  /// The workers' collective timeout, passed as DDP_COLLECTIVE_TIMEOUT_S (see ddp::InitOptions); unset: not passed,
  /// the workers' default applies.
  std::optional<std::chrono::milliseconds> collective_timeout;
  /// After a failure, start all workers again up to this many times (torchrun's --max-restarts). With restarts the
  /// launcher of node 0 hosts the rendezvous store on the master port (as torchrun's agent does) and every
  /// node's launcher watches it, so that all nodes restart together.
  int max_restarts = 0;
  /// A worker that waits this long in a collective without progress (steps and collectives, reported by the library
  /// without a host sync) hangs: the worker it waits for is named, and the workers are stopped (and restarted, with
  /// restarts left). The first training step is not timed, nor waits while a worker is in a ddp::ProgressPause (a
  /// save, an evaluation), up to 5 timeouts (detail::HealthWatch). 0: off.
  std::chrono::milliseconds hang_timeout{kDefaultHangTimeout};
  std::vector<std::string> command;  ///< the worker program and its arguments

  /// Whether the job is elastic: min_nodes is set and below nnodes.
  bool elastic() const { return min_nodes && *min_nodes < nnodes; }
};

/// What one start of the workers tells them beyond the rendezvous (torchrun's names).
struct WorkerAttempt {
  int restart_count = 0;      ///< TORCHELASTIC_RESTART_COUNT: 0 for the first start
  bool agent_store = false;   ///< TORCHELASTIC_USE_AGENT_STORE: the launcher hosts the store, not rank 0
  std::string error_file;     ///< TORCHELASTIC_ERROR_FILE: where a failing worker writes its error (ddp::record_error)
  std::string progress_file;  ///< DDP_PROGRESS_FILE: where it reports progress for hang detection (ddp/progress.h)
};

/// The result of parsing ddp-launch's command line: a config to run, or (for --help and for errors) the text
/// to print and the exit code.
struct ParsedLaunchArgs {
  /// The validated config; nullopt after --help or an error.
  std::optional<LaunchConfig> config;
  /// 0 with a config or after --help; 2 (a usage error) otherwise.
  int exit_code = 0;
  std::string output;  ///< help (stdout) or the error (stderr)
};

/// Parses `ddp-launch [options] [--] program [args...]` (torchrun's spellings with '_' are accepted too). Options
/// end at the program: its own arguments are passed through untouched. An unknown option before the program is an
/// error naming it; `--` ends the options (for a program whose name starts with '-'). Errors are one line:
/// "ddp-launch: --nproc-per-node must be a positive integer, got 0 (run ddp-launch --help for usage)".
ParsedLaunchArgs parse_launch_args(int argc, const char* const* argv);

/// The environment contract for local worker `local_rank`: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE,
/// LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, OMP_NUM_THREADS=1 when several workers share the node and the
/// caller did not set it (torchrun's default), the timeouts that are set (DDP_RENDEZVOUS_TIMEOUT_S,
/// DDP_COLLECTIVE_TIMEOUT_S, in seconds), and the attempt's TORCHELASTIC_RESTART_COUNT, TORCHELASTIC_MAX_RESTARTS,
/// TORCHELASTIC_USE_AGENT_STORE ("True"/"False"), TORCHELASTIC_ERROR_FILE and DDP_PROGRESS_FILE (when given).
std::vector<std::pair<std::string, std::string>> worker_environment(const LaunchConfig& config, int local_rank,
                                                                    int master_port, const WorkerAttempt& attempt = {});

/// The worker's argv: the command, with --local-rank=N inserted after the program when local_rank_arg is set.
std::vector<std::string> worker_command(const LaunchConfig& config, int local_rank);

/// Why a program cannot be run: the shell's exit code for it and one line naming it.
struct ProgramProblem {
  int exit_code = 0;    ///< 127: not found; 126: found but not runnable (POSIX's codes, as shells return them)
  std::string message;  ///< "cannot run '/opt/train': no such file", without the "ddp-launch: " prefix
};

/// Looks `program` up as execvp will: a name with a '/' is that file; a bare name is the first executable file of
/// that name in a folder of PATH (an empty entry is the current folder; PATH unset: the system's default path).
/// Returns nullopt when it is a regular file this process may execute, else what is wrong: "no such file" (127),
/// "not found in PATH" (127, with a hint when the current folder has it), "it is a folder, not a program",
/// "it is not executable (no execute permission)", another file type, or why it could not be looked at (126).
/// Does not run anything; a file that changes afterwards still fails in the worker's exec.
std::optional<ProgramProblem> check_program(const std::string& program);

/// Starts the node's workers and supervises them until all have exited (and, with --max-restarts, starts them
/// again after a failure: "ddp-launch: restart 1 of 3 after: <cause>", until they succeed or the budget is spent;
/// then "ddp-launch: gave up after 3 restarts ...; the failures in order:" and one line per failure). A failing
/// worker's error file (TORCHELASTIC_ERROR_FILE, see ddp::record_error) is quoted in its line. Each worker's stderr
/// passes through the launcher line by line (to this process's stderr), which keeps its last line. SIGINT and SIGTERM
/// received meanwhile are forwarded to every worker. When a worker fails, the others are stopped and `log` gets a
/// summary: "ddp-launch: root cause: rank R (local rank L, pid P) exited with code C; its last stderr line: ..." for
/// the first failure, then one "ddp-launch: consequence: ..." line per other failed or stopped worker; workers that
/// failed alike share a line ("ranks 0-1 ..."), and an error every worker hit alike is that one line, with no root
/// cause (detail::describe_failures). When the
/// launcher was asked to stop (SIGINT/SIGTERM), the last line says so instead. A program that check_program()
/// refuses starts no worker: `log` gets its one line ("ddp-launch: cannot run './train': no such file"). Returns
/// ddp-launch's exit code: 0, the root cause's code (128 + signal when killed), check_program's 127 or 126 (or
/// 127 when exec fails in a worker all the same), or 128 + the signal the launcher received when it was asked to
/// stop.
int run_launch(const LaunchConfig& config, std::ostream& log);

namespace detail {
/// Throws c10::Error with one line naming the flag when `config` is not one to run ("--node-rank must be in [0, 2)
/// for --nnodes 2, got 2"). parse_launch_args and run_launch call it.
void validate_launch_config(const LaunchConfig& config);
}  // namespace detail

}  // namespace ddp
