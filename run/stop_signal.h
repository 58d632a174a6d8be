#pragma once

// Preemption without lost work (docs/clusters.md, "Preemption"): a stop signal (Slurm's `--signal=USR1@90`, the
// SIGTERM of Kubernetes and spot instances) makes every rank of a job stop after the same step, where the loop saves
// its checkpoint and exits with ddp::kExitResumable; the same command then continues from that checkpoint.

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ddp/launch/exit_codes.h>
#include <ddp/process_group.h>

namespace run {

/// The exit code of a run that stopped on its stop signal and saved: ddp::kExitResumable (75, EX_TEMPFAIL).
constexpr int kExitResumable = ddp::kExitResumable;

/// The signal `name` names: TERM, INT, HUP, QUIT, USR1 or USR2, with or without "SIG", in any case, or its number.
/// Throws std::invalid_argument "<flag> '<name>' is not a stop signal: use TERM, INT, HUP, QUIT, USR1 or USR2".
int parse_stop_signal(const std::string& name, const std::string& flag = "--stop-signal");

/// A comma-separated list of parse_stop_signal's names ("USR1,TERM"), each once. Throws as parse_stop_signal does.
std::vector<int> parse_stop_signals(const std::string& names, const std::string& flag = "--stop-signal");

/// "SIGUSR1" for SIGUSR1: the name parse_stop_signal takes.
std::string stop_signal_name(int signal);

/// Where the ranks agreed to stop, and why (StopSignal::decision()).
struct StopDecision {
  int64_t step = 0;          ///< every rank stops after this step of the run (the boundary stop_after() said yes at)
  int64_t signalled_at = 0;  ///< the first rank that got the signal got it in this step (before its boundary)
  int rank = 0;              ///< that rank
};

/// Watches for a stop signal and answers, at each step boundary, whether the job stops there: the same answer on
/// every rank, a few steps after any one rank got the signal.
///
///     run::StopSignal stop(SIGUSR1);   // first thing: a signal from now on stops the run, not the process
///     ... ddp::ProcessGroup group = ddp::init_process_group(); ...
///     stop.join(group);                // every rank
///     for (...) {                       // every rank calls stop_after() at every step boundary
///       ... one training step (its collectives: DDP's allreduce) ...
///       if (stop.stop_after(position.steps)) break;
///     }
///     ... save the checkpoint of that step; exit run::kExitResumable ...
///
/// Note [agreeing on the stop step]
/// No collective is added to a step. A rank that got the signal writes the step it is at, w (its last boundary),
/// into the job's store once (first writer wins: compareSet). After each step b every rank asks the store, on a
/// thread of this object, whether w is there; at the next boundary, b + 1, it stops iff that answer held a w < b.
/// That answer is the same on every rank: the writer wrote w before its part of step w + 1's collectives, and every
/// rank asked after finishing step b > w, whose collectives need the writer's part of them; so for w < b every rank's
/// read comes after the write (for w >= b the rule says go on, whether the read saw it or not). A signal during
/// step s stops the job after step s + 2 at the latest, and the main thread never waits on the store unless the
/// read of the last boundary has not come back by the next (it only takes the answer).
///
/// One process (no join()): stop_after() says yes at the first boundary after the signal. The handler only records
/// the first signal (and writes one line to stderr); another while the run stops and saves is noted and ignored.
/// It is installed with SA_RESTART, so reads and writes in progress are not interrupted. One StopSignal at a time per
/// process; its end restores the signals' previous handlers, or, after one came, leaves them ignored (the process
/// is on its way out: a repeated signal must not kill it in its teardown).
class StopSignal {
 public:
  /// Installs the handler for `signal` (parse_stop_signal's). Throws std::logic_error when another StopSignal lives.
  explicit StopSignal(int signal);
  /// Watches each of `signals` (parse_stop_signals'): the first that comes stops the run. A Slurm job watches SIGUSR1
  /// (its `--signal` notice before the time limit) and SIGTERM (what it sends at the limit and on preemption).
  explicit StopSignal(std::vector<int> signals);
  /// Stops the store reader and puts the previous handler back (see the class comment).
  ~StopSignal();
  StopSignal(const StopSignal&) = delete;
  StopSignal& operator=(const StopSignal&) = delete;

  /// From now on the ranks of `group` agree (Note [agreeing on the stop step]) through its store. Every rank calls
  /// it, before its first stop_after(). Every step must run a collective over all ranks, and each rank must have seen
  /// it complete on the host before the boundary: with Gloo the CPU waits for it; with NCCL a host sync after the
  /// optimizer step does it (the examples' `loss.item()`), else a rank could run ahead of the others' writes. A
  /// boundary is an optimizer step: not a micro-step of gradient accumulation (`no_sync`).
  void join(const ddp::ProcessGroup& group);

  /// At the boundary after step `steps` of the run (and once before the first step, with the start's count): whether
  /// every rank stops here. Every rank calls it at every boundary, with the same counts. Throws std::runtime_error
  /// (one line) when the job's store cannot be reached.
  bool stop_after(int64_t steps);

  /// The signal that came (after received()), else the first it watches.
  int signal() const;
  /// Whether this process got the signal.
  bool received() const;
  /// After stop_after() said yes: where and why.
  const std::optional<StopDecision>& decision() const { return decision_; }
  /// After stop_after() said yes: "SIGUSR1 (rank 1 got it in step 41): every rank stopped after step 43".
  std::string describe() const;

 private:
  class StoreReader;
  std::vector<int> signals_;
  int rank_ = 0;
  bool published_ = false;
  std::unique_ptr<StoreReader> reader_;  // after join()
  std::optional<StopDecision> decision_;
};

/// `scontrol requeue <SLURM_JOB_ID>` (an array job's task: `<SLURM_ARRAY_JOB_ID>_<SLURM_ARRAY_TASK_ID>`): puts this
/// Slurm batch job back in the queue (it starts again with the same job
/// script, which continues from the checkpoint just saved). Throws std::runtime_error (one line) when SLURM_JOB_ID is
/// not set or scontrol fails (its exit code and stderr's last line).
void requeue_slurm_job();

}  // namespace run
