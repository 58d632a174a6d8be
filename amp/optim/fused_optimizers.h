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
  at::Tensor lr;                                                 // 1-element fp32 on the parameters' device
  double lr_written = std::numeric_limits<double>::quiet_NaN();  // the host lr last written to `lr` (NaN: unknown)
  std::vector<at::Tensor> step;  // per parameter: 1-element fp32 completed steps; undefined before its first gradient
};
}  // namespace detail

/// Options of FusedAdam / FusedAdamW (torch::optim::AdamOptions' names and meaning).
struct FusedAdamOptions : public torch::optim::OptimizerCloneableOptions<FusedAdamOptions> {
  explicit FusedAdamOptions(double lr = 1e-3) : lr_(lr) {}
  TORCH_ARG(double, lr) = 1e-3;
  typedef std::tuple<double, double> betas_t;
  TORCH_ARG(betas_t, betas) = std::make_tuple(0.9, 0.999);
  TORCH_ARG(double, eps) = 1e-8;
  TORCH_ARG(double, weight_decay) = 0;
  TORCH_ARG(bool, amsgrad) = false;
  /// true: AdamW's decoupled weight decay (p *= 1 - lr * weight_decay); false: Adam's L2 penalty
  /// (grad += weight_decay * p). Default false, as torch.optim.Adam's argument of that name; FusedAdamW always
  /// sets it to true.
  TORCH_ARG(bool, decoupled_weight_decay) = false;

 public:
  double get_lr() const override { return lr(); }
  void set_lr(const double lr) override { this->lr(lr); }
};

/// Options of FusedSGD (torch::optim::SGDOptions' names and meaning).
struct FusedSgdOptions : public torch::optim::OptimizerCloneableOptions<FusedSgdOptions> {
  explicit FusedSgdOptions(double lr) : lr_(lr) {}
  TORCH_ARG(double, lr);
  TORCH_ARG(double, momentum) = 0;
  TORCH_ARG(double, dampening) = 0;
  TORCH_ARG(double, weight_decay) = 0;
  TORCH_ARG(bool, nesterov) = false;

 public:
  double get_lr() const override { return lr(); }
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
  FusedAdam(const std::vector<torch::optim::OptimizerParamGroup>& groups, FusedAdamOptions defaults);
  explicit FusedAdam(std::vector<at::Tensor> params, FusedAdamOptions defaults = FusedAdamOptions());
  at::Tensor step(LossClosure closure = nullptr) override;
  void fused_step(at::TensorList model_params, const at::Tensor& found_inf) override;
  void sync_lr() override;
  std::vector<at::Tensor> state_tensors() const override;
  std::vector<std::string> state_fields() const override;
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;

 protected:
  struct GroupState : detail::StepState {
    std::vector<at::Tensor> exp_avg, exp_avg_sq, max_exp_avg_sq;  // per parameter, fp32, created at first gradient
  };
  void run(at::TensorList model_params, const at::Tensor& found_inf);
  std::vector<GroupState> groups_state_;
};

/// torch.optim.AdamW: FusedAdam with decoupled weight decay, whatever options.decoupled_weight_decay() says.
/// Without options the weight decay is 1e-2 as torch::optim::AdamW's; options passed in keep their own
/// weight_decay (FusedAdamOptions' default is 0), so set it explicitly to get AdamW's usual 1e-2.
class FusedAdamW : public FusedAdam {
 public:
  explicit FusedAdamW(std::vector<at::Tensor> params, FusedAdamOptions defaults = FusedAdamOptions().weight_decay(1e-2))
      : FusedAdam(std::move(params), defaults.decoupled_weight_decay(true)) {}
};

/// torch.optim.SGD (momentum, dampening, Nesterov, L2 weight decay) as one fused pass; see FusedAdam for the
/// per-parameter state. Plain SGD (momentum 0) keeps no state.
class FusedSGD : public torch::optim::Optimizer, public FusedOptimizer {
 public:
  FusedSGD(std::vector<at::Tensor> params, FusedSgdOptions defaults);
  at::Tensor step(LossClosure closure = nullptr) override;
  void fused_step(at::TensorList model_params, const at::Tensor& found_inf) override;
  void sync_lr() override;
  std::vector<at::Tensor> state_tensors() const override;
  std::vector<std::string> state_fields() const override;
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;

 private:
  struct GroupState : detail::StepState {
    std::vector<at::Tensor> momentum;  // per parameter, fp32, created at first gradient
  };
  void run(at::TensorList model_params, const at::Tensor& found_inf);
  std::vector<GroupState> groups_state_;
};

}  // namespace amp
