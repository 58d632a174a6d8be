#pragma once

// Where a training run stands, as bytes a checkpoint keeps, so that a resumed run continues exactly where the saved
// one stood: the position in the data (run::DistributedSampler's epoch and batch), the step count, what fixes the
// data order (checked on resume), torch's CPU generator, and DDP's bucket order (docs/run.md, "What each piece
// promises").

#include <cstdint>
#include <string>
#include <vector>

#include <torch/serialize/archive.h>
#include <torch/types.h>

namespace run {

/// The step losses of an epoch so far (one rank's): what its printed mean loss is made of.
struct EpochLoss {
  double sum = 0.0;   ///< the sum of the step losses
  int64_t steps = 0;  ///< how many steps the sum holds
  /// sum / steps; 0 before the first step.
  double mean() const { return steps > 0 ? sum / static_cast<double>(steps) : 0.0; }
  /// Adds one step's `loss`.
  void add(double loss) {
    sum += loss;
    ++steps;
  }
};

/// Where a run stands.
struct TrainingPosition {
  int64_t epoch = 1;         ///< the epoch in progress (1-based)
  int64_t batches_done = 0;  ///< of that epoch, in its shuffled order; always below the epoch's number of batches
  int64_t steps = 0;         ///< optimizer steps since the run began, over every resume
  /// The losses of the epoch's steps done so far, so that a run resumed inside the epoch prints the same mean loss for
  /// it as the unbroken run (run::Monitor::begin_epoch takes them).
  EpochLoss epoch_loss{};

  /// One more step, with this rank's `loss`, which ended batch `batches_done_in_epoch` (1-based) of an epoch of
  /// `batches_per_epoch`; after the epoch's last batch the position is the next epoch's start.
  void step_done(int64_t batches_done_in_epoch, int64_t batches_per_epoch, double loss) {
    ++steps;
    batches_done = batches_done_in_epoch;
    epoch_loss.add(loss);
    if (batches_done >= batches_per_epoch) {
      ++epoch;
      batches_done = 0;
      epoch_loss = {};
    }
  }
};

/// The run's last step when it trains from `at` to the end of epoch `epochs`, each of `batches_per_epoch` steps
/// (at.steps when `at` is past that already).
int64_t last_step(const TrainingPosition& at, int64_t epochs, int64_t batches_per_epoch);

/// What a checkpoint records beside model and optimizer: the position, what fixes the data order (a resume compares
/// them: the seed, the batch per process or the job's global batch, the number of processes unless the batch is
/// global, the number of training samples), and torch's default CPU generator.
struct RunState {
  /// Where the run stands.
  TrainingPosition position;
  /// The caller's random seed (the examples' --seed), recorded for the resume check; the library does not use it.
  uint64_t seed = 0;
  int64_t batch_size = 0;         ///< per process
  int64_t global_batch_size = 0;  ///< the job's batch (DistributedSampler::Order::kGlobal); 0: split by processes
  /// The number of processes. Must be >= 1 (read_run_state refuses less).
  int64_t world_size = 1;
  /// The number of training samples the run draws from (>= 0).
  int64_t train_samples = 0;
  torch::Tensor cpu_generator_state;  ///< uint8, torch's default CPU generator (at::Generator::get_state)
  /// ddp::DistributedDataParallel::gradient_order() on rank 0 (its bucket layout), restored on resume
  /// (restore_gradient_order) so that the allreduce adds in the same order (with more than 2 ranks that decides the
  /// last bits); empty for a run without DDP.
  std::vector<int64_t> ddp_gradient_order;
};

/// The state of torch's default CPU generator now (what RunState::cpu_generator_state holds).
torch::Tensor cpu_generator_state();
/// Sets torch's default CPU generator to `state`. Throws std::runtime_error (one line) when it is not a state of it.
void restore_cpu_generator(const torch::Tensor& state);

/// RunState into an archive (keys "version", "epoch", "batches_done", "steps", "epoch_loss_sum", "epoch_loss_steps",
/// "seed", "batch_size", "global_batch_size", "world_size", "train_samples", "cpu_generator_state",
/// "ddp_gradient_order") and back; a state written before the epoch's losses were kept reads with none.
/// read_run_state throws std::runtime_error ("its run state ...": one line) naming what is missing or malformed.
void write_run_state(torch::serialize::OutputArchive& archive, const RunState& state);
RunState read_run_state(torch::serialize::InputArchive& archive);

/// RunState as bytes (a torch archive) and back: what an amp checkpoint keeps as an amp::CheckpointExtras entry
/// named kRunStateExtra. decode throws as read_run_state does.
std::string encode_run_state(const RunState& state);
RunState decode_run_state(const std::string& bytes);
/// The name of that entry in amp checkpoints (the examples wrote it first, under this name).
constexpr const char* kRunStateExtra = "examples_run_state";

}  // namespace run
