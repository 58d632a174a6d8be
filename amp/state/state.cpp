#include <amp/state/state.h>

#include <iostream>
#include <mutex>
#include <set>
#include <unordered_map>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <amp/fp8/fp8_state.h>
#include <amp/optim/fused_optimizer.h>
#include <amp/state/model_cast.h>
#include <amp/zero/zero_shard.h>

namespace amp::detail {
namespace {

// Note [one amp state per optimizer]
// initialize() rewrites the optimizer (master weights replace parameters, state is re-keyed), so a second
// initialize() of the same optimizer would wrap masters in masters. Apex refuses it; so do we, by address,
// for as long as the first state lives.
std::mutex g_registry_mutex;
std::set<const torch::optim::Optimizer*>& registry() {
  static std::set<const torch::optim::Optimizer*> optimizers;
  return optimizers;
}

bool is_half(c10::ScalarType t) { return t == at::kHalf || t == at::kBFloat16; }

void default_logger(const std::string& line) { std::cerr << line << std::endl; }

}  // namespace

State::State(torch::nn::Module& module, torch::optim::Optimizer& optimizer, const Options& options)
    : options_(options),
      policy_(options.resolve()),
      device_(c10::kCPU),
      module_(&module),
      optimizer_(&optimizer),
      fused_(dynamic_cast<FusedOptimizer*>(&optimizer)),
      logger_(default_logger) {
  const std::string kind = module.name();
  TORCH_CHECK(kind.find("DataParallel") == std::string::npos,
              "amp::initialize got a model already wrapped for data parallel training (", kind,
              "): call initialize on the bare model and wrap the model it returns");
  // Every parameter must be fp32 on entry, on one device.
  const auto named = module.named_parameters(/*recurse=*/true);
  TORCH_CHECK(named.size() > 0, "amp::initialize: the model has no parameters");
  device_ = named[0].value().device();
  std::unordered_map<const void*, std::string> name_of;
  for (const auto& p : named) {
    TORCH_CHECK(p.value().scalar_type() == at::kFloat, "amp::initialize needs fp32 parameters on entry, but '", p.key(),
                "' is ", p.value().scalar_type());
    TORCH_CHECK(p.value().device() == device_, "amp::initialize needs all parameters on one device, but '", p.key(),
                "' is on ", p.value().device(), " and '", named[0].key(), "' on ", device_);
    name_of[p.value().unsafeGetTensorImpl()] = p.key();
  }
  // Every optimizer parameter must belong to the model.
  int64_t index = 0;
  for (const auto& group : optimizer.param_groups()) {
    for (const auto& p : group.params()) {
      auto it = name_of.find(p.unsafeGetTensorImpl());
      TORCH_CHECK(it != name_of.end(), "amp::initialize: optimizer parameter ", index, " (shape ", p.sizes(),
                  ") is not a parameter of the model");
      slots_.push_back(ParamSlot{it->second, p, p, false});
      ++index;
    }
  }
  {
    std::lock_guard<std::mutex> lock(g_registry_mutex);
    TORCH_CHECK(registry().insert(&optimizer).second,
                "amp::initialize was already called with this optimizer: initialize each optimizer once "
                "(see Note [one amp state per optimizer])");
  }
  // Masters are taken from the fp32 values before the model is cast, so they start exact (Apex copied them
  // back from the already rounded half parameters).
  std::vector<at::Tensor> fp32_values;
  if (policy_.master_weights) {
    for (const auto& slot : slots_) fp32_values.push_back(slot.model.detach().clone());
  }
  if (policy_.cast_model_type != at::kFloat) {
    cast_model_(module, policy_.cast_model_type, policy_.keep_batchnorm_fp32, policy_.keep_layernorm_fp32);
  }
  if (policy_.master_weights) create_master_weights(fp32_values);

  forward_.autocast = policy_.autocast;
  forward_.cast_inputs = policy_.cast_model_type != at::kFloat;
  forward_.half_dtype = policy_.half_dtype;
  forward_.device_type = device_.type();
  if (policy_.cast_model_type != at::kFloat && policy_.keep_layernorm_fp32) {
    forward_.kept_norms = layer_and_group_norms(module);
  }
  for (int64_t i = 0; i < policy_.num_losses; ++i) {
    scalers_.push_back(std::make_unique<LossScaler>(LossScalerConfig::from(policy_), device_));
  }
  last_logged_step_.assign(policy_.num_losses, -kOverflowLogIntervalSteps);
  overflows_since_log_.assign(policy_.num_losses, 0);
  step_found_inf_ = at::zeros({1}, at::TensorOptions().device(device_));
  outcome_ = std::make_unique<StepOutcome>(device_);
  if (policy_.fp8) {  // after the cast: the layers' FP8 state lives beside their (cast) weights
    fp8_ = std::make_unique<Fp8State>(module, *policy_.fp8, device_);
    for (const auto& line : fp8_->report()) logger_(line);
  }
}

HeldBytes State::held_bytes() const {
  if (zero_ != nullptr && fused_ != nullptr) return zero_->held_bytes(*fused_);
  HeldBytes bytes;
  std::vector<at::Tensor> masters, grads;
  for (const auto& slot : slots_) {
    if (slot.has_master) masters.push_back(slot.master);
    grads.push_back(slot.master.grad());
  }
  bytes.masters = held_storage_bytes(masters);
  bytes.master_grads = held_storage_bytes(grads);
  if (fused_ != nullptr) bytes.optimizer_state = held_storage_bytes(fused_->state_tensors());
  return bytes;
}

State::~State() {
  std::lock_guard<std::mutex> lock(g_registry_mutex);
  registry().erase(optimizer_);
}

void State::create_master_weights(const std::vector<at::Tensor>& fp32_values) {
  // Replace each half parameter the optimizer holds by an fp32 master copy, and re-key any existing optimizer
  // state (torch::optim keys it by TensorImpl*) to the master, converting its tensors to fp32.
  std::unordered_map<const void*, at::Tensor> master_of;
  for (size_t i = 0; i < slots_.size(); ++i) {
    auto& slot = slots_[i];
    if (!is_half(slot.model.scalar_type()) || !slot.model.requires_grad()) continue;
    slot.master = fp32_values[i].requires_grad_(true);
    slot.has_master = true;
    master_of[slot.model.unsafeGetTensorImpl()] = slot.master;
  }
  auto& state = optimizer_->state();
  for (auto& group : optimizer_->param_groups()) {
    for (auto& p : group.params()) {
      auto it = master_of.find(p.unsafeGetTensorImpl());
      if (it == master_of.end()) continue;
      auto old = state.find(p.unsafeGetTensorImpl());
      if (old != state.end()) {
        state[it->second.unsafeGetTensorImpl()] = std::move(old->second);
        state.erase(p.unsafeGetTensorImpl());
      }
      p = it->second;
    }
  }
}

LossScaler& State::scaler(int64_t loss_id) {
  TORCH_CHECK(loss_id >= 0 && loss_id < static_cast<int64_t>(scalers_.size()), "loss_id ", loss_id,
              " is out of range: initialize was called with num_losses=", scalers_.size());
  return *scalers_[loss_id];
}

}  // namespace amp::detail
