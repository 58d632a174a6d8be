#pragma once

#include <chrono>
#include <functional>
#include <optional>
#include <string>

#include <torch/arg.h>

namespace ddp {

/// Options of spawn(): the rendezvous address and port the workers get, how failures stop them, and their timeouts.
struct SpawnOptions {
  /// Where rank 0 will host the rendezvous (MASTER_ADDR for the workers).
  TORCH_ARG(std::string, master_addr) = "127.0.0.1";
  /// MASTER_PORT for the workers; 0: a port that is free when spawn starts, picked by the parent.
  TORCH_ARG(int, master_port) = 0;
  /// After one worker fails, how long the others get to exit after SIGTERM before SIGKILL.
  TORCH_ARG(std::chrono::milliseconds, kill_grace) = std::chrono::milliseconds(5000);
  /// After a signal spawn() forwards to the workers (SIGINT, SIGTERM, SIGUSR1, SIGUSR2 to the parent), how long they
  /// get to stop on their own (save, and end with ddp::ResumableStop) before SIGKILL.
  TORCH_ARG(std::chrono::milliseconds, stop_grace) = std::chrono::milliseconds(30000);
  /// The workers' rendezvous timeout (DDP_RENDEZVOUS_TIMEOUT_S for them; see InitOptions::rendezvous_timeout).
  /// Unset: the workers inherit the parent's environment, else InitOptions' default.
  TORCH_ARG(std::optional<std::chrono::milliseconds>, rendezvous_timeout) = std::nullopt;
  /// The workers' collective timeout (DDP_COLLECTIVE_TIMEOUT_S for them; see InitOptions::timeout).
  TORCH_ARG(std::optional<std::chrono::milliseconds>, collective_timeout) = std::nullopt;
};

/// How the workers of spawn() ended when none failed.
enum class SpawnOutcome {
  kFinished,          ///< every fn returned
  kStoppedResumable,  ///< some threw ddp::ResumableStop (they saved on their stop signal), the others returned
};

/// The C++ counterpart of torch.multiprocessing.spawn: runs `fn(local_rank, nprocs)` in `nprocs` forked worker
/// processes with the environment contract set (MASTER_ADDR, MASTER_PORT, RANK = LOCAL_RANK = local_rank,
/// WORLD_SIZE = LOCAL_WORLD_SIZE = nprocs, GROUP_RANK = 0), so fn calls ddp::init_process_group() with env://.
/// Waits for all of them. A worker fails when fn throws (its message is carried back), it exits nonzero, or a
/// signal kills it; then the parent stops the others and throws a one-line c10::Error naming the first rank that
/// failed (the root cause), its pid and how it ended, then the others (consequences). Workers die with the parent
/// (PR_SET_PDEATHSIG). The timeouts in `options` reach fn's init_process_group() through the environment, as
/// an explicit InitOptions setting in fn takes precedence over them.
///
/// Like torchrun, workers run CPU ops on one thread (OMP_NUM_THREADS=1) unless OMP_NUM_THREADS is set; set it
/// only if the parent has not run multi-threaded CPU ops before spawn (GNU OpenMP's thread pool does not survive
/// fork, and a child using it hangs).
///
/// Fork before CUDA: the parent must not have initialized CUDA (a forked child cannot use it). fn runs in a
/// copy of the parent; results must come back through files or the process group, not memory. fn should report
/// failure by throwing: GoogleTest assertions inside fn do not reach the parent's test.
///
/// While the workers run, SIGINT, SIGTERM, SIGUSR1 and SIGUSR2 to the parent are forwarded to them (they run in
/// process groups of their own), and after stop_grace those still running are killed. A worker whose fn throws
/// ddp::ResumableStop (ddp/launch/exit_codes.h: it saved on its stop signal) ends with ddp::kExitResumable and is
/// no failure: spawn() returns SpawnOutcome::kStoppedResumable when no worker failed.
SpawnOutcome spawn(int nprocs, const std::function<void(int local_rank, int nprocs)>& fn,
                   const SpawnOptions& options = {});

}  // namespace ddp
