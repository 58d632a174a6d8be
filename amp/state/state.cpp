#include <amp/state/state.h>

#include <iostream>
#include <mutex>
#include <set>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <amp/fp8/fp8_state.h>
#include <amp/optim/fused_optimizer.h>
#include <amp/state/model_cast.h>
#include <amp/state/replicated_gradients.h>

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

torch::nn::Module& unwrapped(torch::nn::Module& module) {
  const std::string kind = module.name();
  TORCH_CHECK(kind.find("DataParallel") == std::string::npos,
              "amp::initialize got a model already wrapped for data parallel training (", kind,
              "): call initialize on the bare model and wrap the model it returns");
  return module;
}

}  // namespace

void default_overflow_logger(const std::string& line) { std::cerr << line << std::endl; }

StepProgress::StepProgress(const c10::Device& device)
    : found_inf(at::zeros({1}, at::TensorOptions().device(device))), outcome(std::make_unique<StepOutcome>(device)) {}

void StepProgress::add_loss(const LossScaler& scaler) {
  found_inf.add_(scaler.found_inf());
  unscaled = true;
}

State::State(torch::nn::Module& module, torch::optim::Optimizer& optimizer, const Options& options)
    : options_(options),
      policy_(options.resolve()),
      module_(&module),
      optimizer_(&optimizer),
      fused_(dynamic_cast<FusedOptimizer*>(&optimizer)),
      slots_(unwrapped(module), optimizer),
      losses_(policy_, slots_.device()),
      progress_(slots_.device()),
      logger_(default_overflow_logger) {
  register_optimizer();
  // Masters are taken from the fp32 values before the model is cast, so they start exact (Apex copied them
  // back from the already rounded half parameters).
  std::vector<at::Tensor> fp32_values;
  if (policy_.master_weights) {
    for (const auto& slot : slots_) fp32_values.push_back(slot.model.detach().clone());
  }
  if (policy_.cast_model_type != at::kFloat) {
    cast_model_(module, policy_.cast_model_type, policy_.keep_batchnorm_fp32, policy_.keep_layernorm_fp32);
  }
  if (policy_.master_weights) slots_.create_masters(optimizer, fp32_values);
  set_forward_policy();
  owner_ = std::make_unique<ReplicatedGradients>(OwnerContext{slots_, optimizer, fused_, policy_, true});
  if (policy_.fp8) {  // after the cast: the layers' FP8 state lives beside their (cast) weights
    fp8_ = std::make_unique<Fp8State>(module, *policy_.fp8, slots_.device());
    for (const auto& line : fp8_->report()) logger_(line);
  }
}

void State::register_optimizer() {
  std::lock_guard<std::mutex> lock(g_registry_mutex);
  TORCH_CHECK(registry().insert(optimizer_).second,
              "amp::initialize was already called with this optimizer: initialize each optimizer once "
              "(see Note [one amp state per optimizer])");
}

void State::set_forward_policy() {
  forward_.autocast = policy_.autocast;
  forward_.cast_inputs = policy_.cast_model_type != at::kFloat;
  forward_.half_dtype = policy_.half_dtype;
  forward_.device_type = slots_.device().type();
  if (policy_.cast_model_type != at::kFloat && policy_.keep_layernorm_fp32) {
    forward_.kept_norms = layer_and_group_norms(*module_);
  }
}

State::~State() {
  // The owner first: a ZeRO shard completes a pending publish into the model, which the slots name.
  owner_.reset();
  std::lock_guard<std::mutex> lock(g_registry_mutex);
  registry().erase(optimizer_);
}

}  // namespace amp::detail
