#include <kernels/fused_optimizers.h>

#include <array>
#include <cmath>

#include <c10/util/Exception.h>

#include <kernels/cpu/capability.h>
#include <kernels/cpu/fused_optimizers_cpu.h>
#include <kernels/device_call.h>
#include <kernels/fused_optimizer_rules.h>
#include <kernels/tensor_lists.h>
#ifdef LIBTORCH_AMP_WITH_CUDA
#include <kernels/cuda/fused_optimizers_cuda.h>
#endif

namespace kernels {
namespace cpu {
LTA_CPU_DISPATCH(fused_adam, (const PointerLists<4>& lists, const AdamArgs& args), (lists, args))
LTA_CPU_DISPATCH(fused_adam, (const PointerLists<5>& lists, const AdamArgs& args), (lists, args))
LTA_CPU_DISPATCH(fused_adam, (const PointerLists<6>& lists, const AdamArgs& args), (lists, args))
LTA_CPU_DISPATCH(fused_sgd, (const PointerLists<2>& lists, const SgdArgs& args), (lists, args))
LTA_CPU_DISPATCH(fused_sgd, (const PointerLists<3>& lists, const SgdArgs& args), (lists, args))
LTA_CPU_DISPATCH(fused_sgd, (const PointerLists<4>& lists, const SgdArgs& args), (lists, args))
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
  float* step;
  const float* lr;
  const float* inv_scale;  // nullptr when not given
  const float* found_inf;  // nullptr when not given
};

StepScalars check_step_scalars(const at::Tensor& step, const at::Tensor& lr, const at::Tensor& inv_scale,
                               const at::Tensor& found_inf, const c10::Device& device) {
  check_scalar_tensor(step, "step", device, c10::ScalarType::Float);
  check_scalar_tensor(lr, "lr", device, c10::ScalarType::Float);
  StepScalars s{step.data_ptr<float>(), lr.data_ptr<float>(), nullptr, nullptr};
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

/// The device a step runs on: that of params[0], or of `step` when there are no parameters (the step count
/// still advances).
c10::Device step_device(at::TensorList params, const at::Tensor& step) {
  if (!params.empty()) return device_of(params);
  TORCH_CHECK(step.defined(), "step is an undefined tensor; it must be a 1-element Float tensor");
  return step.device();
}

/// Runs after every group of a step has been launched: they all read the count first (same stream on CUDA).
void advance_step_on(const c10::Device& device, const StepScalars& s) {
  on_device(
      device, [&] { advance_step(s.step, s.found_inf); },
      [&]([[maybe_unused]] CudaStreamHandle stream) {
#ifdef LIBTORCH_AMP_WITH_CUDA
        cuda::advance_step(s.step, s.found_inf, stream);
#endif
      });
}

template <int kDepth>
void adam_groups(const std::array<at::TensorList, kDepth>& lists, const std::array<const char*, kDepth>& names,
                 const c10::Device& device, const AdamArgs& args) {
  // group_lists checks every list before returning, so a bad argument throws before anything is written.
  for (const PointerLists<kDepth>& group : group_lists<kDepth>(lists, names, device)) {
    on_device(
        device, [&] { cpu::fused_adam(group, args); },
        [&]([[maybe_unused]] CudaStreamHandle stream) {
#ifdef LIBTORCH_AMP_WITH_CUDA
          cuda::fused_adam(group, args, stream);
#endif
        });
  }
}

template <int kDepth>
void sgd_groups(const std::array<at::TensorList, kDepth>& lists, const std::array<const char*, kDepth>& names,
                const c10::Device& device, const SgdArgs& args) {
  for (const PointerLists<kDepth>& group : group_lists<kDepth>(lists, names, device)) {
    on_device(
        device, [&] { cpu::fused_sgd(group, args); },
        [&]([[maybe_unused]] CudaStreamHandle stream) {
#ifdef LIBTORCH_AMP_WITH_CUDA
          cuda::fused_sgd(group, args, stream);
#endif
        });
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
                      at::TensorList max_exp_avg_sqs, at::TensorList master_params, const at::Tensor& step,
                      const at::Tensor& lr, const AdamStepOptions& options, const at::Tensor& inv_scale,
                      const at::Tensor& found_inf) {
  const c10::Device device = step_device(params, step);
  const StepScalars scalars = check_step_scalars(step, lr, inv_scale, found_inf, device);
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
      options.beta1(),   options.beta2(), options.eps(), options.weight_decay(), options.decoupled_weight_decay(),
      options.amsgrad(), scalars.step,    scalars.lr,    scalars.inv_scale,      scalars.found_inf};
  const bool masters = !master_params.empty();
  if (!options.amsgrad() && !masters) {
    adam_groups<4>({params, grads, exp_avgs, exp_avg_sqs}, {"params", "grads", "exp_avgs", "exp_avg_sqs"}, device,
                   args);
  } else if (options.amsgrad() && !masters) {
    adam_groups<5>({params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs},
                   {"params", "grads", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs"}, device, args);
  } else if (!options.amsgrad() && masters) {
    adam_groups<5>({params, grads, exp_avgs, exp_avg_sqs, master_params},
                   {"params", "grads", "exp_avgs", "exp_avg_sqs", "master_params"}, device, args);
  } else {
    adam_groups<6>({params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, master_params},
                   {"params", "grads", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs", "master_params"}, device, args);
  }
  advance_step_on(device, scalars);
}

void fused_sgd_step_(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers,
                     at::TensorList master_params, const at::Tensor& step, const at::Tensor& lr,
                     const SgdStepOptions& options, const at::Tensor& inv_scale, const at::Tensor& found_inf) {
  const c10::Device device = step_device(params, step);
  const StepScalars scalars = check_step_scalars(step, lr, inv_scale, found_inf, device);
  const bool momentum = options.momentum() != 0.0;
  TORCH_CHECK(!options.nesterov() || (momentum && options.dampening() == 0.0),
              "nesterov requires momentum > 0 and dampening == 0, got momentum ", options.momentum(), " and dampening ",
              options.dampening());
  TORCH_CHECK(momentum || momentum_buffers.empty(), "momentum_buffers must be empty when momentum == 0, got ",
              momentum_buffers.size(), " tensors");
  TORCH_CHECK(!momentum || momentum_buffers.size() == params.size(), "momentum ", options.momentum(),
              " needs one momentum_buffers tensor per param: got ", momentum_buffers.size(), " for ", params.size(),
              " params");
  check_list_dtype(momentum_buffers, "momentum_buffers", c10::ScalarType::Float);
  check_list_dtype(master_params, "master_params", c10::ScalarType::Float);

  const SgdArgs args{options.momentum(), options.dampening(), options.weight_decay(), options.nesterov(),
                     scalars.step,       scalars.lr,          scalars.inv_scale,      scalars.found_inf};
  const bool masters = !master_params.empty();
  if (!momentum && !masters) {
    sgd_groups<2>({params, grads}, {"params", "grads"}, device, args);
  } else if (momentum && !masters) {
    sgd_groups<3>({params, grads, momentum_buffers}, {"params", "grads", "momentum_buffers"}, device, args);
  } else if (!momentum && masters) {
    sgd_groups<3>({params, grads, master_params}, {"params", "grads", "master_params"}, device, args);
  } else {
    sgd_groups<4>({params, grads, momentum_buffers, master_params},
                  {"params", "grads", "momentum_buffers", "master_params"}, device, args);
  }
  advance_step_on(device, scalars);
}

}  // namespace kernels
