#pragma once

#include <limits>
#include <memory>
#include <tuple>
#include <vector>

#include <torch/arg.h>
#include <torch/optim/optimizer.h>

#include <amp/optim/fused_optimizer.h>

namespace amp {

namespace detail {
/// The device-resident learning rate of a group and the per-parameter step counts, shared by the fused optimizers.
struct StepState {
  at::Tensor lr;                                                 ///< 1-element fp32 on the parameters' device
  double lr_written = std::numeric_limits<double>::quiet_NaN();  ///< the host lr last written to `lr` (NaN: unknown)
  std::vector<at::Tensor> step;  ///< per parameter: 1-element fp32 completed steps; undefined before its first gradient
};
}  // namespace detail

/// Options of FusedAdam / FusedAdamW (torch::optim::AdamOptions' names and meaning).
struct FusedAdamOptions : public torch::optim::OptimizerCloneableOptions<FusedAdamOptions> {
  /// Options with learning rate `lr` and every other setting at its default.
  explicit FusedAdamOptions(double lr = 1e-3) : lr_(lr) {}
  /// The learning rate, >= 0 (checked for the defaults at construction). Default 1e-3.
  TORCH_ARG(double, lr) = 1e-3;
  /// (beta1, beta2): the decay rates of the first and second moment.
  typedef std::tuple<double, double> betas_t;
  /// Decay rates of the first and second moment, each in [0, 1). Default (0.9, 0.999).
  TORCH_ARG(betas_t, betas) = std::make_tuple(0.9, 0.999);
  /// Added to the denominator for numerical stability; finite and > 0. Default 1e-8.
  TORCH_ARG(double, eps) = 1e-8;
  /// Weight decay, finite and >= 0; decoupled_weight_decay() says how it applies. Default 0.
  TORCH_ARG(double, weight_decay) = 0;
  /// Normalise by the running maximum of the second moment (AMSGrad; adds max_exp_avg_sq to each parameter's
  /// state). Default false.
  TORCH_ARG(bool, amsgrad) = false;
  /// true: AdamW's decoupled weight decay (p *= 1 - lr * weight_decay); false: Adam's L2 penalty
  /// (grad += weight_decay * p). Default false, as torch.optim.Adam's argument of that name; FusedAdamW always
  /// sets it to true.
  TORCH_ARG(bool, decoupled_weight_decay) = false;

 public:
  /// lr(), for torch::optim's learning-rate schedulers.
  double get_lr() const override { return lr(); }
  /// Sets lr(), for torch::optim's learning-rate schedulers. The device copy follows at the group's next step,
  /// or at sync_lr().
  void set_lr(const double lr) override { this->lr(lr); }
};

/// Options of FusedSGD (torch::optim::SGDOptions' names and meaning).
struct FusedSgdOptions : public torch::optim::OptimizerCloneableOptions<FusedSgdOptions> {
  /// Options with learning rate `lr` (required, as for torch::optim::SGDOptions) and every other setting at its
  /// default.
  explicit FusedSgdOptions(double lr) : lr_(lr) {}
  /// The learning rate, >= 0 (checked for the defaults at construction). No default.
  TORCH_ARG(double, lr);
  /// Momentum factor, finite and >= 0; 0 is plain SGD, which keeps no state. Default 0.
  TORCH_ARG(double, momentum) = 0;
  /// Dampening of the gradient added to the momentum buffer (buf = momentum * buf + (1 - dampening) * grad);
  /// finite. Not applied at a parameter's first step. Default 0.
  TORCH_ARG(double, dampening) = 0;
  /// L2 penalty (grad += weight_decay * p), finite and >= 0. Default 0.
  TORCH_ARG(double, weight_decay) = 0;
  /// Nesterov momentum; needs momentum > 0 and dampening == 0. Default false.
  TORCH_ARG(bool, nesterov) = false;

