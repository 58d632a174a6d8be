#pragma once
// The launch environment as a cluster's own launcher sets it: Slurm job steps (srun, and the tasks of sbatch's
// srun), Open MPI's mpirun, and MPICH / Intel MPI (PMI). launch_env.h's launch_env_from_environment() reads the
// torchrun contract first (explicit RANK and WORLD_SIZE win), then this. The one place that knows these variables;
// docs/clusters.md lists them and the order.

#include <optional>
#include <string>
#include <vector>

#include <ddp/launch/launch_env.h>

namespace ddp {

/// Which cluster launcher started this process (the torchrun contract is launch_env.h's).
enum class Launcher {
  kSlurm,    ///< a Slurm job step (srun): SLURM_PROCID with SLURM_STEP_ID
  kOpenMpi,  ///< Open MPI's mpirun: OMPI_COMM_WORLD_RANK
  kPmi,      ///< MPICH / Intel MPI (Hydra): PMI_RANK
};

/// What a cluster's launcher told this process, in the torchrun contract's terms.
struct ClusterEnv {
  Launcher launcher = Launcher::kSlurm;  ///< which launcher
  LaunchEnv env;                         ///< the ranks, sizes and rank 0's address
  /// One line for rank 0's header: "launched by slurm: job 1234, step 0, 2 nodes x 4 tasks" or "launched by
  /// Open MPI (mpirun): 2 processes, 2 per node (1 node)".
  std::string origin;
  int nnodes = 1;     ///< Slurm: the step's nodes (MPI: world / local size, rounded down)
  int node_rank = 0;  ///< Slurm: this node's place among them (MPI: rank / local size)
};

/// Reads a cluster launcher's variables, or nullopt when none of them says this process is one of a job's ranks, or
/// when the torchrun contract is there (RANK and WORLD_SIZE win: `srun torchrun ...`, `srun ddp-launch ...`). Open
/// MPI's first, then MPICH / Intel MPI's when MPI_LOCALRANKID is set (mpirun inside a Slurm allocation: the ranks
/// inherit the step of mpirun's daemons), then a Slurm job step's, then PMI_RANK / PMI_SIZE alone. Slurm: the rank is
/// SLURM_PROCID, the world size SLURM_STEP_NUM_TASKS (else SLURM_NTASKS), the local rank SLURM_LOCALID, the local size
/// this node's entry of SLURM_STEP_TASKS_PER_NODE (else SLURM_TASKS_PER_NODE); MASTER_ADDR (if not set) the first host
/// of SLURM_STEP_NODELIST (else SLURM_JOB_NODELIST), MASTER_PORT (if not set) 15000 + the last 4 digits of
/// SLURM_JOB_ID, as PyTorch Lightning derives it. Only a job step that srun started counts: a batch script or an salloc
/// shell (no SLURM_STEP_ID, or one of Slurm's special step ids for the batch, interactive and extern steps) is not a
/// rank. MPI: MASTER_ADDR must be set (MPI has no way to name rank 0's host without MPI calls), MASTER_PORT defaults to
/// 29500. Throws c10::Error naming the variable and its value when one does not parse, is out of range, or (MPI)
/// MASTER_ADDR is missing.
std::optional<ClusterEnv> cluster_env_from_environment();

/// Expands Slurm's hostlist syntax: "node[01-03,07],gpu3" -> node01 node02 node03 node07 gpu3 (zero padding kept,
/// several bracket groups in one name expanded left to right). Throws c10::Error naming `what` (the variable) and
/// the text when it does not parse.
std::vector<std::string> expand_slurm_hostlist(const std::string& text, const std::string& what = "hostlist");

/// Expands Slurm's tasks-per-node list: "4(x2),3" -> 4 4 3. Throws naming `what` and the text when it does not parse.
std::vector<int> expand_slurm_tasks_per_node(const std::string& text, const std::string& what = "tasks per node");

/// For ddp-launch started by srun with one task per node (the recipe PyTorch documents for torchrun under srun):
/// the step's nodes as --nnodes, --node-rank and --master-addr would give them (ClusterEnv's nnodes, node_rank and
/// env.master_addr). nullopt outside a Slurm job step. Throws (one line) in a step with more than one task on this
/// node: each task would start its own workers.
std::optional<ClusterEnv> slurm_step_for_launcher();

/// The intra-op threads a rank started by a cluster's launcher should use when OMP_NUM_THREADS is not set and
/// several ranks share its node, as torchrun (and ddp-launch) give each worker 1 there: SLURM_CPUS_PER_TASK under
/// Slurm when set (what the job asked for each task), else 1. nullopt when nothing is to change: under the torchrun
/// contract (the launcher has set OMP_NUM_THREADS), with OMP_NUM_THREADS set, or with one rank on the node.
/// ddp::init_process_group (env://) applies it, so that `srun -n 2 program` computes as `ddp-launch
/// --nproc-per-node 2 program` does.
std::optional<int> cluster_intra_op_threads();

}  // namespace ddp
