#include <amp/fused_optimizers.h>

#include <string>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/serialize/archive.h>

#include <kernels/fused_optimizers.h>

namespace amp {
namespace {

/// The parameters of one group that have a gradient, split into those updated in place (no separate model
/// copy) and those whose update is computed on the held fp32 tensor and written to a half model tensor.
struct StepLists {
  std::vector<at::Tensor> params, grads, masters;  // direct: params; mastered: params = model, masters = held
  std::vector<size_t> index;                       // position in the group, for the state lists
};

void split_group(const std::vector<at::Tensor>& held, at::TensorList model_params, size_t first, StepLists& direct,
                 StepLists& mastered) {
  for (size_t i = 0; i < held.size(); ++i) {
    if (!held[i].grad().defined()) continue;
    const bool has_model = !model_params.empty() && !model_params[first + i].is_same(held[i]);
    StepLists& target = has_model ? mastered : direct;
    target.params.push_back(has_model ? model_params[first + i] : held[i]);
    target.grads.push_back(held[i].grad());
    if (has_model) target.masters.push_back(held[i]);
    target.index.push_back(i);
  }
}

template <typename T>
std::vector<at::Tensor> pick(const std::vector<at::Tensor>& all, const std::vector<size_t>& index) {
  std::vector<at::Tensor> out;
  for (size_t i : index) out.push_back(all[i]);
  return out;
}

void check_model_params(at::TensorList model_params, size_t held_count) {
  TORCH_CHECK(model_params.empty() || model_params.size() == held_count, "fused_step got ", model_params.size(),
              " model parameters for ", held_count, " held parameters");
}

size_t count_params(const std::vector<torch::optim::OptimizerParamGroup>& groups) {
  size_t n = 0;
  for (const auto& g : groups) n += g.params().size();
  return n;
}

void write_list(torch::serialize::OutputArchive& archive, const std::string& key, const std::vector<at::Tensor>& list) {
  for (size_t i = 0; i < list.size(); ++i) {
    if (list[i].defined()) archive.write(key + "." + std::to_string(i), list[i]);
  }
}

void read_list(torch::serialize::InputArchive& archive, const std::string& key, std::vector<at::Tensor>& list,
               const std::vector<at::Tensor>& params) {
  list.assign(params.size(), at::Tensor());
  for (size_t i = 0; i < params.size(); ++i) {
    at::Tensor value;
    if (!archive.try_read(key + "." + std::to_string(i), value)) continue;
    TORCH_CHECK(value.numel() == params[i].numel(), "optimizer checkpoint: ", key, ".", i, " has ", value.numel(),
                " elements but the parameter has ", params[i].numel());
    list[i] = value.to(params[i].device(), at::kFloat).reshape(params[i].sizes()).contiguous();
  }
}

at::Tensor device_scalar(const at::Tensor& like, double value) {
  return at::full({1}, value, at::TensorOptions().dtype(at::kFloat).device(like.device()));
}

}  // namespace

FusedAdam::FusedAdam(const std::vector<torch::optim::OptimizerParamGroup>& groups, FusedAdamOptions defaults)
    : Optimizer(groups, std::make_unique<FusedAdamOptions>(defaults)) {
  const auto& d = defaults;
  TORCH_CHECK(d.lr() >= 0, "lr must be >= 0, got ", d.lr());
  kernels::AdamStepOptions()  // validates betas, eps, weight decay with named errors
      .beta1(std::get<0>(d.betas()))
      .beta2(std::get<1>(d.betas()))
      .eps(d.eps())
      .weight_decay(d.weight_decay());
}

FusedAdam::FusedAdam(std::vector<at::Tensor> params, FusedAdamOptions defaults)
    : FusedAdam({torch::optim::OptimizerParamGroup(std::move(params))}, defaults) {}

at::Tensor FusedAdam::step(LossClosure closure) {
  at::Tensor loss;
  if (closure) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  run({}, at::Tensor());
  return loss;
}

void FusedAdam::fused_step(at::TensorList model_params, const at::Tensor& found_inf) { run(model_params, found_inf); }

void FusedAdam::run(at::TensorList model_params, const at::Tensor& found_inf) {
  check_model_params(model_params, count_params(param_groups_));
  groups_state_.resize(param_groups_.size());
  at::NoGradGuard no_grad;
  size_t first = 0;
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    const auto& held = param_groups_[g].params();
    const auto& o = static_cast<const FusedAdamOptions&>(param_groups_[g].options());
    GroupState& st = groups_state_[g];
    if (!held.empty() && !st.step.defined()) {
      st.step = device_scalar(held[0], 0.0);
      st.lr = device_scalar(held[0], o.lr());
    }
    if (held.empty()) continue;
    st.lr.fill_(o.lr());  // a device fill, no sync: schedulers may change lr between steps
    auto ensure = [&](std::vector<at::Tensor>& list) {
      list.resize(held.size());
      for (size_t i = 0; i < held.size(); ++i) {
        if (!list[i].defined()) list[i] = at::zeros_like(held[i], at::TensorOptions().dtype(at::kFloat));
      }
    };
    ensure(st.exp_avg);
    ensure(st.exp_avg_sq);
    if (o.amsgrad()) ensure(st.max_exp_avg_sq);
    const auto options = kernels::AdamStepOptions()
                             .beta1(std::get<0>(o.betas()))
                             .beta2(std::get<1>(o.betas()))
                             .eps(o.eps())
                             .weight_decay(o.weight_decay())
                             .decoupled_weight_decay(o.decoupled_weight_decay())
                             .amsgrad(o.amsgrad());
    StepLists direct, mastered;
    split_group(held, model_params, first, direct, mastered);
    first += held.size();
    // The step counter advances once per group step: run both parts against a copy of it for the first and
    // the real counter for the last, so it advances exactly once.
    std::vector<StepLists*> parts;
    if (!direct.params.empty()) parts.push_back(&direct);
    if (!mastered.params.empty()) parts.push_back(&mastered);
    for (size_t k = 0; k < parts.size(); ++k) {
      StepLists& part = *parts[k];
      const bool last = k + 1 == parts.size();
      const at::Tensor step = last ? st.step : st.step.clone();
      kernels::fused_adam_step_(
          part.params, part.grads, pick<at::Tensor>(st.exp_avg, part.index),
          pick<at::Tensor>(st.exp_avg_sq, part.index),
          o.amsgrad() ? pick<at::Tensor>(st.max_exp_avg_sq, part.index) : std::vector<at::Tensor>{}, part.masters, step,
          st.lr, options, at::Tensor(), found_inf);
    }
  }
}

