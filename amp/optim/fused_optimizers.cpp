#include <amp/optim/fused_optimizers.h>

#include <cmath>
#include <initializer_list>
#include <string>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/serialize/archive.h>

#include <amp/optim/device_lr.h>
#include <kernels/capture.h>
#include <kernels/optim/fused_optimizers.h>

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
    if (list[i].defined()) archive.write(key + "." + std::to_string(i), list[i].cpu());
  }
}

/// Reads `key.<i>` for every parameter; a missing entry stays undefined (no state yet). `numel` of an entry
/// must be the parameter's (or 1 for a step count).
void read_list(torch::serialize::InputArchive& archive, const std::string& key, std::vector<at::Tensor>& list,
               const std::vector<at::Tensor>& params, bool step_counts = false) {
  list.assign(params.size(), at::Tensor());
  for (size_t i = 0; i < params.size(); ++i) {
    at::Tensor value;
    if (!archive.try_read(key + "." + std::to_string(i), value)) continue;
    const int64_t numel = step_counts ? 1 : params[i].numel();
    TORCH_CHECK(value.numel() == numel, "optimizer checkpoint: ", key, ".", i, " has ", value.numel(), " elements but ",
                step_counts ? std::string("a step count has 1") : "the parameter has " + std::to_string(numel));
    if (step_counts) {
      const double count = value.to(at::kDouble).reshape({}).item<double>();  // a load, not a step: host read is fine
      TORCH_CHECK(std::isfinite(count) && count >= 0 && count == std::floor(count), "optimizer checkpoint: ", key, ".",
                  i, " must be a whole number of steps >= 0, got ", count);
      list[i] = value.to(params[i].device(), at::kFloat).reshape({1}).contiguous();
    } else {
      list[i] = value.to(params[i].device(), at::kFloat).reshape(params[i].sizes()).contiguous();
    }
  }
}

/// A parameter has state iff it has a step count: every other per-parameter entry must follow (`required`) or
/// may follow (optional ones, like max_exp_avg_sq when amsgrad was off) that.
void check_state_consistent(const std::string& prefix, const std::vector<at::Tensor>& steps,
                            const std::vector<at::Tensor>& list, const char* field, bool required) {
  for (size_t i = 0; i < steps.size(); ++i) {
    TORCH_CHECK(steps[i].defined() || !list[i].defined(), "optimizer checkpoint: ", prefix, ".", field, ".", i,
                " is present but ", prefix, ".step.", i, " is missing");
    TORCH_CHECK(!required || !steps[i].defined() || list[i].defined(), "optimizer checkpoint: ", prefix, ".step.", i,
                " is present but ", prefix, ".", field, ".", i, " is missing");
  }
}

void append_defined(std::vector<at::Tensor>& all, std::initializer_list<const std::vector<at::Tensor>*> lists) {
  for (const auto* list : lists) {
    for (const at::Tensor& t : *list) {
      if (t.defined()) all.push_back(t);
    }
  }
}

at::Tensor device_scalar(const at::Tensor& like, double value) {
  return at::full({1}, value, at::TensorOptions().dtype(at::kFloat).device(like.device()));
}

at::Tensor run_closure(const torch::optim::Optimizer::LossClosure& closure) {
  if (!closure) return at::Tensor();
  at::AutoGradMode enable_grad(true);
  return closure();
}

/// The loop both fused optimizers share: per group, lazily create the device lr, refresh it, let
/// `prepare(group, held, state)` create the state of the parameters that have a gradient, then call
/// `launch(group, part)` for the masterless and the mastered parameters (each part passes its own parameters'
/// step counts, so the order of the parts does not matter).
template <typename State, typename Prepare, typename Launch>
void run_groups(const std::vector<torch::optim::OptimizerParamGroup>& groups, std::vector<State>& states,
                at::TensorList model_params, Prepare prepare, Launch launch) {
  check_model_params(model_params, count_params(groups));
  states.resize(groups.size());
  at::NoGradGuard no_grad;
  size_t first = 0;
  for (size_t g = 0; g < groups.size(); ++g) {
    const auto& held = groups[g].params();
    State& st = states[g];
    if (held.empty()) continue;
    // Written outside a CUDA graph capture only, when the host value changed (Note [capture-safe step]).
    detail::update_device_lr(st.lr, st.lr_written, groups[g].options().get_lr(), held[0].device(),
                             kernels::is_capturing(held[0].device()), "fused optimizer step()", g);
    prepare(g, held, st);
    StepLists direct, mastered;
    split_group(held, model_params, first, direct, mastered);
    first += held.size();
    if (!direct.params.empty()) launch(g, direct);
    if (!mastered.params.empty()) launch(g, mastered);
  }
}

