#pragma once

// The Adam/AdamW and SGD update rules, written once for the CUDA functors and the CPU twins. Plain C++ (no
// ATen): included by kernels/optim/fused_optimizers.cpp, kernels/cuda/fused_optimizers.cu and the CPU twin.
//
// Note [fused optimizer step]
// One pass per element: read the gradient (any dtype, times inv_scale), the fp32 state and the fp32 value to
// update (the master when there is one, else the parameter widened to fp32), apply torch::optim's formulas in
// fp32, and write back the state, the master and the parameter (rounded to its dtype) in the same pass.
// Everything that changes per step (step counts, lr, inv_scale, found_inf) is read on the device, so a step
// never syncs the host and can be captured in a CUDA graph. The step count is kept per parameter, as
// torch.optim keeps state['step']: each tensor's entry in the chunk table carries a pointer to its own 1-element
// count, Adam's bias corrections use that count + 1, and SGD starts a parameter's momentum buffer as a copy of
// its gradient when that count is 0 (a parameter whose first gradient comes late starts then, never from the
// buffer's old contents). After every update of the call has been launched, a separate pass advances the
// counts of the tensors of the call unless found_inf is set (a tensor's chunks all read the count first).
// When found_inf is nonzero every functor returns before writing anything, so a skipped step leaves params,
// masters, state and step counts bit-identical.
//
// The formulas follow LibTorch 2.11 (torch/csrc/api/src/optim/{adam,adamw,sgd}.cpp), in their order of
// operations, so fp32 results agree with torch::optim to a few ulps:
//   Adam:  g += wd * p (L2);                 AdamW: p *= 1 - lr * wd (decoupled)
//          m = m * b1 + (1 - b1) * g;  v = v * b2 + (1 - b2) * g * g;  amsgrad: v_max = max(v_max, v)
//          p -= lr / (1 - b1^t) * m / (sqrt(v or v_max) / sqrt(1 - b2^t) + eps),  t = step + 1 (the parameter's own)
//   SGD:   g += wd * p;  momentum: buf = (step == 0 ? g : buf * momentum + (1 - dampening) * g),
//          g = nesterov ? g + momentum * buf : buf;  p -= lr * g

#include <cmath>

#include <kernels/host_device.h>