 public:
  /// lr(), for torch::optim's learning-rate schedulers.
  double get_lr() const override { return lr(); }
  /// Sets lr(), for torch::optim's learning-rate schedulers. The device copy follows at the group's next step,
  /// or at sync_lr().
  void set_lr(const double lr) override { this->lr(lr); }
};

/// Adam / AdamW / SGD whose whole step is one fused multi-tensor pass per dtype group
/// (kernels/optim/fused_optimizers.h), usable like any torch::optim optimizer. Under amp::initialize they skip an
/// overflowing step on the device (no host sync) and, with master weights, write the half model parameters in the same
/// pass. The step counts and the learning rate live on the device; step() writes the device lr only when the group's
/// host lr changed.
///
/// State is kept per parameter with torch.optim's semantics: a parameter with no gradient (grad undefined, as
/// zero_grad() leaves it) is not stepped and its state is neither created nor advanced. Its state is created at
/// its first gradient: Adam's exp_avg / exp_avg_sq (/ max_exp_avg_sq) as zeros and its own `step` count, so its
/// bias corrections count its own steps; SGD with momentum its momentum buffer, which its first step sets to
/// the gradient (no dampening), and its step count. A skipped step (overflow) advances nothing.
///
/// save / load write and read that state per parameter (`group<g>.<field>.<i>`, fp32, on the CPU); a parameter
/// without state yet has no entries and loads as without state. Checkpoints of the earlier per-group step
/// format (`group<g>.step`) are refused with an error saying so.
///
/// FusedAdam is torch.optim.Adam: L2 weight decay unless options.decoupled_weight_decay(true).
///
/// CUDA graphs (Note [capture-safe step] in kernels/capture.h): a whole amp step (scale_loss scope end,
/// amp::clip_grad_norm_, this optimizer's step, the scale update) is meant to be capturable. UNTESTED on a GPU:
/// the test that captures an O2 step with FusedAdamW and compares 20 replays with eager steps
/// (AmpCudaGraphTest.CapturedO2StepMatchesEagerBitForBit) has not run on one yet. Rules: run at least one step
/// outside the capture first (state tensors are created there; a parameter whose first gradient comes after the
/// capture has no state in the graph: capture again once every parameter has had a gradient); a learning rate changed
/// by a scheduler reaches a captured graph only through sync_lr(), called outside the capture before replay (a step()
/// captured with an lr that was not synced is refused); load() replaces the state tensors a graph refers to, so capture
/// again after a load.
class FusedAdam : public torch::optim::Optimizer, public FusedOptimizer {
 public:
  /// Over `groups`, each of which may override `defaults`. Throws c10::Error if the defaults' lr is negative or
  /// their betas, eps or weight_decay are out of range; a group's own options are checked when it steps.
  FusedAdam(const std::vector<torch::optim::OptimizerParamGroup>& groups, FusedAdamOptions defaults);
  /// Over one param group holding `params`; `defaults` are checked as by the constructor above.
  explicit FusedAdam(std::vector<at::Tensor> params, FusedAdamOptions defaults = FusedAdamOptions());
  /// Runs `closure` (if given) with grad mode on, then steps every parameter that has a gradient, with no
  /// overflow check (under amp::initialize, amp::Optimizer::step() calls fused_step() instead). Writes a group's
  /// device lr first if its host lr changed. Returns the closure's loss, or an undefined tensor without one.
  /// No host sync.
  at::Tensor step(LossClosure closure = nullptr) override;
  void fused_step(at::TensorList model_params, const at::Tensor& found_inf) override;
  void sync_lr() override;
  std::vector<at::Tensor> state_tensors() const override;
  std::vector<std::string> state_fields() const override;
  /// Writes the per-parameter state, fp32 on the CPU. Entries are named `group<g>.<field>.<i>` for the fields
  /// step, exp_avg, exp_avg_sq and max_exp_avg_sq (amsgrad); a parameter without state writes none. Unlike
  /// torch::optim::Adam it saves no param-group options (lr, betas, ...). Host syncs: copies the state to the CPU.
  void save(torch::serialize::OutputArchive& archive) const override;
  /// Replaces the per-parameter state with the archive's (save()'s format), on the parameters' devices. A missing
  /// entry leaves its parameter without state. Throws c10::Error, leaving the state unchanged, on an entry whose
  /// size is not its parameter's, a step count that is not a whole number >= 0, a moment without a step count or
  /// a step count without both moments, and on the older per-group step format. Param-group options are not
  /// read. Host syncs: reads each step count.
  void load(torch::serialize::InputArchive& archive) override;