/// FusedOptimizer::sync_lr for either optimizer: every group that has stepped gets its host lr on the device.
template <typename State>
void sync_group_lrs(const std::vector<torch::optim::OptimizerParamGroup>& groups, std::vector<State>& states) {
  for (size_t g = 0; g < groups.size(); ++g) {
    if (groups[g].params().empty()) continue;
    const c10::Device device = groups[g].params()[0].device();
    kernels::check_not_capturing(device, "FusedOptimizer::sync_lr()",
                                 "call it before the capture or between replays, where its write takes effect");
    if (g >= states.size() || !states[g].lr.defined()) continue;  // created by the group's first step
    detail::update_device_lr(states[g].lr, states[g].lr_written, groups[g].options().get_lr(), device, false,
                             "FusedOptimizer::sync_lr()", g);
  }
}

/// Creates, for every parameter that has a gradient and no state yet, its step count (0) and, through
/// `create(i)`, its other state: torch.optim creates a parameter's state at its first gradient.
template <typename Create>
void create_state_at_first_gradient(const std::vector<at::Tensor>& held, detail::StepState& st, Create create) {
  st.step.resize(held.size());
  for (size_t i = 0; i < held.size(); ++i) {
    if (!held[i].grad().defined()) continue;
    if (!st.step[i].defined()) st.step[i] = device_scalar(held[i], 0.0);
    create(i);
  }
}

void ensure_fp32_zeros(std::vector<at::Tensor>& list, const std::vector<at::Tensor>& held, size_t i) {
  list.resize(held.size());
  if (!list[i].defined()) list[i] = at::zeros_like(held[i], at::TensorOptions().dtype(at::kFloat));
}

/// Refuses a checkpoint of the per-group step format (one `group<g>.step` per group): its parameters' own
/// step counts are not recorded, so it cannot be resumed exactly.
void check_not_per_group_format(torch::serialize::InputArchive& archive, const std::string& prefix) {
  at::Tensor old_step;
  TORCH_CHECK(!archive.try_read(prefix + ".step", old_step), "optimizer checkpoint: '", prefix,
              ".step' is a per-group step count, from a libtorch-amp version before per-parameter optimizer state; "
              "it records no step count per parameter and cannot be resumed exactly. Start from a checkpoint written "
              "by this version");
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
  at::Tensor loss = run_closure(closure);
  run({}, at::Tensor());
  return loss;
}

void FusedAdam::fused_step(at::TensorList model_params, const at::Tensor& found_inf) { run(model_params, found_inf); }

void FusedAdam::sync_lr() { sync_group_lrs(param_groups_, groups_state_); }

