#include <amp/state/param_slots.h>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <kernels/multi_tensor/scaled_copy.h>

namespace amp::detail {
namespace {

bool is_half(c10::ScalarType t) { return t == at::kHalf || t == at::kBFloat16; }

std::vector<std::pair<std::string, at::Tensor>> named_parameters_of(torch::nn::Module& module) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& p : module.named_parameters(/*recurse=*/true)) out.emplace_back(p.key(), p.value());
  return out;
}

}  // namespace

ParamSlots::ParamSlots(torch::nn::Module& module, const torch::optim::Optimizer& optimizer)
    : ParamSlots(named_parameters_of(module), optimizer, "a parameter of the model") {}

ParamSlots::ParamSlots(const std::vector<std::pair<std::string, at::Tensor>>& named,
                       const torch::optim::Optimizer& optimizer, const std::string& of_what) {
  // Every parameter must be fp32 on entry, on one device.
  TORCH_CHECK(!named.empty(), "amp::initialize: the model has no parameters");
  device_ = named[0].second.device();
  std::unordered_map<const void*, std::string> name_of;
  for (const auto& [name, p] : named) {
    TORCH_CHECK(p.scalar_type() == at::kFloat, "amp::initialize needs fp32 parameters on entry, but '", name, "' is ",
                p.scalar_type());
    TORCH_CHECK(p.device() == device_, "amp::initialize needs all parameters on one device, but '", name, "' is on ",
                p.device(), " and '", named[0].first, "' on ", device_);
    name_of[p.unsafeGetTensorImpl()] = name;
  }
  // Every optimizer parameter must belong to the model.
  int64_t index = 0;
  for (const auto& group : optimizer.param_groups()) {
    for (const auto& p : group.params()) {
      auto it = name_of.find(p.unsafeGetTensorImpl());
      TORCH_CHECK(it != name_of.end(), "amp::initialize: optimizer parameter ", index, " (shape ", p.sizes(),
                  ") is not ", of_what);
      // Casting the model later keeps each parameter's TensorImpl (set_data), so the index stays valid.
      index_of_[p.unsafeGetTensorImpl()] = index;
      index_of_name_[it->second] = index;
      slots_.push_back(ParamSlot{it->second, p, p, false});
      ++index;
    }
  }
}

int64_t ParamSlots::index_of(const at::Tensor& model) const {
  const auto it = index_of_.find(model.unsafeGetTensorImpl());
  return it == index_of_.end() ? -1 : it->second;
}

int64_t ParamSlots::index_of(const std::string& name) const {
  const auto it = index_of_name_.find(name);
  return it == index_of_name_.end() ? -1 : it->second;
}

std::string ParamSlots::name(int64_t index) const {
  if (index < 0 || index >= static_cast<int64_t>(slots_.size())) return "<none>";
  return slots_[static_cast<size_t>(index)].name;
}

void ParamSlots::create_masters(torch::optim::Optimizer& optimizer, const std::vector<at::Tensor>& fp32_values) {
  std::unordered_map<const void*, at::Tensor> master_of;
  for (size_t i = 0; i < slots_.size(); ++i) {
    auto& slot = slots_[i];
    if (!is_half(slot.model.scalar_type()) || !slot.model.requires_grad()) continue;
    slot.master = fp32_values[i].requires_grad_(true);
    slot.has_master = true;
    master_of[slot.model.unsafeGetTensorImpl()] = slot.master;
  }
  auto& state = optimizer.state();
  for (auto& group : optimizer.param_groups()) {
    for (auto& p : group.params()) {
      auto it = master_of.find(p.unsafeGetTensorImpl());
      if (it == master_of.end()) continue;
      // State the optimizer already has (steps taken, or loaded, before initialize) follows the parameter to its
      // master. Taken out before the insert: inserting may rehash the map and leave `old` dangling.
      auto old = state.find(p.unsafeGetTensorImpl());
      if (old != state.end()) {
        std::unique_ptr<torch::optim::OptimizerParamState> moved = std::move(old->second);
        state.erase(old);
        state[it->second.unsafeGetTensorImpl()] = std::move(moved);
      }
      p = it->second;
    }
  }
}

void ParamSlots::drop_masters() {
  for (ParamSlot& slot : slots_) {
    slot.master = slot.model;
    slot.has_master = false;
  }
}

void ParamSlots::copy_masters_to_models() {
  std::vector<at::Tensor> from, to;
  for (const auto& slot : slots_) {
    if (slot.has_master) {
      from.push_back(slot.master);
      to.push_back(slot.model);
    }
  }
  if (from.empty()) return;
  at::NoGradGuard no_grad;
  kernels::scaled_copy_(from, to, 1.0);
}

void ParamSlots::clear_grads() {
  for (auto& slot : slots_) {
    slot.model.mutable_grad() = at::Tensor();
    if (slot.has_master) slot.master.mutable_grad() = at::Tensor();
  }
}

}  // namespace amp::detail
