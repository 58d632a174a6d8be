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

/// What ddp-launch was asked to do.
struct LaunchConfig {
  int nproc_per_node = 1;  // workers on this node
  int nnodes = 1;          // nodes in the job
  int node_rank = 0;       // this node's place, 0 <= node_rank < nnodes; node 0 hosts the rendezvous
  std::string master_addr = "127.0.0.1";
  int master_port = kDefaultMasterPort;        // 0: pick a free port (single node only)
  bool local_rank_arg = false;                 // also pass --local-rank=N to each worker (the legacy launcher's way)
  std::chrono::milliseconds kill_grace{5000};  // after a failure: SIGTERM to the others, SIGKILL after this
  /// The workers' rendezvous and collective timeouts, passed as DDP_RENDEZVOUS_TIMEOUT_S and
  /// DDP_COLLECTIVE_TIMEOUT_S (see ddp::InitOptions); unset: not passed, the workers' defaults apply.
  std::optional<std::chrono::milliseconds> rendezvous_timeout;
  std::optional<std::chrono::milliseconds> collective_timeout;
  std::vector<std::string> command;  // the worker program and its arguments
};

/// The result of parsing ddp-launch's command line: a config to run, or (for --help and for errors) the text
/// to print and the exit code.
struct ParsedLaunchArgs {
  std::optional<LaunchConfig> config;
  int exit_code = 0;
  std::string output;  // help (stdout) or the error (stderr)
};

/// Parses `ddp-launch [options] [--] program [args...]` (torchrun's spellings with '_' are accepted too). Options
/// end at the program: its own arguments are passed through untouched. An unknown option before the program is an
/// error naming it; `--` ends the options (for a program whose name starts with '-'). Errors are one line:
/// "ddp-launch: --nproc-per-node must be a positive integer, got 0 (run ddp-launch --help for usage)".
ParsedLaunchArgs parse_launch_args(int argc, const char* const* argv);

/// The environment contract for local worker `local_rank`: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE,
/// LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, OMP_NUM_THREADS=1 when several workers share the node and the
/// caller did not set it (torchrun's default), and the timeouts that are set (DDP_RENDEZVOUS_TIMEOUT_S,
/// DDP_COLLECTIVE_TIMEOUT_S, in seconds).
std::vector<std::pair<std::string, std::string>> worker_environment(const LaunchConfig& config, int local_rank,
                                                                    int master_port);

/// The worker's argv: the command, with --local-rank=N inserted after the program when local_rank_arg is set.
std::vector<std::string> worker_command(const LaunchConfig& config, int local_rank);

/// Starts the node's workers and supervises them until all have exited. Each worker's stderr passes through the
/// launcher line by line (to this process's stderr), which keeps its last line. SIGINT and SIGTERM received
/// meanwhile are forwarded to every worker. When a worker fails, the others are stopped and `log` gets a summary:
/// "ddp-launch: root cause: rank R (local rank L, pid P) exited with code C; its last stderr line: ..." for the
/// first failure, then one "ddp-launch: consequence: ..." line per other failed or stopped worker. When the
/// launcher was asked to stop (SIGINT/SIGTERM), the last line says so instead. Returns ddp-launch's exit code:
/// 0, the root cause's code (128 + signal when killed), 127 when the program cannot be started, or 128 + the
/// signal the launcher received when it was asked to stop.
int run_launch(const LaunchConfig& config, std::ostream& log);

}  // namespace ddp
