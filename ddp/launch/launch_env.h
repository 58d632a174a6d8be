#pragma once

#include <optional>
#include <string>

namespace ddp {

/// The torchrun environment contract: what a launcher (ddp-launch, torchrun, torch.distributed.launch) tells
/// each worker process.
struct LaunchEnv {
  std::string master_addr;   ///< MASTER_ADDR: host of rank 0's TCPStore
  int master_port = 0;       ///< MASTER_PORT: 1..65535
  int rank = 0;              ///< RANK: global rank, 0 <= rank < world_size
  int world_size = 1;        ///< WORLD_SIZE: number of processes in the job
  int local_rank = 0;        ///< LOCAL_RANK: rank on this node, 0 <= local_rank < local_world_size
  int local_world_size = 1;  ///< LOCAL_WORLD_SIZE: processes on this node
};

/// Reads LaunchEnv from the environment. The torchrun contract first: when RANK and WORLD_SIZE are set,
/// MASTER_ADDR and MASTER_PORT are required too, LOCAL_WORLD_SIZE defaults to WORLD_SIZE and LOCAL_RANK to RANK mod
/// LOCAL_WORLD_SIZE. Else a cluster launcher's variables (cluster_env.h: a Slurm job step, Open MPI, MPICH / Intel
/// MPI). Else the torchrun variables are required. Throws c10::Error naming the variable and its value when one is
/// missing, not an integer, or out of range.
LaunchEnv launch_env_from_environment();

/// True when this process is one of a launched job's ranks: RANK and WORLD_SIZE are set, or a cluster launcher's
/// variables say so (cluster_env.h).
bool launched_by_launcher();

/// Finds the legacy launcher's local-rank argument: `--local_rank=N`, `--local-rank=N` (PyTorch >= 2.0
/// spelling), or either followed by N as the next argument. Returns nullopt when absent; throws naming the
/// argument when its value is not a non-negative integer.
std::optional<int> parse_local_rank_arg(int argc, const char* const* argv);

namespace detail {
/// The variable's value, or nullopt when unset.
std::optional<std::string> env_value(const char* name);
/// `text` as a base-10 int in [min_value, max_value]; throws naming `what` and the text otherwise.
int parse_env_int(const std::string& text, const std::string& what, long min_value, long max_value);
}  // namespace detail

}  // namespace ddp
