#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

namespace kernels {

/// Hyper-parameters of fused_adam_step_, with chainable setters that validate their value
/// (`AdamStepOptions().weight_decay(0.01).amsgrad(true)`). Defaults are torch::optim::AdamW's.
class AdamStepOptions {
 public:
  /// Decay of the first moment, in [0, 1). Default 0.9.
  AdamStepOptions& beta1(double value);
  /// Decay of the second moment, in [0, 1). Default 0.999.
  AdamStepOptions& beta2(double value);
  /// Added to the denominator, finite and > 0. Default 1e-8.
  AdamStepOptions& eps(double value);
  /// Finite and >= 0. Default 0.
  AdamStepOptions& weight_decay(double value);
  /// true: AdamW (param *= 1 - lr * weight_decay before the update); false: Adam with L2 regularisation
  /// (grad += weight_decay * param). Default true (these options default to AdamW's).
  AdamStepOptions& decoupled_weight_decay(bool value);
  /// Normalise by the running maximum of the second moment (needs max_exp_avg_sqs). Default false.
  AdamStepOptions& amsgrad(bool value);

  /// Decay of the first moment.
  double beta1() const { return beta1_; }
  /// Decay of the second moment.
  double beta2() const { return beta2_; }
  /// Added to the denominator.
  double eps() const { return eps_; }
  /// Weight decay rate.
  double weight_decay() const { return weight_decay_; }
  /// true: AdamW; false: Adam with L2 regularisation.
  bool decoupled_weight_decay() const { return decoupled_weight_decay_; }
  /// Whether AMSGrad is on.
  bool amsgrad() const { return amsgrad_; }

 private:
  double beta1_ = 0.9;
  double beta2_ = 0.999;
  double eps_ = 1e-8;
  double weight_decay_ = 0.0;
  bool decoupled_weight_decay_ = true;
  bool amsgrad_ = false;
};

/// Hyper-parameters of fused_sgd_step_ with torch::optim::SGD's meaning and defaults; chainable, validated
/// setters. nesterov needs momentum > 0 and dampening == 0, checked when the step is called (the setters may
/// come in any order).
class SgdStepOptions {
 public:
  /// Finite and >= 0; 0 means plain SGD without momentum buffers. Default 0.
  SgdStepOptions& momentum(double value);
  /// Finite. Default 0.
  SgdStepOptions& dampening(double value);
  /// Finite and >= 0 (L2: grad += weight_decay * param). Default 0.
  SgdStepOptions& weight_decay(double value);
  /// Default false.
  SgdStepOptions& nesterov(bool value);

  /// Momentum factor; 0: no momentum buffers.
  double momentum() const { return momentum_; }
  /// Dampening of the gradient added to the momentum buffer.
  double dampening() const { return dampening_; }
  /// L2 weight decay coefficient.
  double weight_decay() const { return weight_decay_; }
  /// Whether Nesterov momentum is on.
  bool nesterov() const { return nesterov_; }

 private:
  double momentum_ = 0.0;
  double dampening_ = 0.0;
  double weight_decay_ = 0.0;
  bool nesterov_ = false;
};

/// One Adam/AdamW step over all parameters in a single fused pass per dtype group, with torch::optim::AdamW's
/// (decoupled) or torch::optim::Adam's (L2) formulas; see Note [fused optimizer step] in
/// kernels/optim/fused_optimizer_rules.h. Pass only the parameters that have a gradient this step: as in torch.optim,
/// a parameter left out is not stepped and its state and step count stay as they are.
///
/// params:          float32/float16/bfloat16 (mixed allowed), contiguous, all on one device (CPU or CUDA);
///                  updated in place. With masters they receive the new master value rounded to their dtype.
/// grads:           one per param, same numel, any of the three dtypes (independently of params); read only.
/// exp_avgs, exp_avg_sqs: one float32 tensor per param, same numel; the caller zeroes them before the param's
///                  first step (torch.optim creates them as zeros at the param's first gradient).
/// max_exp_avg_sqs: empty unless options.amsgrad(); then one float32 tensor per param, zeroed like exp_avgs.
/// master_params:   empty, or one float32 tensor per param (the fp32 copy the update is computed on).
/// steps:           one 1-element float32 tensor per param, on the device, each its own (torch.optim's
///                  per-parameter state['step'], like the state_steps of at::_fused_adamw_): the param's completed
///                  steps, 0 before its first. Its bias corrections use its count + 1; every count of the call is
///                  incremented on the device after the update unless found_inf is set. Exact up to 2^24 steps.
/// lr:              1-element float32 tensor on the device, read on the device (so a scheduler can change it
///                  without re-capturing a CUDA graph). Not validated: a device value cannot be read here.
/// inv_scale:       optional 1-element float32 tensor on the device; gradients are multiplied by it on the fly.
/// found_inf:       optional 1-element float32 tensor on the device; when nonzero nothing is written (params,
///                  masters, state and step counts stay bit-identical).
/// CUDA: one launch per (param dtype, grad dtype) group per 32 KB chunk table (the table carries each tensor's
/// step count address), plus one small launch per 500 step counts, all on the current stream. Host syncs: none;
/// the call can be captured in a CUDA graph (the counts' addresses are baked in: keep the same step tensors).
/// CPU:  vectorized (at::vec) and threaded (at::parallel_for).
void fused_adam_step_(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                      at::TensorList max_exp_avg_sqs, at::TensorList master_params, at::TensorList steps,
                      const at::Tensor& lr, const AdamStepOptions& options, const at::Tensor& inv_scale = {},
                      const at::Tensor& found_inf = {});

/// One SGD step (torch::optim::SGD: weight decay, momentum with dampening, Nesterov) in a single fused pass per
/// dtype group; see Note [fused optimizer step]. Pass only the parameters that have a gradient this step.
///
/// params, grads, master_params, lr, inv_scale, found_inf: as for fused_adam_step_.
/// momentum_buffers: empty iff options.momentum() == 0; else one float32 tensor per param. At a param's first
///                   step (its step count is 0) its buffer is overwritten with the gradient (torch.optim's
///                   `buf = grad.clone()`, dampening not applied) and its old contents are never read.
/// steps:            empty iff options.momentum() == 0 (plain SGD keeps no state, as torch.optim); else one
///                   1-element float32 count per param as for fused_adam_step_, advanced the same way. It tells
///                   each param's first step apart, so a param whose first gradient comes late starts right.
/// Host syncs: none (CUDA graph capturable).
void fused_sgd_step_(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers,
                     at::TensorList master_params, at::TensorList steps, const at::Tensor& lr,
                     const SgdStepOptions& options, const at::Tensor& inv_scale = {}, const at::Tensor& found_inf = {});

}  // namespace kernels