namespace kernels {

/// Adam/AdamW hyper-parameters fixed for a call, and the device-resident scalars read by every block.
struct AdamArgs {
  double beta1;                 ///< decay of the first moment (exp_avg)
  double beta2;                 ///< decay of the second moment (exp_avg_sq)
  double eps;                   ///< added to the denominator
  double weight_decay;          ///< L2 coefficient (Adam) or decoupled decay rate (AdamW)
  bool decoupled_weight_decay;  ///< AdamW when true, Adam with L2 regularisation when false
  bool amsgrad;                 ///< normalise by the running maximum of the second moment (max_exp_avg_sq)
  const float* lr;              ///< learning rate
  const float* inv_scale;       ///< nullptr: gradients are used as they are
  const float* found_inf;       ///< nullptr: never skip
};

/// SGD hyper-parameters fixed for a call, and the device-resident scalars (as in AdamArgs).
struct SgdArgs {
  double momentum;         ///< momentum factor; 0: no momentum buffer
  double dampening;        ///< the gradient enters the momentum buffer times 1 - dampening
  double weight_decay;     ///< L2 coefficient: grad += weight_decay * param
  bool nesterov;           ///< Nesterov momentum
  const float* lr;         ///< learning rate
  const float* inv_scale;  ///< nullptr: gradients are used as they are
  const float* found_inf;  ///< nullptr: never skip
};

/// True when the step must be skipped (found_inf given and nonzero).
LTA_HOST_DEVICE inline bool skip_step(const float* found_inf) { return found_inf != nullptr && *found_inf != 0.0f; }

/// The fp32 coefficients of one Adam step, derived from AdamArgs and the current device scalars.
struct AdamCoefficients {
  float beta1;                  ///< AdamArgs::beta1 in fp32
  float one_minus_beta1;        ///< 1 - beta1, computed in double
  float beta2;                  ///< AdamArgs::beta2 in fp32
  float one_minus_beta2;        ///< 1 - beta2, computed in double
  float eps;                    ///< AdamArgs::eps in fp32
  float weight_decay;           ///< for the L2 term (Adam); 0 when decoupled
  float decay_factor;           ///< 1 - lr * wd for AdamW; 1 otherwise
  float step_size;              ///< lr / (1 - beta1^t)
  float sqrt_bias_correction2;  ///< sqrt(1 - beta2^t)
  float inv_scale;              ///< gradient multiplier: the value AdamArgs::inv_scale points to, 1 when null
};

/// The coefficients of one tensor's step: `step` points to that tensor's completed steps (read, not written).
/// Bias corrections are computed in double from the fp32 step count, like torch::optim does on the host.
LTA_HOST_DEVICE inline AdamCoefficients adam_coefficients(const AdamArgs& args, const float* step) {
  const double t = static_cast<double>(*step) + 1.0;
  const double lr = *args.lr;
  const double wd = args.weight_decay;
  AdamCoefficients c{};
  c.beta1 = static_cast<float>(args.beta1);
  c.one_minus_beta1 = static_cast<float>(1.0 - args.beta1);
  c.beta2 = static_cast<float>(args.beta2);
  c.one_minus_beta2 = static_cast<float>(1.0 - args.beta2);
  c.eps = static_cast<float>(args.eps);
  c.weight_decay = args.decoupled_weight_decay ? 0.0f : static_cast<float>(wd);
  c.decay_factor = args.decoupled_weight_decay ? static_cast<float>(1.0 - lr * wd) : 1.0f;
  c.step_size = static_cast<float>(lr / (1.0 - ::pow(args.beta1, t)));
  c.sqrt_bias_correction2 = static_cast<float>(::sqrt(1.0 - ::pow(args.beta2, t)));
  c.inv_scale = args.inv_scale != nullptr ? *args.inv_scale : 1.0f;
  return c;
}

/// One Adam/AdamW update of `param` (fp32 value, master or widened parameter) and its state. V is float on
/// the device and at::vec::Vectorized<float> on the CPU; Math supplies sqrt(V) and a NaN-propagating max(V, V)
/// (torch::max_out propagates NaN). `max_exp_avg_sq` is read and written only when kAmsgrad.
template <bool kAmsgrad, typename Math, typename V>
LTA_HOST_DEVICE inline void adam_update(const AdamCoefficients& c, V& param, V grad, V& exp_avg, V& exp_avg_sq,
                                        V& max_exp_avg_sq) {
  V g = grad * V(c.inv_scale);
  if (c.weight_decay != 0.0f) g = g + V(c.weight_decay) * param;
  if (c.decay_factor != 1.0f) param = param * V(c.decay_factor);
  exp_avg = exp_avg * V(c.beta1) + V(c.one_minus_beta1) * g;
  exp_avg_sq = exp_avg_sq * V(c.beta2) + V(c.one_minus_beta2) * g * g;
  V second_moment = exp_avg_sq;
  if constexpr (kAmsgrad) {
    max_exp_avg_sq = Math::max(max_exp_avg_sq, exp_avg_sq);
    second_moment = max_exp_avg_sq;
  }
  const V denom = Math::sqrt(second_moment) / V(c.sqrt_bias_correction2) + V(c.eps);
  param = param - V(c.step_size) * (exp_avg / denom);
}

/// The fp32 coefficients of one SGD step.
struct SgdCoefficients {
  float momentum;             ///< SgdArgs::momentum in fp32
  float one_minus_dampening;  ///< 1 - dampening, computed in double
  float weight_decay;         ///< SgdArgs::weight_decay in fp32
  float lr;                   ///< learning rate, read from SgdArgs::lr
  float inv_scale;            ///< gradient multiplier: the value SgdArgs::inv_scale points to, 1 when null
  bool nesterov;              ///< SgdArgs::nesterov
  bool first_step;  ///< the tensor's step == 0: its momentum buffer starts as the gradient, like torch's clone(d_p)
};

/// The coefficients of one tensor's step: `step` points to that tensor's completed steps, nullptr without
/// momentum (no buffer, so no first step to tell apart).
LTA_HOST_DEVICE inline SgdCoefficients sgd_coefficients(const SgdArgs& args, const float* step) {
  SgdCoefficients c{};
  c.momentum = static_cast<float>(args.momentum);
  c.one_minus_dampening = static_cast<float>(1.0 - args.dampening);
  c.weight_decay = static_cast<float>(args.weight_decay);
  c.lr = *args.lr;
  c.inv_scale = args.inv_scale != nullptr ? *args.inv_scale : 1.0f;
  c.nesterov = args.nesterov;
  c.first_step = step != nullptr && *step == 0.0f;
  return c;
}

/// One SGD update of `param` (fp32 value) and, when kMomentum, of its momentum buffer. V as in adam_update.
template <bool kMomentum, typename V>
LTA_HOST_DEVICE inline void sgd_update(const SgdCoefficients& c, V& param, V grad, V& momentum_buffer) {
  V g = grad * V(c.inv_scale);
  if (c.weight_decay != 0.0f) g = g + V(c.weight_decay) * param;
  if constexpr (kMomentum) {
    momentum_buffer = c.first_step ? g : momentum_buffer * V(c.momentum) + V(c.one_minus_dampening) * g;
    g = c.nesterov ? g + V(c.momentum) * momentum_buffer : momentum_buffer;
  }
  param = param - V(c.lr) * g;
}

/// Advances the step count after an update unless the step was skipped.
LTA_HOST_DEVICE inline void advance_step(float* step, const float* found_inf) {
  if (!skip_step(found_inf)) *step += 1.0f;
}

}  // namespace kernels