void FusedAdam::save(torch::serialize::OutputArchive& archive) const {
  for (size_t g = 0; g < groups_state_.size(); ++g) {
    const GroupState& st = groups_state_[g];
    const std::string prefix = "group" + std::to_string(g);
    if (st.step.defined()) archive.write(prefix + ".step", st.step.cpu());
    write_list(archive, prefix + ".exp_avg", st.exp_avg);
    write_list(archive, prefix + ".exp_avg_sq", st.exp_avg_sq);
    write_list(archive, prefix + ".max_exp_avg_sq", st.max_exp_avg_sq);
  }
}

void FusedAdam::load(torch::serialize::InputArchive& archive) {
  std::vector<GroupState> loaded(param_groups_.size());
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    const auto& held = param_groups_[g].params();
    const std::string prefix = "group" + std::to_string(g);
    GroupState& st = loaded[g];
    at::Tensor step;
    if (archive.try_read(prefix + ".step", step) && !held.empty()) {
      TORCH_CHECK(step.numel() == 1, "optimizer checkpoint: ", prefix, ".step must have 1 element");
      st.step = step.to(held[0].device(), at::kFloat).reshape({1});
      st.lr = device_scalar(held[0], param_groups_[g].options().get_lr());
    }
    read_list(archive, prefix + ".exp_avg", st.exp_avg, held);
    read_list(archive, prefix + ".exp_avg_sq", st.exp_avg_sq, held);
    read_list(archive, prefix + ".max_exp_avg_sq", st.max_exp_avg_sq, held);
  }
  groups_state_ = std::move(loaded);
}

