// ddp::cluster_env_from_environment and launch_env_from_environment under a cluster's launcher: the variables a Slurm
// job step, Open MPI's mpirun and MPICH / Intel MPI set, as those launchers set them (the real ones run in
// tests/cluster/); the order (torchrun's variables win); Slurm's hostlist and tasks-per-node syntax; and one line for
// each thing that does not parse.
#include <ddp/launch/cluster_env.h>

#include <cstdlib>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include <c10/util/Exception.h>
#include <ddp/launch/launch_env.h>
#include <ddp/launch/launcher.h>
#include <gtest/gtest.h>

#include "ddp/scoped_env.h"

namespace {

/// Exactly the given variables for one test; the process environment restored afterwards.
class ClusterEnvTest : public ::testing::Test {
 protected:
  static void set(const std::map<std::string, std::string>& vars) { ddp_test::ScopedEnv::set(vars); }
  /// Rank 5 of a step of 8 tasks on node02 of node[01-02] (4 each), job 81234, as srun sets them.
  static void slurm_step() {
    set({{"SLURM_JOB_ID", "81234"},
         {"SLURM_STEP_ID", "0"},
         {"SLURM_PROCID", "5"},
         {"SLURM_NTASKS", "8"},
         {"SLURM_STEP_NUM_TASKS", "8"},
         {"SLURM_LOCALID", "1"},
         {"SLURM_NODEID", "1"},
         {"SLURM_NNODES", "2"},
         {"SLURM_JOB_NODELIST", "node[01-02]"},
         {"SLURM_STEP_NODELIST", "node[01-02]"},
         {"SLURM_STEP_TASKS_PER_NODE", "4(x2)"},
         {"SLURM_TASKS_PER_NODE", "4(x2)"},
         {"SLURMD_NODENAME", "node02"}});
  }
  static std::string error_of(const std::function<void()>& fn) {
    try {
      fn();
    } catch (const c10::Error& e) {
      return e.what_without_backtrace();
    }
    return "(no error)";
  }
  ddp_test::ScopedEnv env_{ddp_test::kLaunchVariables};
};

TEST_F(ClusterEnvTest, SlurmHostlistsExpandAsSlurmDoes) {
  using V = std::vector<std::string>;
  EXPECT_EQ(ddp::expand_slurm_hostlist("node07"), (V{"node07"}));
  EXPECT_EQ(ddp::expand_slurm_hostlist("node[01-03,07],gpu3"), (V{"node01", "node02", "node03", "node07", "gpu3"}));
  EXPECT_EQ(ddp::expand_slurm_hostlist("n[8-11]"), (V{"n8", "n9", "n10", "n11"}));
  EXPECT_EQ(ddp::expand_slurm_hostlist("rack[1-2]-n[01-02]"), (V{"rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"}));
  EXPECT_EQ(ddp::expand_slurm_hostlist("a[098-101]"), (V{"a098", "a099", "a100", "a101"}));
  for (const char* bad : {"node[01-", "node01]", "node[]", "node[03-01]", "node[a-b]", "a,,b", "a[1,]", "a[[1]]"}) {
    const std::string line = error_of([&] { ddp::expand_slurm_hostlist(bad, "SLURM_STEP_NODELIST"); });
    EXPECT_EQ(line.rfind("SLURM_STEP_NODELIST='" + std::string(bad) + "' does not parse as a Slurm hostlist: ", 0), 0u)
        << line;
  }
  using I = std::vector<int>;
  EXPECT_EQ(ddp::expand_slurm_tasks_per_node("4(x2),3"), (I{4, 4, 3}));
  EXPECT_EQ(ddp::expand_slurm_tasks_per_node("2"), (I{2}));
  for (const char* bad : {"", "4(x2", "x", "4(x0)", "4,,2"}) {
    EXPECT_NE(error_of([&] {
                ddp::expand_slurm_tasks_per_node(bad, "SLURM_STEP_TASKS_PER_NODE");
              }).find("SLURM_STEP_TASKS_PER_NODE='" + std::string(bad) + "' does not parse as Slurm's tasks per node"),
              std::string::npos)
        << bad;
  }
}

TEST_F(ClusterEnvTest, ASlurmJobStepIsRanksSizesAndTheFirstNodesAddress) {
  slurm_step();
  EXPECT_TRUE(ddp::launched_by_launcher());
  const ddp::LaunchEnv env = ddp::launch_env_from_environment();
  EXPECT_EQ(env.rank, 5);
  EXPECT_EQ(env.world_size, 8);
  EXPECT_EQ(env.local_rank, 1);
  EXPECT_EQ(env.local_world_size, 4);
  EXPECT_EQ(env.master_addr, "node01");
  EXPECT_EQ(env.master_port, 15000 + 1234);  // Lightning's derivation from the job id
  EXPECT_EQ(ddp::cluster_env_from_environment()->origin, "launched by slurm: job 81234, step 0, 2 nodes x 4 tasks");
  // What the job sets explicitly wins.
  set({{"MASTER_ADDR", "head"}, {"MASTER_PORT", "29400"}});
  EXPECT_EQ(ddp::launch_env_from_environment().master_addr, "head");
  EXPECT_EQ(ddp::launch_env_from_environment().master_port, 29400);
}

TEST_F(ClusterEnvTest, UnevenTasksPerNodeGiveThisNodesCount) {
  slurm_step();
  set({{"SLURM_STEP_NUM_TASKS", "7"}, {"SLURM_STEP_TASKS_PER_NODE", "4,3"}, {"SLURM_LOCALID", "2"}});
  const auto c = ddp::cluster_env_from_environment();
  ASSERT_TRUE(c.has_value());
  EXPECT_EQ(c->env.local_world_size, 3);
  EXPECT_EQ(c->origin, "launched by slurm: job 81234, step 0, 2 nodes x (uneven) tasks 4,3");
}

TEST_F(ClusterEnvTest, TorchrunsVariablesWinOverSlurms) {
  slurm_step();  // srun torchrun ...: torchrun's workers see both
  set({{"RANK", "2"}, {"WORLD_SIZE", "3"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "1234"}});
  const ddp::LaunchEnv env = ddp::launch_env_from_environment();
  EXPECT_EQ(env.rank, 2);
  EXPECT_EQ(env.world_size, 3);
  EXPECT_FALSE(ddp::cluster_env_from_environment().has_value());  // the header then names no cluster
}

TEST_F(ClusterEnvTest, ABatchScriptOrAnAllocationIsNotARank) {
  slurm_step();
  unsetenv("SLURM_STEP_ID");  // sbatch's script, salloc's shell
  EXPECT_FALSE(ddp::cluster_env_from_environment().has_value());
  EXPECT_FALSE(ddp::launched_by_launcher());
  // Slurm's special step ids, as srun passes them on ("%u": the batch script's, salloc's interactive and extern
  // steps) and as newer Slurm writes them (negative).
  for (const char* step : {"4294967291", "4294967290", "4294967292", "-5", "-6", "batch", ""}) {
    set({{"SLURM_STEP_ID", step}});
    EXPECT_FALSE(ddp::cluster_env_from_environment().has_value()) << step;
  }
  set({{"SLURM_STEP_ID", "3"}});
  EXPECT_TRUE(ddp::cluster_env_from_environment().has_value());
  unsetenv("SLURM_STEP_ID");
  EXPECT_FALSE(ddp::launched_by_launcher());
}

/// mpirun inside a Slurm allocation: the ranks on other nodes inherit the step of mpirun's daemons (started by srun),
/// whose SLURM_PROCID is the daemon's index. MPI's variables are the ranks'. srun --mpi=pmi2 sets PMI_RANK and
/// PMI_SIZE alone: the step's variables are the ranks' then.
TEST_F(ClusterEnvTest, MpiUnderSlurmIsMpisRanksAndSrunsPmi2IsSlurms) {
  slurm_step();  // the daemons' step: "rank 5 of 8"
  set({{"SLURM_STEP_NUM_TASKS", "2"},
       {"SLURM_PROCID", "1"},
       {"SLURM_STEP_TASKS_PER_NODE", "1(x2)"},
       {"SLURM_LOCALID", "0"},
       {"OMPI_COMM_WORLD_RANK", "6"},
       {"OMPI_COMM_WORLD_SIZE", "8"},
       {"OMPI_COMM_WORLD_LOCAL_RANK", "2"},
       {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"},
       {"MASTER_ADDR", "node01"}});
  auto c = ddp::cluster_env_from_environment();
  ASSERT_TRUE(c.has_value());
  EXPECT_EQ(c->launcher, ddp::Launcher::kOpenMpi);
  EXPECT_EQ(c->env.rank, 6);
  EXPECT_EQ(c->env.world_size, 8);
  env_.clear();
  slurm_step();
  set({{"PMI_RANK", "5"}, {"PMI_SIZE", "8"}});  // srun --mpi=pmi2
  c = ddp::cluster_env_from_environment();
  ASSERT_TRUE(c.has_value());
  EXPECT_EQ(c->launcher, ddp::Launcher::kSlurm);
  EXPECT_EQ(c->env.rank, 5);
}

TEST_F(ClusterEnvTest, OpenMpiAndPmiNeedMasterAddr) {
  set({{"OMPI_COMM_WORLD_RANK", "1"},
       {"OMPI_COMM_WORLD_SIZE", "2"},
       {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
       {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}});
  EXPECT_EQ(error_of([] { ddp::launch_env_from_environment(); }),
            "launched by Open MPI (mpirun) (OMPI_COMM_WORLD_RANK='1'), but MASTER_ADDR is not set: MPI does not say "
            "which host rank 0 is on; pass it to every rank, e.g. mpirun -x MASTER_ADDR=<rank 0's host>");
  set({{"MASTER_ADDR", "10.0.0.1"}});
  ddp::LaunchEnv env = ddp::launch_env_from_environment();
  EXPECT_EQ(env.rank, 1);
  EXPECT_EQ(env.world_size, 2);
  EXPECT_EQ(env.local_rank, 1);
  EXPECT_EQ(env.master_port, 29500);
  EXPECT_EQ(ddp::cluster_env_from_environment()->origin,
            "launched by Open MPI (mpirun): 2 processes, 2 per node (1 node)");

  env_.clear();
  set({{"PMI_RANK", "3"},
       {"PMI_SIZE", "4"},
       {"MPI_LOCALRANKID", "1"},
       {"MPI_LOCALNRANKS", "2"},
       {"MASTER_ADDR", "h"},
       {"MASTER_PORT", "6000"}});
  env = ddp::launch_env_from_environment();
  EXPECT_EQ(env.rank, 3);
  EXPECT_EQ(env.local_world_size, 2);
  EXPECT_EQ(env.master_port, 6000);
  EXPECT_EQ(ddp::cluster_env_from_environment()->origin,
            "launched by MPICH / Intel MPI (PMI): 4 processes, 2 per node (2 nodes)");
}

TEST_F(ClusterEnvTest, VariablesThatDisagreeAreOneLineNamingThem) {
  slurm_step();
  set({{"SLURM_PROCID", "8"}});
  EXPECT_EQ(error_of([] { ddp::launch_env_from_environment(); }), "SLURM_PROCID must be in [0, 7], got 8");
  slurm_step();
  set({{"SLURM_STEP_NODELIST", "node[01-"}});
  EXPECT_EQ(error_of([] { ddp::launch_env_from_environment(); }),
            "SLURM_STEP_NODELIST='node[01-' does not parse as a Slurm hostlist: '[' without ']'");
  slurm_step();
  set({{"SLURM_STEP_TASKS_PER_NODE", "4"}});
  EXPECT_EQ(error_of([] { ddp::launch_env_from_environment(); }),
            "a Slurm job step: SLURM_STEP_TASKS_PER_NODE='4' lists 1 node(s), SLURM_STEP_NODELIST='node[01-02]' 2");
  slurm_step();
  set({{"SLURM_LOCALID", "4"}});
  EXPECT_EQ(error_of([] { ddp::launch_env_from_environment(); }), "SLURM_LOCALID must be in [0, 3], got 4");
  env_.clear();
  set({{"OMPI_COMM_WORLD_RANK", "2"}, {"OMPI_COMM_WORLD_SIZE", "2"}});
  EXPECT_EQ(error_of([] { ddp::launch_env_from_environment(); }), "OMPI_COMM_WORLD_RANK must be in [0, 1], got 2");
  set({{"OMPI_COMM_WORLD_RANK", "1"}});
  EXPECT_EQ(error_of([] { ddp::launch_env_from_environment(); }),
            "Open MPI (mpirun): OMPI_COMM_WORLD_LOCAL_SIZE is not set");
}

/// ddp-launch started by srun with one task per node takes the nodes from Slurm (--nnodes, --node-rank, --master-addr
/// when not given); with several tasks on the node it refuses in one line.
TEST_F(ClusterEnvTest, DdpLaunchUnderSrunTakesTheNodesFromSlurm) {
  slurm_step();
  set({{"SLURM_STEP_NUM_TASKS", "2"},
       {"SLURM_PROCID", "1"},
       {"SLURM_LOCALID", "0"},
       {"SLURM_STEP_TASKS_PER_NODE", "1(x2)"}});
  const char* argv[] = {"ddp-launch", "--nproc-per-node", "2", "--master-port", "29400", "train"};
  ddp::ParsedLaunchArgs parsed = ddp::parse_launch_args(6, argv);
  ASSERT_TRUE(parsed.config.has_value()) << parsed.output;
  EXPECT_EQ(parsed.config->nnodes, 2);
  EXPECT_EQ(parsed.config->node_rank, 1);
  EXPECT_EQ(parsed.config->master_addr, "node01");
  // Given on the command line, the flags win; the others still come from Slurm.
  const char* rank_given[] = {"ddp-launch", "--nproc-per-node", "2", "--node-rank", "0", "--master-port", "29400", "t"};
  parsed = ddp::parse_launch_args(8, rank_given);
  ASSERT_TRUE(parsed.config.has_value()) << parsed.output;
  EXPECT_EQ(parsed.config->nnodes, 2);
  EXPECT_EQ(parsed.config->node_rank, 0);
  const char* elastic[] = {"ddp-launch", "--nproc-per-node", "2", "--nnodes", "1:4", "--master-port", "29400", "t"};
  parsed = ddp::parse_launch_args(8, elastic);
  ASSERT_TRUE(parsed.config.has_value()) << parsed.output;
  EXPECT_EQ(parsed.config->nnodes, 4);
  EXPECT_EQ(parsed.config->node_rank, 1);
  EXPECT_EQ(parsed.config->master_addr, "node01");
  const char* explicit_argv[] = {"ddp-launch", "--nproc-per-node", "2",     "--nnodes", "1", "--node-rank",
                                 "0",          "--master-port",    "29400", "train"};
  parsed = ddp::parse_launch_args(10, explicit_argv);
  ASSERT_TRUE(parsed.config.has_value()) << parsed.output;
  EXPECT_EQ(parsed.config->nnodes, 1);
  EXPECT_EQ(parsed.config->master_addr, "127.0.0.1");

  set({{"SLURM_STEP_TASKS_PER_NODE", "4(x2)"}, {"SLURM_STEP_NUM_TASKS", "8"}, {"SLURM_LOCALID", "1"}});
  parsed = ddp::parse_launch_args(6, argv);
  EXPECT_FALSE(parsed.config.has_value());
  EXPECT_EQ(parsed.exit_code, 2);
  EXPECT_NE(
      parsed.output.find("ddp-launch in a Slurm job step of 4 tasks on this node (SLURM_STEP_TASKS_PER_NODE='4(x2)'): "
                         "each task would start its own workers"),
      std::string::npos)
      << parsed.output;
}

/// Ranks started by srun / mpirun that share a node use torchrun's thread count unless OMP_NUM_THREADS says otherwise.
TEST_F(ClusterEnvTest, RanksSharingANodeGetTorchrunsThreadCount) {
  slurm_step();  // 4 tasks on this node
  EXPECT_EQ(ddp::cluster_intra_op_threads(), 1);
  set({{"SLURM_CPUS_PER_TASK", "3"}});
  EXPECT_EQ(ddp::cluster_intra_op_threads(), 3);
  set({{"OMP_NUM_THREADS", "2"}});
  EXPECT_EQ(ddp::cluster_intra_op_threads(), std::nullopt);
  env_.clear();
  slurm_step();
  set({{"SLURM_STEP_NUM_TASKS", "2"},
       {"SLURM_PROCID", "1"},
       {"SLURM_LOCALID", "0"},
       {"SLURM_STEP_TASKS_PER_NODE", "1(x2)"}});
  EXPECT_EQ(ddp::cluster_intra_op_threads(), std::nullopt);  // alone on its node
  env_.clear();
  set({{"RANK", "0"}, {"WORLD_SIZE", "2"}});
  EXPECT_EQ(ddp::cluster_intra_op_threads(), std::nullopt);  // ddp-launch / torchrun set OMP_NUM_THREADS themselves
}

}  // namespace