std::vector<std::string> FusedAdam::state_fields() const { return {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"}; }

std::vector<at::Tensor> FusedAdam::state_tensors() const {
  std::vector<at::Tensor> all;
  for (const GroupState& st : groups_state_) {
    append_defined(all, {&st.exp_avg, &st.exp_avg_sq, &st.max_exp_avg_sq, &st.step});
    if (st.lr.defined()) all.push_back(st.lr);
  }
  return all;
}

void FusedAdam::run(at::TensorList model_params, const at::Tensor& found_inf) {
  auto options_of = [&](size_t g) -> const FusedAdamOptions& {
    return static_cast<const FusedAdamOptions&>(param_groups_[g].options());
  };
  run_groups(
      param_groups_, groups_state_, model_params,
      [&](size_t g, const std::vector<at::Tensor>& held, GroupState& st) {
        create_state_at_first_gradient(held, st, [&](size_t i) {
          ensure_fp32_zeros(st.exp_avg, held, i);
          ensure_fp32_zeros(st.exp_avg_sq, held, i);
          if (options_of(g).amsgrad()) ensure_fp32_zeros(st.max_exp_avg_sq, held, i);
        });
      },
      [&](size_t g, StepLists& part) {
        const FusedAdamOptions& o = options_of(g);
        const GroupState& st = groups_state_[g];
        const auto options = kernels::AdamStepOptions()
                                 .beta1(std::get<0>(o.betas()))
                                 .beta2(std::get<1>(o.betas()))
                                 .eps(o.eps())
                                 .weight_decay(o.weight_decay())
                                 .decoupled_weight_decay(o.decoupled_weight_decay())
                                 .amsgrad(o.amsgrad());
        kernels::fused_adam_step_(part.params, part.grads, pick(st.exp_avg, part.index),
                                  pick(st.exp_avg_sq, part.index),
                                  o.amsgrad() ? pick(st.max_exp_avg_sq, part.index) : std::vector<at::Tensor>{},
                                  part.masters, pick(st.step, part.index), st.lr, options, at::Tensor(), found_inf);
      });
}

void FusedAdam::save(torch::serialize::OutputArchive& archive) const {
  for (size_t g = 0; g < groups_state_.size(); ++g) {
    const GroupState& st = groups_state_[g];
    const std::string prefix = "group" + std::to_string(g);
    write_list(archive, prefix + ".step", st.step);
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
    check_not_per_group_format(archive, prefix);
    GroupState& st = loaded[g];
    read_list(archive, prefix + ".step", st.step, held, /*step_counts=*/true);
    read_list(archive, prefix + ".exp_avg", st.exp_avg, held);
    read_list(archive, prefix + ".exp_avg_sq", st.exp_avg_sq, held);
    read_list(archive, prefix + ".max_exp_avg_sq", st.max_exp_avg_sq, held);
    check_state_consistent(prefix, st.step, st.exp_avg, "exp_avg", true);
    check_state_consistent(prefix, st.step, st.exp_avg_sq, "exp_avg_sq", true);
    check_state_consistent(prefix, st.step, st.max_exp_avg_sq, "max_exp_avg_sq", false);
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
  at::Tensor loss = run_closure(closure);
  run({}, at::Tensor());
  return loss;
}

void FusedSGD::fused_step(at::TensorList model_params, const at::Tensor& found_inf) { run(model_params, found_inf); }

void FusedSGD::sync_lr() { sync_group_lrs(param_groups_, groups_state_); }

std::vector<std::string> FusedSGD::state_fields() const { return {"step", "momentum"}; }

std::vector<at::Tensor> FusedSGD::state_tensors() const {
  std::vector<at::Tensor> all;
  for (const GroupState& st : groups_state_) {
    append_defined(all, {&st.momentum, &st.step});
    if (st.lr.defined()) all.push_back(st.lr);
  }
  return all;
}

void FusedSGD::run(at::TensorList model_params, const at::Tensor& found_inf) {
  auto options_of = [&](size_t g) -> const FusedSgdOptions& {
    return static_cast<const FusedSgdOptions&>(param_groups_[g].options());
  };
  run_groups(
      param_groups_, groups_state_, model_params,
      [&](size_t g, const std::vector<at::Tensor>& held, GroupState& st) {
        if (options_of(g).momentum() <= 0) return;  // plain SGD keeps no state, as torch.optim.SGD
        // Zeros, although the kernel overwrites a buffer with the gradient at its parameter's first step and never
        // reads it before: the state (and a checkpoint of it) never holds uninitialised memory.
        create_state_at_first_gradient(held, st, [&](size_t i) { ensure_fp32_zeros(st.momentum, held, i); });
      },
      [&](size_t g, StepLists& part) {
        const FusedSgdOptions& o = options_of(g);
        const GroupState& st = groups_state_[g];
        const auto options = kernels::SgdStepOptions()
                                 .momentum(o.momentum())
                                 .dampening(o.dampening())
                                 .weight_decay(o.weight_decay())
                                 .nesterov(o.nesterov());
        const bool momentum = o.momentum() > 0;
        kernels::fused_sgd_step_(
            part.params, part.grads, momentum ? pick(st.momentum, part.index) : std::vector<at::Tensor>{}, part.masters,
            momentum ? pick(st.step, part.index) : std::vector<at::Tensor>{}, st.lr, options, at::Tensor(), found_inf);
      });
}

void FusedSGD::save(torch::serialize::OutputArchive& archive) const {
  for (size_t g = 0; g < groups_state_.size(); ++g) {
    const std::string prefix = "group" + std::to_string(g);
    write_list(archive, prefix + ".step", groups_state_[g].step);
    write_list(archive, prefix + ".momentum", groups_state_[g].momentum);
  }
}

void FusedSGD::load(torch::serialize::InputArchive& archive) {
  std::vector<GroupState> loaded(param_groups_.size());
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    const auto& held = param_groups_[g].params();
    const std::string prefix = "group" + std::to_string(g);
    check_not_per_group_format(archive, prefix);
    read_list(archive, prefix + ".step", loaded[g].step, held, /*step_counts=*/true);
    read_list(archive, prefix + ".momentum", loaded[g].momentum, held);
    check_state_consistent(prefix, loaded[g].step, loaded[g].momentum, "momentum", true);
  }
  groups_state_ = std::move(loaded);
}

}  // namespace amp