FusedSGD::FusedSGD(std::vector<at::Tensor> params, FusedSgdOptions defaults)
    : Optimizer({torch::optim::OptimizerParamGroup(std::move(params))}, std::make_unique<FusedSgdOptions>(defaults)) {
  TORCH_CHECK(defaults.lr() >= 0, "lr must be >= 0, got ", defaults.lr());
  kernels::SgdStepOptions()
      .momentum(defaults.momentum())
      .dampening(defaults.dampening())
      .weight_decay(defaults.weight_decay())
      .nesterov(defaults.nesterov());
  TORCH_CHECK(!defaults.nesterov() || (defaults.momentum() > 0 && defaults.dampening() == 0),
              "nesterov needs momentum > 0 and dampening == 0, got momentum ", defaults.momentum(), " and dampening ",
              defaults.dampening());
}

at::Tensor FusedSGD::step(LossClosure closure) {
  at::Tensor loss;
  if (closure) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  run({}, at::Tensor());
  return loss;
}

void FusedSGD::fused_step(at::TensorList model_params, const at::Tensor& found_inf) { run(model_params, found_inf); }

void FusedSGD::run(at::TensorList model_params, const at::Tensor& found_inf) {
  check_model_params(model_params, count_params(param_groups_));
  groups_state_.resize(param_groups_.size());
  at::NoGradGuard no_grad;
  size_t first = 0;
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    const auto& held = param_groups_[g].params();
    const auto& o = static_cast<const FusedSgdOptions&>(param_groups_[g].options());
    GroupState& st = groups_state_[g];
    if (held.empty()) continue;
    if (!st.step.defined()) {
      st.step = device_scalar(held[0], 0.0);
      st.lr = device_scalar(held[0], o.lr());
    }
    st.lr.fill_(o.lr());
    if (o.momentum() > 0) {
      st.momentum.resize(held.size());
      for (size_t i = 0; i < held.size(); ++i) {
        if (!st.momentum[i].defined()) st.momentum[i] = at::empty_like(held[i], at::TensorOptions().dtype(at::kFloat));
      }
    }
    const auto options = kernels::SgdStepOptions()
                             .momentum(o.momentum())
                             .dampening(o.dampening())
                             .weight_decay(o.weight_decay())
                             .nesterov(o.nesterov());
    StepLists direct, mastered;
    split_group(held, model_params, first, direct, mastered);
    first += held.size();
    std::vector<StepLists*> parts;
    if (!direct.params.empty()) parts.push_back(&direct);
    if (!mastered.params.empty()) parts.push_back(&mastered);
    for (size_t k = 0; k < parts.size(); ++k) {
      StepLists& part = *parts[k];
      const at::Tensor step = k + 1 == parts.size() ? st.step : st.step.clone();
      kernels::fused_sgd_step_(part.params, part.grads,
                               o.momentum() > 0 ? pick<at::Tensor>(st.momentum, part.index) : std::vector<at::Tensor>{},
                               part.masters, step, st.lr, options, at::Tensor(), found_inf);
    }
  }
}

void FusedSGD::save(torch::serialize::OutputArchive& archive) const {
  for (size_t g = 0; g < groups_state_.size(); ++g) {
    const std::string prefix = "group" + std::to_string(g);
    if (groups_state_[g].step.defined()) archive.write(prefix + ".step", groups_state_[g].step.cpu());
    write_list(archive, prefix + ".momentum", groups_state_[g].momentum);
  }
}

void FusedSGD::load(torch::serialize::InputArchive& archive) {
  std::vector<GroupState> loaded(param_groups_.size());
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    const auto& held = param_groups_[g].params();
    const std::string prefix = "group" + std::to_string(g);
    at::Tensor step;
    if (archive.try_read(prefix + ".step", step) && !held.empty()) {
      TORCH_CHECK(step.numel() == 1, "optimizer checkpoint: ", prefix, ".step must have 1 element");
      loaded[g].step = step.to(held[0].device(), at::kFloat).reshape({1});
      loaded[g].lr = device_scalar(held[0], param_groups_[g].options().get_lr());
    }
    read_list(archive, prefix + ".momentum", loaded[g].momentum, held);
    if (loaded[g].momentum.size() == held.size()) {
      // Entries never written (no step taken yet) stay undefined and are created at the next step.
    }
  }
  groups_state_ = std::move(loaded);
}

}  // namespace amp
