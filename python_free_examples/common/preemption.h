#pragma once

// --stop-signal and --requeue (docs/clusters.md, "Preemption"): what the examples do when their job is told to stop.

#include <memory>

#include <run/run_state.h>
#include <run/stop_signal.h>

#include "common/example_flags.h"

namespace examples {

/// For a run that saves (--save or --checkpoint-dir): a run::StopSignal watching --stop-signal's signal (TERM
/// unless the flag names another). nullptr for a run that saves nowhere: the signal then ends it as it ends any
/// program. Call it first, so that a signal during the start (loading data, joining the others) stops the run too.
std::unique_ptr<run::StopSignal> watch_stop_signal(const CommonFlags& flags);

/// At a step boundary (and once before the first step): whether the run stops here for its stop signal, the same
/// answer on every rank (run::StopSignal::stop_after). false without one.
bool stop_signalled(run::StopSignal* stop, const run::TrainingPosition& position);

/// After the ranks stopped on the signal at `end` and saved, on every rank after the job's last collective: rank 0
/// prints "stopped by SIGUSR1 (rank 1 got it in step 41): every rank stopped after step 43 and saved it; exit code
/// 75 (resumable): the same command continues the run", and with --requeue runs `scontrol requeue $SLURM_JOB_ID` (a
/// failure of it is a warning: the job is still resumable by hand). Returns run::kExitResumable; 0 when `end` is the
/// end of the run (the signal came too late to matter: nothing is left to continue, nothing is requeued).
int stopped_resumable(const CommonFlags& flags, const run::StopSignal& stop, const Rank& rank,
                      const run::TrainingPosition& end);

}  // namespace examples
