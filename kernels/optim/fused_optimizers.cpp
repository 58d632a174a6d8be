#include <kernels/optim/fused_optimizers.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <unordered_map>
#include <vector>

#include <c10/util/Exception.h>

#include <kernels/cpu/capability.h>
#include <kernels/cpu/fused_optimizers_cpu.h>
#include <kernels/device_call.h>
#include <kernels/optim/fused_optimizer_rules.h>
#include <kernels/tensor_lists.h>
#ifdef LIBTORCH_AMP_WITH_CUDA
#include <kernels/cuda/fused_optimizers_cuda.h>
#endif

namespace kernels {
namespace cpu {
LTA_CPU_DISPATCH(fused_adam, (const PointerLists<5>& lists, const AdamArgs& args), (lists, args))
LTA_CPU_DISPATCH(fused_adam, (const PointerLists<6>& lists, const AdamArgs& args), (lists, args))
LTA_CPU_DISPATCH(fused_adam, (const PointerLists<7>& lists, const AdamArgs& args), (lists, args))
LTA_CPU_DISPATCH(fused_sgd, (const PointerLists<2>& lists, const SgdArgs& args), (lists, args))
LTA_CPU_DISPATCH(fused_sgd, (const PointerLists<3>& lists, const SgdArgs& args), (lists, args))
LTA_CPU_DISPATCH(fused_sgd, (const PointerLists<4>& lists, const SgdArgs& args), (lists, args))
LTA_CPU_DISPATCH(fused_sgd, (const PointerLists<5>& lists, const SgdArgs& args), (lists, args))
}  // namespace cpu

namespace {

void check_beta(double value, const char* name) {
  TORCH_CHECK(value >= 0.0 && value < 1.0, name, " must be in [0, 1), got ", value);
}

void check_non_negative(double value, const char* name) {
  TORCH_CHECK(std::isfinite(value) && value >= 0.0, name, " must be finite and >= 0, got ", value);
}

/// The device-resident scalars every step reads, checked against the step's device.
struct StepScalars {
  const float* lr;
  const float* inv_scale;  // nullptr when not given
  const float* found_inf;  // nullptr when not given
};

StepScalars check_step_scalars(const at::Tensor& lr, const at::Tensor& inv_scale, const at::Tensor& found_inf,
                               const c10::Device& device) {
  check_scalar_tensor(lr, "lr", device, c10::ScalarType::Float);
  StepScalars s{lr.data_ptr<float>(), nullptr, nullptr};
  if (inv_scale.defined()) {
    check_scalar_tensor(inv_scale, "inv_scale", device, c10::ScalarType::Float);
    s.inv_scale = inv_scale.data_ptr<float>();
  }
  if (found_inf.defined()) {
    check_flag_tensor(found_inf, "found_inf", device);
    s.found_inf = found_inf.data_ptr<float>();
  }
  return s;
}

/// The device a step runs on: that of params[0], or of `lr` when there are no parameters.
c10::Device step_device(at::TensorList params, const at::Tensor& lr) {
  if (!params.empty()) return device_of(params);
  TORCH_CHECK(lr.defined(), "lr is an undefined tensor; it must be a 1-element Float tensor");
  return lr.device();
}

/// Checks `steps` (one distinct 1-element fp32 tensor per param on `device`, or none when !required) and
/// returns their addresses in param order. Two params sharing a count would advance it twice per step.
std::vector<float*> check_steps(at::TensorList steps, size_t num_params, bool required, const char* why,
                                const c10::Device& device) {
  TORCH_CHECK(required || steps.empty(), "steps must be empty ", why, ", got ", steps.size(), " tensors");
  TORCH_CHECK(!required || steps.size() == num_params, "steps must hold one step count per param ", why, ": got ",
              steps.size(), " for ", num_params, " params");
  std::vector<float*> out;
  std::unordered_map<const void*, size_t> seen;
  for (size_t i = 0; i < steps.size(); ++i) {
    const at::Tensor& t = steps[i];
    TORCH_CHECK(t.defined(), "steps[", i, "] is an undefined tensor; it must be a 1-element Float tensor on ", device);
    TORCH_CHECK(t.numel() == 1 && t.scalar_type() == c10::ScalarType::Float && t.device() == device, "steps[", i,
                "] must be a 1-element Float tensor on ", device, ", got ", t.numel(), " element(s) of ",
                t.scalar_type(), " on ", t.device());
    const auto [it, inserted] = seen.emplace(t.data_ptr(), i);
    TORCH_CHECK(inserted, "steps[", i, "] is the same count as steps[", it->second,
                "]: each param needs its own step count");
    out.push_back(t.data_ptr<float>());
  }
  return out;
}

/// Each group's lists with the step count of each entry appended as a last list (see fused_optimizers_cuda.h).
template <int kDepth>
std::vector<PointerLists<kDepth + 1>> with_steps(const std::vector<PointerLists<kDepth>>& groups,
                                                 const std::vector<float*>& steps) {
  std::vector<PointerLists<kDepth + 1>> out;
  for (const PointerLists<kDepth>& group : groups) {
    PointerLists<kDepth + 1> g;
    std::copy(group.dtypes.begin(), group.dtypes.end(), g.dtypes.begin());
    g.dtypes[kDepth] = DType::kFloat32;
    for (int64_t t = 0; t < group.size(); ++t) {
      std::array<void*, kDepth + 1> ptrs{};
      std::copy(group.addresses[t].begin(), group.addresses[t].end(), ptrs.begin());
      ptrs[kDepth] = steps[static_cast<size_t>(group.original_index[t])];
      g.push_back(ptrs, group.num_elements[t], group.original_index[t]);
    }
    out.push_back(std::move(g));
  }
  return out;
}

/// Runs after every group of a step has been launched: they all read the counts first (same stream on CUDA).
void advance_steps_on(const c10::Device& device, const std::vector<float*>& steps, const float* found_inf) {
  if (steps.empty()) return;
  on_device(
      device,
      [&] {
        for (float* step : steps) advance_step(step, found_inf);
      },
      [&]([[maybe_unused]] CudaStreamHandle stream) {
#ifdef LIBTORCH_AMP_WITH_CUDA
        cuda::advance_steps(steps, found_inf, stream);
#endif
      });
}

/// Calls cpu_fn(group, args) or cuda_fn(group, args, stream) for each dtype group, as `device` asks.
template <int kDepth, typename Args, typename CpuFn, typename CudaFn>
void launch_groups(const std::vector<PointerLists<kDepth>>& groups, const c10::Device& device, const Args& args,
                   CpuFn cpu_fn, CudaFn cuda_fn) {
  for (const PointerLists<kDepth>& group : groups) {
    on_device(
        device, [&] { cpu_fn(group, args); },
        [&]([[maybe_unused]] CudaStreamHandle stream) { cuda_fn(group, args, stream); });
  }
}

template <int kDepth>
void adam_groups(const std::array<at::TensorList, kDepth>& lists, const std::array<const char*, kDepth>& names,
                 const std::vector<float*>& steps, const c10::Device& device, const AdamArgs& args) {
  // group_lists checks every list before returning, so a bad argument throws before anything is written.
  launch_groups(
      with_steps<kDepth>(group_lists<kDepth>(lists, names, device), steps), device, args,
      [](const PointerLists<kDepth + 1>& group, const AdamArgs& a) { cpu::fused_adam(group, a); },
      []([[maybe_unused]] const PointerLists<kDepth + 1>& group, [[maybe_unused]] const AdamArgs& a,
         [[maybe_unused]] CudaStreamHandle stream) {
#ifdef LIBTORCH_AMP_WITH_CUDA
        cuda::fused_adam(group, a, stream);
#endif
      });
}

/// SGD groups: with momentum the step counts are appended (kWithSteps), without there are none.
template <int kDepth, bool kWithSteps>
void sgd_groups(const std::array<at::TensorList, kDepth>& lists, const std::array<const char*, kDepth>& names,
                [[maybe_unused]] const std::vector<float*>& steps, const c10::Device& device, const SgdArgs& args) {
  auto cpu_fn = [](const auto& group, const SgdArgs& a) { cpu::fused_sgd(group, a); };
  auto cuda_fn = []([[maybe_unused]] const auto& group, [[maybe_unused]] const SgdArgs& a,
                    [[maybe_unused]] CudaStreamHandle stream) {
#ifdef LIBTORCH_AMP_WITH_CUDA
    cuda::fused_sgd(group, a, stream);
#endif
  };
  auto groups = group_lists<kDepth>(lists, names, device);
  if constexpr (kWithSteps) {
    launch_groups(with_steps<kDepth>(groups, steps), device, args, cpu_fn, cuda_fn);
  } else {
    launch_groups(groups, device, args, cpu_fn, cuda_fn);
  }
}

}  // namespace

AdamStepOptions& AdamStepOptions::beta1(double value) {
  check_beta(value, "beta1");
  beta1_ = value;
  return *this;
}

AdamStepOptions& AdamStepOptions::beta2(double value) {
  check_beta(value, "beta2");
  beta2_ = value;
  return *this;
}

AdamStepOptions& AdamStepOptions::eps(double value) {
  TORCH_CHECK(std::isfinite(value) && value > 0.0, "eps must be finite and > 0, got ", value);
  eps_ = value;
  return *this;
}

AdamStepOptions& AdamStepOptions::weight_decay(double value) {
  check_non_negative(value, "weight_decay");
  weight_decay_ = value;
  return *this;
}

AdamStepOptions& AdamStepOptions::decoupled_weight_decay(bool value) {
  decoupled_weight_decay_ = value;
  return *this;
}

AdamStepOptions& AdamStepOptions::amsgrad(bool value) {
  amsgrad_ = value;
  return *this;
}

SgdStepOptions& SgdStepOptions::momentum(double value) {
  check_non_negative(value, "momentum");
  momentum_ = value;
  return *this;
}

SgdStepOptions& SgdStepOptions::dampening(double value) {
  TORCH_CHECK(std::isfinite(value), "dampening must be finite, got ", value);
  dampening_ = value;
  return *this;
}

SgdStepOptions& SgdStepOptions::weight_decay(double value) {
  check_non_negative(value, "weight_decay");
  weight_decay_ = value;
  return *this;
}

SgdStepOptions& SgdStepOptions::nesterov(bool value) {
  nesterov_ = value;
  return *this;
}

void fused_adam_step_(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                      at::TensorList max_exp_avg_sqs, at::TensorList master_params, at::TensorList steps,
                      const at::Tensor& lr, const AdamStepOptions& options, const at::Tensor& inv_scale,
                      const at::Tensor& found_inf) {
  const c10::Device device = step_device(params, lr);
  const StepScalars scalars = check_step_scalars(lr, inv_scale, found_inf, device);
  const std::vector<float*> step_ptrs = check_steps(steps, params.size(), true, "for Adam", device);
  TORCH_CHECK(options.amsgrad() || max_exp_avg_sqs.empty(),
              "max_exp_avg_sqs must be empty unless options.amsgrad() is set, got ", max_exp_avg_sqs.size(),
              " tensors");
  TORCH_CHECK(!options.amsgrad() || max_exp_avg_sqs.size() == params.size(),
              "options.amsgrad() needs one max_exp_avg_sqs tensor per param: got ", max_exp_avg_sqs.size(), " for ",
              params.size(), " params");
  check_list_dtype(exp_avgs, "exp_avgs", c10::ScalarType::Float);
  check_list_dtype(exp_avg_sqs, "exp_avg_sqs", c10::ScalarType::Float);
  check_list_dtype(max_exp_avg_sqs, "max_exp_avg_sqs", c10::ScalarType::Float);
  check_list_dtype(master_params, "master_params", c10::ScalarType::Float);

  const AdamArgs args{
      options.beta1(),   options.beta2(), options.eps(),     options.weight_decay(), options.decoupled_weight_decay(),
      options.amsgrad(), scalars.lr,      scalars.inv_scale, scalars.found_inf};
  const bool masters = !master_params.empty();
  if (!options.amsgrad() && !masters) {
    adam_groups<4>({params, grads, exp_avgs, exp_avg_sqs}, {"params", "grads", "exp_avgs", "exp_avg_sqs"}, step_ptrs,
                   device, args);
  } else if (options.amsgrad() && !masters) {
    adam_groups<5>({params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs},
                   {"params", "grads", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs"}, step_ptrs, device, args);
  } else if (!options.amsgrad() && masters) {
    adam_groups<5>({params, grads, exp_avgs, exp_avg_sqs, master_params},
                   {"params", "grads", "exp_avgs", "exp_avg_sqs", "master_params"}, step_ptrs, device, args);
  } else {
    adam_groups<6>({params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, master_params},
                   {"params", "grads", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs", "master_params"}, step_ptrs,
                   device, args);
  }
  advance_steps_on(device, step_ptrs, scalars.found_inf);
}

void fused_sgd_step_(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers,
                     at::TensorList master_params, at::TensorList steps, const at::Tensor& lr,
                     const SgdStepOptions& options, const at::Tensor& inv_scale, const at::Tensor& found_inf) {
  const c10::Device device = step_device(params, lr);
  const StepScalars scalars = check_step_scalars(lr, inv_scale, found_inf, device);
  const bool momentum = options.momentum() != 0.0;
  TORCH_CHECK(!options.nesterov() || (momentum && options.dampening() == 0.0),
              "nesterov requires momentum > 0 and dampening == 0, got momentum ", options.momentum(), " and dampening ",
              options.dampening());
  TORCH_CHECK(momentum || momentum_buffers.empty(), "momentum_buffers must be empty when momentum == 0, got ",
              momentum_buffers.size(), " tensors");
  TORCH_CHECK(!momentum || momentum_buffers.size() == params.size(), "momentum ", options.momentum(),
              " needs one momentum_buffers tensor per param: got ", momentum_buffers.size(), " for ", params.size(),
              " params");
  const std::vector<float*> step_ptrs =
      check_steps(steps, params.size(), momentum, momentum ? "with momentum" : "when momentum == 0", device);
  check_list_dtype(momentum_buffers, "momentum_buffers", c10::ScalarType::Float);
  check_list_dtype(master_params, "master_params", c10::ScalarType::Float);

  const SgdArgs args{options.momentum(), options.dampening(), options.weight_decay(), options.nesterov(),
                     scalars.lr,         scalars.inv_scale,   scalars.found_inf};
  const bool masters = !master_params.empty();
  if (!momentum && !masters) {
    sgd_groups<2, false>({params, grads}, {"params", "grads"}, step_ptrs, device, args);
  } else if (!momentum && masters) {
    sgd_groups<3, false>({params, grads, master_params}, {"params", "grads", "master_params"}, step_ptrs, device, args);
  } else if (momentum && !masters) {
    sgd_groups<3, true>({params, grads, momentum_buffers}, {"params", "grads", "momentum_buffers"}, step_ptrs, device,
                        args);
  } else {
    sgd_groups<4, true>({params, grads, momentum_buffers, master_params},
                        {"params", "grads", "momentum_buffers", "master_params"}, step_ptrs, device, args);
  }
  advance_steps_on(device, step_ptrs, scalars.found_inf);
}

}  // namespace kernels
