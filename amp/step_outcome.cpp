#include <amp/step_outcome.h>

#include <optional>

#include <ATen/ATen.h>
#include <c10/core/Event.h>
#include <c10/core/impl/VirtualGuardImpl.h>

namespace amp {
namespace {
constexpr int kSlots = 2;
}  // namespace

struct StepOutcome::Slot {
  at::Tensor host;  // 1-element fp32, pinned on CUDA
  std::optional<c10::Event> event;
  int64_t step = -1;
};

StepOutcome::StepOutcome(const c10::Device& device) : device_(device) {
  skipped_ = at::zeros({1}, at::TensorOptions().dtype(at::kFloat).device(device));
  for (int i = 0; i < kSlots; ++i) {
    auto slot = std::make_unique<Slot>();
    slot->host = at::zeros({1}, at::TensorOptions().dtype(at::kFloat).pinned_memory(device.is_cuda()));
    slots_.push_back(std::move(slot));
  }
}

StepOutcome::~StepOutcome() = default;

void StepOutcome::record(int64_t step, const at::Tensor& found_inf, bool capturing) {
  skipped_.copy_(found_inf.ne(0));
  if (capturing) return;
  Slot& slot = *slots_[next_slot_];
  next_slot_ = (next_slot_ + 1) % kSlots;
  slot.step = step;
  if (device_.is_cpu()) {
    slot.host.copy_(skipped_);
    slot.event.reset();
    return;
  }
  slot.host.copy_(skipped_, /*non_blocking=*/true);
  const c10::impl::VirtualGuardImpl guard(device_.type());
  if (!slot.event) slot.event.emplace(device_.type());
  slot.event->record(guard.getStream(device_));
}

void StepOutcome::record(int64_t step, bool skipped) {
  skipped_.fill_(skipped ? 1.0 : 0.0);
  Slot& slot = *slots_[next_slot_];
  next_slot_ = (next_slot_ + 1) % kSlots;
  slot.step = step;
  // The host already knows: no copy to wait for (a copy still in flight into this buffer would land after the
  // write below, so it is waited for; the plain optimizer's path syncs anyway).
  if (slot.event) slot.event->synchronize();
  slot.host.fill_(skipped ? 1.0 : 0.0);
  slot.event.reset();
}

StepReport StepOutcome::latest() {
  for (const auto& slot : slots_) {
    if (slot->step <= last_read_.step) continue;
    if (slot->event && !slot->event->query()) continue;
    last_read_ = StepReport{slot->step, slot->host.data_ptr<float>()[0] != 0.0f};
  }
  return last_read_;
}

StepReport StepOutcome::latest_now() {
  for (const auto& slot : slots_) {
    if (slot->event) slot->event->synchronize();
  }
  return latest();
}

}  // namespace amp
