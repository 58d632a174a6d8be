#include "common/preemption.h"

#include <cstdlib>

#include <fmt/format.h>

namespace examples {

std::unique_ptr<run::StopSignal> watch_stop_signal(const CommonFlags& flags) {
  if (flags.save.empty() && flags.checkpoint_dir.empty()) return nullptr;
  return std::make_unique<run::StopSignal>(run::parse_stop_signals(flags.stop_signal.value_or("TERM")));
}

bool stop_signalled(run::StopSignal* stop, const run::TrainingPosition& position) {
  return stop != nullptr && stop->stop_after(position.steps);
}

int stopped_resumable(const CommonFlags& flags, const run::StopSignal& stop, const Rank& rank,
                      const run::TrainingPosition& end) {
  if (end.epoch > flags.epochs) {  // it stopped after the run's last step: the run is complete
    if (rank.rank == 0) fmt::print("stopped by {}, the run's last step: the run is complete\n", stop.describe());
    return 0;
  }
  if (rank.rank != 0) return run::kExitResumable;
  // Only --checkpoint-dir finds the checkpoint by itself; a --save file is given back with --resume.
  const std::string how =
      flags.checkpoint_dir.empty()
          ? fmt::format("continue it with --resume {} (the same command would start over)", flags.save)
          : std::string("the same command continues the run");
  fmt::print("stopped by {} and saved it; exit code {} (resumable): {}\n", stop.describe(), run::kExitResumable, how);
  if (flags.requeue) {
    try {
      run::requeue_slurm_job();
      fmt::print("--requeue: Slurm job {} is back in the queue (scontrol requeue)\n", std::getenv("SLURM_JOB_ID"));
    } catch (const std::exception& e) {  // every rank exits alike: resumable, to be started again by hand
      fmt::print(stderr, "warning: {} (the job was not requeued: start it again to continue)\n", e.what());
    }
  }
  return run::kExitResumable;
}

}  // namespace examples
