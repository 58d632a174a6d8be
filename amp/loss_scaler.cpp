#include <amp/loss_scaler.h>

#include <cmath>
#include <optional>

#include <ATen/ATen.h>
#include <c10/core/Event.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>
#include <torch/serialize/archive.h>

#include <kernels/capture.h>
#include <kernels/multi_tensor/loss_scale.h>
#include <kernels/multi_tensor/unscale.h>

namespace amp {

LossScalerConfig LossScalerConfig::from(const Options::Resolved& o) {
  LossScalerConfig c;
  c.dynamic = o.dynamic_loss_scale;
  c.static_scale = o.static_loss_scale;
  c.init_scale = o.init_scale;
  c.growth_factor = o.growth_factor;
  c.backoff_factor = o.backoff_factor;
  c.growth_interval = o.growth_interval;
  c.hysteresis = o.hysteresis;
  c.min_scale = o.min_loss_scale;
  c.max_scale = o.max_loss_scale;
  return c;
}

namespace {

// Snapshot layout (fp64 on host): what update() copies back asynchronously.
enum SnapshotField : int64_t {
  kScale = 0,
  kFoundInf,
  kFirstIndex,
  kSkipped,
  kFloorOverflows,
  kGrowthTracker,
  kNumFields
};
constexpr int kSnapshotSlots = 2;

/// The names of config_tensor's entries, for messages.
constexpr const char* kConfigNames[] = {"dynamic",       "static_scale",   "init_scale",
                                        "growth_factor", "backoff_factor", "growth_interval",
                                        "hysteresis",    "min_scale",      "max_scale"};
/// The config as a tensor, saved with the state so a checkpoint from other settings is refused.
at::Tensor config_tensor(const LossScalerConfig& c) {
  return at::tensor(std::vector<double>{c.dynamic ? 1.0 : 0.0, c.static_scale, c.init_scale, c.growth_factor,
                                        c.backoff_factor, static_cast<double>(c.growth_interval),
                                        static_cast<double>(c.hysteresis), c.min_scale, c.max_scale},
                    at::kDouble);
}

}  // namespace

struct LossScaler::Snapshot {
  at::Tensor host;  // pinned on CUDA
  std::optional<c10::Event> event;
  int64_t step = -1;
  int64_t sequence = -1;  // the order snapshots were taken in (after a capture several may carry the same step)
};

LossScaler::LossScaler(const LossScalerConfig& config, const c10::Device& device) : config_(config), device_(device) {
  TORCH_CHECK(device.is_cpu() || device.is_cuda(), "LossScaler supports CPU and CUDA devices, got ", device);
  const double initial = config.dynamic ? config.init_scale : config.static_scale;
  TORCH_CHECK(std::isfinite(initial) && initial > 0, "the initial loss scale must be finite and > 0, got ", initial);
  const auto f32 = at::TensorOptions().dtype(at::kFloat).device(device);
  const auto i32 = at::TensorOptions().dtype(at::kInt).device(device);
  scale_ = at::full({1}, initial, f32);
  inv_scale_ = at::full({1}, 1.0, f32);
  inv_scale_.copy_(scale_.to(at::kDouble).reciprocal());  // fp64 reciprocal, as torch.amp
  growth_tracker_ = at::zeros({1}, i32);
  hysteresis_tracker_ = at::full({1}, config.hysteresis, i32);
  found_inf_ = at::zeros({1}, f32);
  first_index_ = at::full({1}, kernels::kNoNonFiniteIndex, i32);
  skipped_steps_ = at::zeros({1}, at::TensorOptions().dtype(at::kDouble).device(device));
  floor_overflows_ = at::zeros({1}, at::TensorOptions().dtype(at::kDouble).device(device));
  for (int i = 0; i < kSnapshotSlots; ++i) {
    auto s = std::make_shared<Snapshot>();
    s->host = at::zeros({kNumFields}, at::TensorOptions().dtype(at::kDouble).pinned_memory(device.is_cuda()));
    snapshots_.push_back(std::move(s));
  }
}

at::Tensor LossScaler::scale_loss(const at::Tensor& loss) const {
  TORCH_CHECK(loss.defined(), "scale_loss: the loss is an undefined tensor");
  TORCH_CHECK(loss.device() == device_, "scale_loss: the loss is on ", loss.device(), " but the scaler is on ",
              device_);
  TORCH_CHECK(at::isFloatingType(loss.scalar_type()), "scale_loss: the loss must be floating point, got ",
              loss.scalar_type());
  return loss.to(at::kFloat) * scale_;
}

void LossScaler::begin_step() {
  found_inf_.zero_();
  first_index_.fill_(kernels::kNoNonFiniteIndex);
}

void LossScaler::unscale_and_check(at::TensorList grads, int64_t index_offset) {
  kernels::unscale_and_check_(grads, inv_scale_, found_inf_, first_index_, index_offset);
}

void LossScaler::update() {
  if (config_.dynamic) {
    kernels::update_scale_(scale_, growth_tracker_, hysteresis_tracker_, found_inf_, config_.growth_factor,
                           config_.backoff_factor, config_.growth_interval, config_.hysteresis, config_.min_scale,
                           config_.max_scale);
    inv_scale_.copy_(scale_.to(at::kDouble).reciprocal());
  }
  skipped_steps_.add_(found_inf_);
  // Consecutive overflows with the scale pinned at its floor (a static scale is always "at its floor").
  const at::Tensor stalled = config_.dynamic ? found_inf_ * scale_.le(config_.min_scale) : found_inf_;
  floor_overflows_.add_(1.0).mul_(stalled);
  ++steps_;
  take_snapshot();
}

void LossScaler::take_snapshot() {
  // Note [capture-safe step] (kernels/capture.h): no copy to the host and no event while capturing; the next
  // diagnostics() outside the capture takes the snapshot, and from then on every read does (replays update the
  // device state without host code).
  if (kernels::is_capturing(device_)) {
    snapshot_on_read_ = true;
    return;
  }
  auto& slot = *snapshots_[snapshot_slot_];
  snapshot_slot_ = (snapshot_slot_ + 1) % kSnapshotSlots;
  const at::Tensor staged = at::cat({scale_.to(at::kDouble), found_inf_.to(at::kDouble), first_index_.to(at::kDouble),
                                     skipped_steps_, floor_overflows_, growth_tracker_.to(at::kDouble)});
  slot.step = steps_;
  slot.sequence = ++snapshots_taken_;
  if (device_.is_cpu()) {
    slot.host.copy_(staged);
    return;
  }
  slot.host.copy_(staged, /*non_blocking=*/true);
  const c10::impl::VirtualGuardImpl guard(device_.type());
  if (!slot.event) slot.event.emplace(device_.type());
  slot.event->record(guard.getStream(device_));
}

ScalerDiagnostics LossScaler::read_snapshot(const at::Tensor& host) const {
  const double* v = host.data_ptr<double>();
  ScalerDiagnostics d;
  d.scale = v[kScale];
  d.found_inf = v[kFoundInf] != 0.0;
  d.first_nonfinite_index = v[kFirstIndex] >= kernels::kNoNonFiniteIndex ? -1 : static_cast<int64_t>(v[kFirstIndex]);
  d.skipped_steps = static_cast<int64_t>(v[kSkipped]);
  d.floor_overflows = static_cast<int64_t>(v[kFloorOverflows]);
  d.growth_tracker = static_cast<int64_t>(v[kGrowthTracker]);
  return d;
}

ScalerDiagnostics LossScaler::diagnostics() {
  if (kernels::is_capturing(device_)) return last_read_;  // no event query, no host read while capturing
  // After a captured update the device state moves with every replay: start a snapshot (into a slot already read),
  // which this call returns when it has completed (on the CPU: always) and a later one otherwise.
  if (snapshot_on_read_ && snapshots_[snapshot_slot_]->sequence <= last_read_sequence_) take_snapshot();
  for (const auto& slot : snapshots_) {
    if (slot->sequence <= last_read_sequence_) continue;
    if (slot->event && !slot->event->query()) continue;
    last_read_ = read_snapshot(slot->host);
    last_read_.step = slot->step;
    last_read_sequence_ = slot->sequence;
  }
  return last_read_;
}

ScalerDiagnostics LossScaler::diagnostics_now() {
  kernels::check_not_capturing(device_, "LossScaler::diagnostics_now()",
                               "it waits for the device; use diagnostics() (read lazily) or call it after the capture");
  if (snapshot_on_read_) take_snapshot();  // replays may have moved the state since the last snapshot
  for (const auto& slot : snapshots_) {
    if (slot->event) slot->event->synchronize();
  }
  return diagnostics();
}

void LossScaler::save(torch::serialize::OutputArchive& archive) const {
  archive.write("config", config_tensor(config_));
  archive.write("scale", scale_.cpu());
  archive.write("growth_tracker", growth_tracker_.cpu());
  archive.write("hysteresis_tracker", hysteresis_tracker_.cpu());
  archive.write("skipped_steps", skipped_steps_.cpu());
  archive.write("floor_overflows", floor_overflows_.cpu());
  archive.write("steps", at::tensor(steps_, at::kLong));
}

void LossScaler::load(torch::serialize::InputArchive& archive) {
  // Read everything first; change nothing unless all of it is present and matches.
  at::Tensor config, scale, growth, hysteresis, skipped, floor, steps;
  const std::pair<const char*, at::Tensor*> fields[] = {{"config", &config},
                                                        {"scale", &scale},
                                                        {"growth_tracker", &growth},
                                                        {"hysteresis_tracker", &hysteresis},
                                                        {"skipped_steps", &skipped},
                                                        {"floor_overflows", &floor},
                                                        {"steps", &steps}};
  for (const auto& [key, out] : fields) {
    TORCH_CHECK(archive.try_read(key, *out), "loss scaler checkpoint is missing '", key, "'");
  }
  const at::Tensor expected = config_tensor(config_);
  TORCH_CHECK(config.dim() == 1 && config.numel() == expected.numel(), "loss scaler checkpoint has ", config.numel(),
              " settings, expected ", expected.numel());
  const at::Tensor saved_config = config.to(at::kDouble).contiguous();
  for (int64_t i = 0; i < expected.numel(); ++i) {
    const double saved = saved_config.data_ptr<double>()[i], mine = expected.data_ptr<double>()[i];
    TORCH_CHECK(saved == mine || (std::isnan(saved) && std::isnan(mine)), "loss scaler checkpoint was saved with ",
                kConfigNames[i], "=", saved, " but this scaler has ", kConfigNames[i], "=", mine,
                ": restore with the same settings");
  }
  TORCH_CHECK(scale.numel() == 1 && scale.scalar_type() == at::kFloat && growth.numel() == 1 &&
                  growth.scalar_type() == at::kInt && hysteresis.numel() == 1 && hysteresis.scalar_type() == at::kInt &&
                  skipped.numel() == 1 && floor.numel() == 1 && steps.numel() == 1,
              "loss scaler checkpoint has malformed state tensors");
  const float s = scale.item<float>();
  // 0 is reachable only without a floor (min_scale 0, torch.amp's unbounded scale underflowing).
  TORCH_CHECK(std::isfinite(s) && (s > 0 || (s == 0 && config_.min_scale == 0)),
              "loss scaler checkpoint holds an invalid scale ", s);
  const at::Tensor host_growth = growth.cpu(), host_skipped = skipped.to(at::kDouble).cpu(),
                   host_floor = floor.to(at::kDouble).cpu();
  scale_.copy_(scale);
  inv_scale_.copy_(scale_.to(at::kDouble).reciprocal());
  growth_tracker_.copy_(growth);
  hysteresis_tracker_.copy_(hysteresis);
  skipped_steps_.copy_(skipped);
  floor_overflows_.copy_(floor);
  steps_ = steps.item<int64_t>();
  // Everything derived from the old state goes: the overflow flag of an unfinished step, and every snapshot
  // (one taken after the saved step would otherwise hide the loaded state from diagnostics() until the step count
  // passes it again, and its floor-overflow count would stop training on clean steps).
  begin_step();
  last_read_sequence_ = snapshots_taken_;  // every snapshot taken so far counts as read: none is newer than the load
  last_read_ = ScalerDiagnostics{};
  last_read_.step = steps_;
  last_read_.scale = s;
  last_read_.skipped_steps = static_cast<int64_t>(host_skipped.item<double>());
  last_read_.floor_overflows = static_cast<int64_t>(host_floor.item<double>());
  last_read_.growth_tracker = host_growth.item<int32_t>();
}

}  // namespace amp
