#include <amp/grad_scaler.h>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/archive.h>

#include <kernels/multi_tensor/unscale.h>

namespace amp {
namespace {

LossScalerConfig config_of(const GradScalerOptions& o) {
  LossScalerConfig c;
  c.dynamic = true;
  c.init_scale = o.init_scale();
  c.growth_factor = o.growth_factor();
  c.backoff_factor = o.backoff_factor();
  c.growth_interval = o.growth_interval();
  c.hysteresis = o.hysteresis();
  c.min_scale = o.min_scale();
  c.max_scale = o.max_scale();
  return c;
}

std::vector<at::Tensor> grads_of(const torch::optim::Optimizer& optimizer, const c10::Device& device) {
  std::vector<at::Tensor> grads;
  for (const auto& group : optimizer.param_groups()) {
    for (const auto& p : group.params()) {
      const at::Tensor& g = p.grad();
      if (!g.defined()) continue;
      TORCH_CHECK(!g.is_sparse(), "GradScaler does not support sparse gradients");
      TORCH_CHECK(g.device() == device, "a gradient is on ", g.device(), " but the GradScaler state is on ", device);
      grads.push_back(g);
    }
  }
  return grads;
}

}  // namespace

GradScaler::GradScaler(GradScalerOptions options, std::optional<c10::Device> device) : options_(std::move(options)) {
  const auto& o = options_;
  TORCH_CHECK(std::isfinite(o.min_scale()) && o.min_scale() >= 0, "min_scale must be finite and >= 0, got ",
              o.min_scale());
  TORCH_CHECK(o.max_scale() >= o.min_scale(), "max_scale ", o.max_scale(), " must be >= min_scale ", o.min_scale());
  TORCH_CHECK(o.init_scale() >= o.min_scale() && o.init_scale() <= o.max_scale(), "init_scale ", o.init_scale(),
              " is outside [min_scale, max_scale] = [", o.min_scale(), ", ", o.max_scale(), "]");
  TORCH_CHECK(o.growth_factor() > 1.0, "growth_factor must be > 1, got ", o.growth_factor());
  TORCH_CHECK(o.backoff_factor() > 0.0 && o.backoff_factor() < 1.0, "backoff_factor must be in (0, 1), got ",
              o.backoff_factor());
  TORCH_CHECK(o.growth_interval() >= 1, "growth_interval must be >= 1, got ", o.growth_interval());
  TORCH_CHECK(o.hysteresis() >= 1, "hysteresis must be >= 1, got ", o.hysteresis());
  if (device && o.enabled()) scaler_ = std::make_unique<LossScaler>(config_of(o), *device);
}

LossScaler& GradScaler::require_scaler(const char* caller) {
  TORCH_CHECK(scaler_ != nullptr, caller, "() called before scale(): the scaler has no state yet");
  return *scaler_;
}

GradScaler::PerOptimizer& GradScaler::per_optimizer(torch::optim::Optimizer& optimizer) {
  auto& entry = optimizers_[&optimizer];
  if (!entry.found_inf.defined()) entry.found_inf = at::zeros({1}, at::TensorOptions().device(scaler_->device()));
  return entry;
}

at::Tensor GradScaler::scale(const at::Tensor& loss) {
  if (!options_.enabled()) return loss;
  if (!scaler_) scaler_ = std::make_unique<LossScaler>(config_of(options_), loss.device());
  TORCH_CHECK(loss.device() == scaler_->device(), "scale(): the loss is on ", loss.device(),
              " but the scaler state is on ", scaler_->device());
  return scaler_->scale_loss(loss);
}

void GradScaler::unscale_(torch::optim::Optimizer& optimizer) {
  if (!options_.enabled()) return;
  LossScaler& scaler = require_scaler("unscale_");
  PerOptimizer& state = per_optimizer(optimizer);
  TORCH_CHECK(state.stage == Stage::kReady, state.stage == Stage::kUnscaled
                                                ? "unscale_() has already been called on this optimizer since the last "
                                                  "update()"
                                                : "unscale_() is being called after step()");
  state.found_inf.zero_();
  kernels::unscale_and_check_(grads_of(optimizer, scaler.device()), scaler.inv_scale(), state.found_inf);
  state.stage = Stage::kUnscaled;
}

bool GradScaler::step(torch::optim::Optimizer& optimizer) {
  if (!options_.enabled()) {
    optimizer.step();
    return true;
  }
  require_scaler("step");
  PerOptimizer& state = per_optimizer(optimizer);
  TORCH_CHECK(state.stage != Stage::kStepped, "step() has already been called since the last update()");
  if (state.stage == Stage::kReady) unscale_(optimizer);
  state.stage = Stage::kStepped;
  if (state.found_inf.item<float>() != 0.0f) return false;  // the one host sync a plain optimizer needs
  optimizer.step();
  return true;
}

void GradScaler::update() {
  if (!options_.enabled()) return;
  LossScaler& scaler = require_scaler("update");
  std::vector<at::Tensor> flags;
  for (auto& [opt, state] : optimizers_) {
    if (state.stage != Stage::kReady) flags.push_back(state.found_inf);
  }
  TORCH_CHECK(!flags.empty(), "update(): no unscale_() or step() was recorded since the last update()");
  scaler.found_inf().copy_(at::stack(flags).sum().clamp_max(1.0).reshape({1}));
  scaler.update();
  for (auto& [opt, state] : optimizers_) state.stage = Stage::kReady;
}

double GradScaler::get_scale() {
  if (!options_.enabled() || !scaler_) return options_.enabled() ? options_.init_scale() : 1.0;
  return scaler_->scale().item<double>();
}

void GradScaler::save(torch::serialize::OutputArchive& archive) const {
  TORCH_CHECK(scaler_ != nullptr || !options_.enabled(), "save(): the scaler has no state yet (call scale() first)");
  if (scaler_) scaler_->save(archive);
}

void GradScaler::load(torch::serialize::InputArchive& archive) {
  TORCH_CHECK(scaler_ != nullptr,
              "load(): the scaler has no state yet: construct it with the training device, or call scale() first");
  scaler_->load(archive);
  for (auto& [opt, state] : optimizers_) state.stage = Stage::kReady;
}

}  // namespace amp
