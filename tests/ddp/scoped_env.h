#pragma once

// For tests that read the process environment: the given variables unset while alive (each test sets exactly what it
// needs), their values put back after.

#include <cstdlib>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace ddp_test {

/// Every variable a launcher sets that ddp::launch_env_from_environment reads: torchrun's, Slurm's, MPI's.
inline const std::vector<std::string> kLaunchVariables = {"MASTER_ADDR",
                                                          "MASTER_PORT",
                                                          "RANK",
                                                          "WORLD_SIZE",
                                                          "LOCAL_RANK",
                                                          "LOCAL_WORLD_SIZE",
                                                          "OMP_NUM_THREADS",
                                                          "SLURM_PROCID",
                                                          "SLURM_STEP_ID",
                                                          "SLURM_NTASKS",
                                                          "SLURM_STEP_NUM_TASKS",
                                                          "SLURM_LOCALID",
                                                          "SLURM_NODEID",
                                                          "SLURM_NNODES",
                                                          "SLURM_STEP_NODELIST",
                                                          "SLURM_JOB_NODELIST",
                                                          "SLURM_NODELIST",
                                                          "SLURM_TASKS_PER_NODE",
                                                          "SLURM_STEP_TASKS_PER_NODE",
                                                          "SLURM_JOB_ID",
                                                          "SLURMD_NODENAME",
                                                          "SLURM_CPUS_PER_TASK",
                                                          "OMPI_COMM_WORLD_RANK",
                                                          "OMPI_COMM_WORLD_SIZE",
                                                          "OMPI_COMM_WORLD_LOCAL_RANK",
                                                          "OMPI_COMM_WORLD_LOCAL_SIZE",
                                                          "PMI_RANK",
                                                          "PMI_SIZE",
                                                          "MPI_LOCALRANKID",
                                                          "MPI_LOCALNRANKS"};

class ScopedEnv {
 public:
  explicit ScopedEnv(std::vector<std::string> names) : names_(std::move(names)) {
    for (const auto& name : names_) {
      if (const char* v = std::getenv(name.c_str())) saved_[name] = v;
    }
    clear();
  }
  ~ScopedEnv() {
    clear();
    for (const auto& [name, value] : saved_) setenv(name.c_str(), value.c_str(), 1);
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

  /// Sets each variable (names outside the list are set too, and left set).
  static void set(const std::map<std::string, std::string>& vars) {
    for (const auto& [name, value] : vars) setenv(name.c_str(), value.c_str(), 1);
  }
  /// Unsets every variable of the list.
  void clear() const {
    for (const auto& name : names_) unsetenv(name.c_str());
  }

 private:
  std::vector<std::string> names_;
  std::map<std::string, std::string> saved_;
};

}  // namespace ddp_test
