#pragma once

// What the four "ways" examples share besides the data and the model: the flag set and what the flags mean for the
// run layer (run::Checkpoints, run::DistributedSampler, run::MonitorOptions), the run header line, a --resume's
// checks and errors, test accuracy, and one-line errors. Each example's own file shows
// its whole loop (docs/examples.md, docs/from_python.md).

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <amp/amp.h>
#include <amp/io/checkpoint_dir.h>
#include <fmt/format.h>
#include <run/checkpoints.h>
#include <run/monitor.h>
#include <run/run_state.h>
#include <run/sampler.h>
#include <run/training_checkpoint.h>
#include <torch/torch.h>
#include <CLI/CLI.hpp>

#include "common/command_line.h"
#include "common/fashion_mnist.h"

namespace examples {

/// SGD momentum of every example's plain SGD (and amp_ddp's FusedSGD).
constexpr double kSgdMomentum = 0.9;

/// The flags every example takes (--epochs, --batch-size, --lr, --seed, --device, --synthetic, --data,
/// --limit-train, --save, --save-every, --resume, --checkpoint-dir, --keep-last, --quiet, --progress-every,
/// --stop-after-steps, --stop-signal, --requeue, and what the run records: --metrics, --metrics-every, --report,
/// --timeline, --timeline-steps).
struct CommonFlags {
  std::string data_dir = kDefaultFashionMnistDir;
  bool synthetic = false;
  int epochs = 1;
  int64_t batch_size = 128;  // per process
  /// The whole job's batch per step, split evenly among the processes; replaces batch_size. The data order and the
  /// steps then do not depend on the number of processes: a run resumes on another number (an elastic job).
  std::optional<int64_t> global_batch_size;
  double lr = 0.05;
  uint64_t seed = 0;
  int64_t limit_train = 0;  // 0: the whole training split
  std::string device = "auto";
  std::string save;                         // checkpoint written after the last epoch (rank 0); empty: none
  std::string resume;                       // checkpoint read before training; empty: start fresh
  std::optional<int64_t> save_every;        // also write --save every K optimizer steps of the run (rank 0)
  std::string checkpoint_dir;               // amp::CheckpointDir: saves by step, resumes from the newest readable
  int64_t keep_last = 3;                    // checkpoints --checkpoint-dir keeps
  bool quiet = false;                       // no progress line (run::Progress, run::ProgressStyle::kQuiet)
  double progress_every = 10.0;             // seconds between progress lines when stdout is not a terminal
  std::optional<int64_t> stop_after_steps;  // for testing resumption: stop after S steps of this process
  std::optional<std::string> stop_signal;   // run::StopSignal's signal (TERM when the run saves; common/preemption.h)
  bool requeue = false;                     // after a stop on it: scontrol requeue $SLURM_JOB_ID (rank 0)
  run::ObserveOptions observe;              // --metrics, --report, --timeline (docs/observability.md)
};

/// Registers CommonFlags on `app`, and makes --help show the default of these and of every option added after
/// them (call it first). Values are checked after parsing by check_common_flags (CLI11's own range checks print
/// "Value 0 not in range 0.000000 to 1797...", a 300-digit bound).
void add_common_flags(CLI::App& app, CommonFlags& flags);

/// Checks what CLI11 cannot say well: --epochs and --batch-size positive, --lr positive and finite, --limit-train
/// and --progress-every not negative, --save-every and --stop-after-steps positive when given, --save-every only with
/// --save, --resume an existing file, --save's folder existing, and run::check_observe_options. Throws
/// std::invalid_argument naming the flag and its value. Called before anything is loaded or written.
void check_common_flags(const CommonFlags& flags);

/// Each process's batch: --batch-size, or --global-batch-size / world_size. Throws std::invalid_argument naming
/// --global-batch-size when it does not split evenly among `world_size` processes.
int64_t batch_per_process(const CommonFlags& flags, int64_t world_size);

/// Throws std::invalid_argument("<flag> must be a positive integer, got <value>") unless value > 0.
void require_positive(const char* flag, int64_t value);

/// The training and test splits the flags ask for (the data set, or --synthetic), the training split cut to
/// --limit-train. Throws with the path and a hint when the data set is missing.
struct Data {
  ImageSplit train;
  ImageSplit test;
};
Data load_data(const CommonFlags& flags);

/// What every example's first line says about its run, alike in all of them (rank 0 prints it before anything else,
/// a resume's "resuming at ..." line included): "<processes> process(es) (<backend>), <where> | <precision> |
/// <optimizer>, lr <lr>, batch <b> per process, <e> epoch(s) | <n> training samples, <m> test samples<extras>".
struct RunHeader {
  int64_t processes = 1;
  std::string backend;    // the process group's backend ("gloo", "nccl"); empty: one process, no group
  std::string where;      // the devices: "device cpu on rank 0", "2 CPU replicas, outputs gathered on cpu"
  std::string precision;  // "fp32", or amp's "O2 bf16"
  std::string optimizer;  // "SGD momentum 0.9"
  std::string extras;     // what only this run has, each as " | ...": " | SyncBatchNorm over all ranks"
};
/// That line for a run of `flags` on `data` (its sample counts). Throws as batch_per_process() does for a global
/// batch that does not split among the processes (before a header with a wrong split is printed).
std::string run_header_line(const CommonFlags& flags, const Data& data, const RunHeader& header);

/// "<name> momentum 0.9": how the header names the examples' SGD (torch::optim::SGD, or amp's "FusedSGD").
std::string sgd_description(const std::string& name = "SGD");

/// "fp16" / "bf16" / "fp32" (what the examples' --dtype flags take), else c10's name.
std::string dtype_name(c10::ScalarType dtype);

/// amp::Options from amp flags: `opt_level` "O0"-"O3" (amp::parse_opt_level), the half dtype, and `fp8` "off",
/// "delayed" or "current" (amp::Fp8Recipe with that scaling; docs/fp8.md).
amp::Options amp_options(const std::string& opt_level, c10::ScalarType half_dtype, const std::string& fp8 = "off");

/// "auto": cuda:`local_rank` when CUDA is available, else the CPU; "cuda" alone: cuda:`local_rank`; otherwise the
/// device named ("cpu", "cuda:1"). Throws std::invalid_argument naming --device when the name is not a device,
/// when no CUDA GPU is visible, or when the GPU's index is not below the number visible.
torch::Device pick_device(const std::string& name, int local_rank = 0);

/// Where this process stands in the job: its shard of each epoch and whether it prints.
struct Rank {
  int rank = 0;
  int world_size = 1;
};

/// What the flags say to run::Checkpoints: --save (one file) or --checkpoint-dir with --keep-last, and --save-every.
run::Checkpoints checkpoints_from(const CommonFlags& flags);

/// The sampler of a run of `flags` over `train_samples` samples on `rank`: --batch-size per process in each rank's
/// shard, or --global-batch-size in the global order (the same samples per step on any number of processes).
/// Throws std::invalid_argument naming --global-batch-size when it does not split among the processes or is more
/// than the samples.
run::DistributedSampler sampler_from(const CommonFlags& flags, int64_t train_samples, const Rank& rank);

/// How the flags say to watch a run that starts at `start`, its epochs `batches_per_epoch` steps each: the progress
/// line (--quiet, --progress-every; rewritten on a terminal), the files (--metrics, --report, --timeline; the
/// metrics appended to on a --resume), and the run's steps: to the end of --epochs, or --stop-after-steps of them.
run::MonitorOptions monitor_options(const CommonFlags& flags, const run::TrainingPosition& start,
                                    int64_t batches_per_epoch);

/// --stop-after-steps (for testing resumption): whether the run that started at `start` stops at `now`.
bool stop_requested(const CommonFlags& flags, const run::TrainingPosition& start, const run::TrainingPosition& now);
/// After the loop, on rank 0 of a run stopped by --stop-after-steps: "stopped after S step(s) (--stop-after-steps),
/// at epoch E, batch B of it (step N of the run)". Nothing when it was not stopped.
void print_if_stopped(const CommonFlags& flags, const run::TrainingPosition& start, const run::TrainingPosition& end,
                      const Rank& rank);

/// The state of a run of `flags` on `world_size` processes over `train_samples` samples, now at `position`, with
/// the default CPU generator as it is now and DDP's `ddp_gradient_order` (empty without DDP).
run::RunState capture_run_state(const CommonFlags& flags, int64_t world_size, int64_t train_samples,
                                const run::TrainingPosition& position, std::vector<int64_t> ddp_gradient_order = {});

/// Where to start after loading `saved` from the --resume checkpoint `path` (nullopt: the file, written before
/// checkpoints recorded it, has no run state, and training starts at epoch 1). Throws std::invalid_argument
/// "--resume 'path': ..." naming the flag when the run would not continue the saved one: another --seed,
/// --batch-size or --global-batch-size, number of processes (allowed with --global-batch-size: rank 0 says so) or
/// number of training samples. Restores the default CPU generator, and rank 0 prints where training continues.
run::TrainingPosition resume_position(const std::string& path, const std::optional<run::RunState>& saved,
                                      const CommonFlags& flags, int64_t world_size, int64_t train_samples,
                                      const Rank& rank);

/// --checkpoint-dir (docs/examples.md, "Restarting without a person"): when given, sets `flags.resume` to the newest
/// checkpoint in the folder that passes `check` (amp::CheckpointDir::load_newest: amp::check_archive_readable for
/// plain checkpoints, amp::verify_checkpoint for amp's, which also verifies the checksums); a newer one that fails is
/// skipped with a warning on stderr (from `rank` 0). Leaves it empty in a folder that holds none (a fresh start).
/// Every rank makes the same choice from the same files. Call it after check_common_flags.
void resume_from_checkpoint_dir(CommonFlags& flags, const Rank& rank,
                                const std::function<void(const std::string& path)>& check);

/// Fraction of `split` that `forward` classifies correctly, in eval mode on `module` (restored to train mode
/// after). Local: no collectives.
double test_accuracy(torch::nn::Module& module, const std::function<torch::Tensor(const torch::Tensor&)>& forward,
                     const ImageSplit& split, const torch::Device& device);

/// Prints "epoch E/N: ... test accuracy X%" (rank 0's line after its progress line).
/// Returns `accuracy`, for Loop::end_epoch.
double print_epoch_result(int epoch, int epochs, double mean_loss, double accuracy);

/// Runs `load` (which reads the --resume checkpoint `path`) and re-throws its failure as one line naming --resume
/// and the path once: "--resume 'path': <what was wrong>" (amp's own "checkpoint 'path': " before it is dropped).
void load_resume_checkpoint(const std::string& path, const std::function<void()>& load);

/// run::save_training_checkpoint (model, plain torch::optim optimizer and run state, one file, atomically), and a
/// line saying so.
void save_checkpoint(const std::string& path, torch::nn::Module& module, torch::optim::Optimizer& optimizer,
                     const run::RunState& state);
/// run::load_training_checkpoint of the --resume file `path`, its errors as one line naming --resume
/// (load_resume_checkpoint): "--resume 'path': cannot read it as a checkpoint: damaged or truncated zip archive
/// (failed finding central directory)". Returns the run state (nullopt for a file written without one).
std::optional<run::RunState> load_checkpoint(const std::string& path, torch::nn::Module& module,
                                             torch::optim::Optimizer& optimizer);

/// run::save_training_checkpoint with amp (amp::save_checkpoint with the run state as an extra), and a line saying so.
template <typename ModuleHolder>
void save_amp_checkpoint(const std::string& path, const amp::Model<ModuleHolder>& model, amp::Optimizer& optimizer,
                         const run::RunState& state, bool announce = true) {
  run::save_training_checkpoint(path, model, optimizer, state);
  if (announce) fmt::print("saved model, optimizer, amp state and training position to {}\n", path);
}
/// run::load_training_checkpoint with amp, of the --resume file `path`, errors as one line naming --resume
/// (load_resume_checkpoint). Returns the run state (nullopt for a file saved without one).
template <typename ModuleHolder>
std::optional<run::RunState> load_amp_checkpoint(const std::string& path, amp::Model<ModuleHolder>& model,
                                                 amp::Optimizer& optimizer) {
  std::optional<run::RunState> state;
  load_resume_checkpoint(path, [&] { state = run::load_training_checkpoint(path, model, optimizer); });
  return state;
}

/// Makes stdout line-buffered (a log or a pipe gets each line when it is printed), runs `body` and returns its exit
/// code (0, or run::kExitResumable after a stop on --stop-signal), and turns an exception into "program: message" on
/// stderr (one line: one_line of the message without LibTorch's backtrace) and exit status 1.
int run_main(const char* program, const std::function<int()>& body);

}  // namespace examples
