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

/// Reads LaunchEnv from the environment. MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE are required;
/// LOCAL_WORLD_SIZE defaults to WORLD_SIZE and LOCAL_RANK to RANK mod LOCAL_WORLD_SIZE when absent.
/// Throws c10::Error naming the variable and its value when one is missing, not an integer, or out of range.
LaunchEnv launch_env_from_environment();

/// True when the launcher's variables (RANK and WORLD_SIZE) are present, i.e. the process was launched.
bool launched_by_launcher();

/// Finds the legacy launcher's local-rank argument: `--local_rank=N`, `--local-rank=N` (PyTorch >= 2.0
/// spelling), or either followed by N as the next argument. Returns nullopt when absent; throws naming the
/// argument when its value is not a non-negative integer.
std::optional<int> parse_local_rank_arg(int argc, const char* const* argv);

}  // namespace ddp
