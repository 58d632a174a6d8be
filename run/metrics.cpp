#include <run/metrics.h>

#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/cuda.h>

#include <ddp/json.h>

namespace run {

namespace {

const char* phase_name(int phase) {
  static const char* const kNames[] = {"forward", "backward", "optimizer step"};
  return kNames[phase];
}

}  // namespace

StepPhases::StepPhases(bool timed, const torch::Device& device, ddp::Timeline* timeline)
    : timed_(timed), timeline_(timeline != nullptr && timeline->recording() ? timeline : nullptr) {
  if (device.is_cuda()) cuda_ = device;
}

StepPhases::Clock::time_point StepPhases::now() const {
  if (cuda_) torch::cuda::synchronize(cuda_->index());
  return Clock::now();
}

void StepPhases::begin() {
  if (timed_) begin_ = now();
  for (auto& end : ends_) end = begin_;
  if (timeline_ != nullptr) last_mark_ = ddp::Timeline::mark(current_stream());
}

void StepPhases::end(Phase phase) {
  const auto index = static_cast<int>(phase);
  if (timed_) ends_[index] = now();
  if (timeline_ != nullptr) {
    auto mark = ddp::Timeline::mark(current_stream());
    timeline_->add(phase_name(index), "step", last_mark_, mark);
    last_mark_ = std::move(mark);
  }
  last_phase_ = index;
}

void StepPhases::finish() {
  if (timed_) finished_ = now();
}

std::optional<c10::Stream> StepPhases::current_stream() const {
  if (!cuda_) return std::nullopt;
  return c10::impl::VirtualGuardImpl(c10::DeviceType::CUDA).getStream(*cuda_);
}

double StepPhases::milliseconds(Phase phase) const {
  const auto index = static_cast<int>(phase);
  const Clock::time_point start = index == 0 ? begin_ : ends_[index - 1];
  if (ends_[index] <= start) return 0.0;
  return std::chrono::duration<double, std::milli>(ends_[index] - start).count();
}

double StepPhases::step_milliseconds() const {
  return std::chrono::duration<double, std::milli>(finished_ - begin_).count();
}

std::string metrics_json(const StepRecord& r) {
  using ddp::json_number;
  ddp::Json ranks = ddp::Json::array();
  for (size_t i = 0; i < r.ranks.size(); ++i) {
    const RankStepTimes& t = r.ranks[i];
    ranks.push_back({{"rank", i},
                     {"loss", json_number(t.loss)},
                     {"step_ms", json_number(t.step_ms)},
                     {"forward_ms", json_number(t.forward_ms)},
                     {"backward_ms", json_number(t.backward_ms)},
                     {"optimizer_ms", json_number(t.optimizer_ms)},
                     {"comm_wait_ms", json_number(t.comm_wait_ms)}});
  }
  return ddp::json_text({{"type", "step"},
                         {"step", r.step},
                         {"epoch", r.epoch},
                         {"loss", json_number(r.loss)},
                         {"lr", json_number(r.lr)},
                         {"loss_scale", json_number(r.loss_scale)},
                         {"skipped_steps", json_number(r.skipped_steps)},
                         {"grad_norm", json_number(r.grad_norm)},
                         {"samples_per_s", json_number(r.samples_per_s)},
                         {"ranks", std::move(ranks)}});
}

std::string metrics_json(const EpochRecord& r) {
  using ddp::json_number;
  return ddp::json_text({{"type", "epoch"},
                         {"epoch", r.epoch},
                         {"step", r.step},
                         {"mean_loss", json_number(r.mean_loss)},
                         {"test_accuracy", json_number(r.test_accuracy)},
                         {"seconds", json_number(r.seconds)}});
}

}  // namespace run