 protected:
  /// One param group's state: its device lr and per-parameter step counts, and Adam's moments.
  struct GroupState : detail::StepState {
    /// Per parameter: the first moment, fp32, shaped like the parameter; undefined before its first gradient.
    std::vector<at::Tensor> exp_avg, exp_avg_sq, max_exp_avg_sq;  ///< per parameter (amsgrad): max of exp_avg_sq
    /// \var amp::FusedAdam::GroupState::exp_avg_sq
    /// Per parameter: the second moment, fp32, shaped like the parameter; undefined before its first gradient.
  };
  /// The step behind step() (empty model_params, undefined found_inf) and fused_step(): for each group, refreshes
  /// the device lr, creates the state of parameters at their first gradient, and launches the fused kernel.
  void run(at::TensorList model_params, const at::Tensor& found_inf);
  std::vector<GroupState> groups_state_;  ///< one per param group, in order; resized by each step and by load()
};

/// torch.optim.AdamW: FusedAdam with decoupled weight decay, whatever options.decoupled_weight_decay() says.
/// Without options the weight decay is 1e-2 as torch::optim::AdamW's; options passed in keep their own
/// weight_decay (FusedAdamOptions' default is 0), so set it explicitly to get AdamW's usual 1e-2.
class FusedAdamW : public FusedAdam {
 public:
  /// Over one param group holding `params`, with `defaults`' decoupled_weight_decay forced to true.
  explicit FusedAdamW(std::vector<at::Tensor> params, FusedAdamOptions defaults = FusedAdamOptions().weight_decay(1e-2))
      : FusedAdam(std::move(params), defaults.decoupled_weight_decay(true)) {}
};

/// torch.optim.SGD (momentum, dampening, Nesterov, L2 weight decay) as one fused pass; see FusedAdam for the
/// per-parameter state. Plain SGD (momentum 0) keeps no state.
class FusedSGD : public torch::optim::Optimizer, public FusedOptimizer {
 public:
  /// Over one param group holding `params`. Throws c10::Error if lr is negative, momentum or weight_decay is
  /// negative or not finite, dampening is not finite, or nesterov is set without momentum > 0 and dampening 0.
  FusedSGD(std::vector<at::Tensor> params, FusedSgdOptions defaults);
  /// Runs `closure` (if given) with grad mode on, then steps every parameter that has a gradient, with no
  /// overflow check (under amp::initialize, amp::Optimizer::step() calls fused_step() instead). Writes the
  /// device lr first if the host lr changed. Returns the closure's loss, or an undefined tensor without one.
  /// No host sync.
  at::Tensor step(LossClosure closure = nullptr) override;
  void fused_step(at::TensorList model_params, const at::Tensor& found_inf) override;
  void sync_lr() override;
  std::vector<at::Tensor> state_tensors() const override;
  std::vector<std::string> state_fields() const override;
  /// Writes the per-parameter state, fp32 on the CPU. Entries are named `group<g>.<field>.<i>` for the fields
  /// step and momentum; a parameter without state (any, with momentum 0) writes none. Unlike torch::optim::SGD it
  /// saves no param-group options (lr, momentum, ...). Host syncs: copies the state to the CPU.
  void save(torch::serialize::OutputArchive& archive) const override;
  /// Replaces the per-parameter state with the archive's (save()'s format), on the parameters' devices. A missing
  /// entry leaves its parameter without state. Throws c10::Error, leaving the state unchanged, on an entry whose
  /// size is not its parameter's, a step count that is not a whole number >= 0, a momentum buffer without a step
  /// count or the reverse, and on the older per-group step format. Param-group options are not read. Host
  /// syncs: reads each step count.
  void load(torch::serialize::InputArchive& archive) override;

 private:
  struct GroupState : detail::StepState {
    std::vector<at::Tensor> momentum;  ///< per parameter, fp32, created at first gradient
  };
  void run(at::TensorList model_params, const at::Tensor& found_inf);
  std::vector<GroupState> groups_state_;
};

}  // namespace amp
