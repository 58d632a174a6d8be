#include <run/monitor.h>

#include <stdexcept>

#include <amp/amp.h>

namespace run {

StepValues step_values(torch::optim::Optimizer& optimizer, amp::Optimizer* amp_optimizer) {
  StepValues values;
  if (!optimizer.param_groups().empty()) values.lr = optimizer.param_groups().front().options().get_lr();
  if (amp_optimizer != nullptr) {
    const amp::ScalerDiagnostics diagnostics = amp_optimizer->scaler().diagnostics_now();
    values.loss_scale = diagnostics.scale;
    values.skipped_steps = diagnostics.skipped_steps;
  }
  return values;
}

Monitor::Monitor(const MonitorOptions& options, int rank, int world_size, const torch::Device& device, ObservedRun run,
                 std::FILE* out)
    : epochs_(options.epochs),
      progress_(rank == 0 ? options.progress : ProgressStyle::kQuiet, options.progress_every_seconds, out),
      observer_(options.observe, rank, world_size, device, std::move(run), options.first_step, options.last_step),
      next_step_(options.first_step) {}

void Monitor::begin_epoch(int64_t epoch, int64_t batches, int64_t first_batch, const EpochLoss& so_far) {
  epoch_ = epoch;
  batch_ = first_batch;
  loss_ = so_far;
  samples_ = 0;
  trained_.reset();
  epoch_start_ = Clock::now();
  progress_.begin_epoch(static_cast<int>(epoch), static_cast<int>(epochs_), batches, first_batch, epoch_start_);
}

StepPhases& Monitor::begin_step() {
  phases_ = observer_.begin_step(next_step_);
  phases_->begin();
  return *phases_;
}

void Monitor::step(double loss, int64_t samples, bool last) {
  if (!phases_) throw std::logic_error("run::Monitor::step without begin_step");
  phases_->finish();
  observer_.end_step(next_step_, epoch_, loss, *phases_, samples);
  phases_.reset();
  ++next_step_;
  ++batch_;
  loss_.add(loss);
  samples_ += samples;
  const auto now = Clock::now();
  const double seconds = std::chrono::duration<double>(now - epoch_start_).count();
  // "mean loss": the running mean of rank 0's step losses in this epoch (the whole epoch's, in a resumed one).
  progress_.step_done(batch_, epoch_mean_loss(), static_cast<double>(samples_) / seconds, now, last);
}

void Monitor::interrupt() { progress_.interrupt(); }

double Monitor::epoch_mean_loss() const { return loss_.mean(); }

double Monitor::epoch_trained() {
  if (!trained_) {
    progress_.end_epoch();
    trained_ = Clock::now();
  }
  return epoch_mean_loss();
}

void Monitor::end_epoch(std::optional<double> test_accuracy) {
  const double mean_loss = epoch_trained();
  EpochRecord record;
  record.epoch = epoch_;
  record.step = next_step_ - 1;
  record.mean_loss = mean_loss;
  record.test_accuracy = test_accuracy;
  record.seconds = std::chrono::duration<double>(*trained_ - epoch_start_).count();
  observer_.end_epoch(record, std::chrono::duration<double>(Clock::now() - *trained_).count());
}

void Monitor::finish() { observer_.finish(); }

}  // namespace run
