#pragma once

// The state amp::initialize creates and that amp::Model, amp::Optimizer and amp::ScaledLoss share.
// Internal: users go through amp/amp.h.

#include <functional>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <amp/state/forward_policy.h>
#include <amp/loss_scaler.h>
#include <amp/options.h>
#include <amp/step_outcome.h>
#include <amp/zero/zero.h>

namespace ddp {
class DistributedDataParallel;
struct ReducedBucket;
}  // namespace ddp

namespace amp {

class FusedOptimizer;

namespace detail {

class ZeroShard;
class Fp8State;

/// Steps between two overflow log lines (the first overflow is always logged): a line per step would drown
/// a log whenever the scale is settling.
inline constexpr int64_t kOverflowLogIntervalSteps = 100;

/// One parameter the optimizer updates: the model's tensor (where autograd writes the gradient) and the
/// tensor the optimizer holds (its fp32 master, or the model tensor itself when it needs no master).
struct ParamSlot {
  std::string name;
  at::Tensor model;
  at::Tensor master;
  bool has_master = false;
};

class State : public std::enable_shared_from_this<State> {
 public:
  State(torch::nn::Module& module, torch::optim::Optimizer& optimizer, const Options& options);
  ~State();
  State(const State&) = delete;
  State& operator=(const State&) = delete;

  const Options& options() const { return options_; }
  const Options::Resolved& policy() const { return policy_; }
  const ForwardPolicy& forward_policy() const { return forward_; }
  /// amp::Model's forward() and call() run this first: completes a parameter all-gather the last step() left in
  /// flight (ZeroPublish::kAtNextForward). Without ZeRO it is one pointer test.
  void before_forward() {
    if (zero_ != nullptr) wait_for_parameters();
  }
  /// Completes a pending ZeRO parameter all-gather into the model parameters (Note [deferred publish]); nothing to do
  /// when none is pending.
  void wait_for_parameters();
  const c10::Device& device() const { return device_; }
  torch::optim::Optimizer& optimizer() { return *optimizer_; }
  torch::nn::Module& module() { return *module_; }
  LossScaler& scaler(int64_t loss_id);
  const std::vector<ParamSlot>& slots() const { return slots_; }

  // The scale_loss protocol (see ScaledLoss).
  at::Tensor begin_loss(const at::Tensor& loss, int64_t loss_id, bool delay_unscale);
  void end_loss(int64_t loss_id, bool delay_unscale);
  /// A scale_loss scope left by an exception: no loss is active any more (nothing is unscaled).
  void abandon_loss() { active_loss_id_ = -1; }

  // Data parallel training (see amp::Optimizer::attach).
  void attach(ddp::DistributedDataParallel& ddp, ZeroStage stage = ZeroStage::kNone,
              ZeroPublish publish = ZeroPublish::kInStep);
  /// The ZeRO shard (docs/zero.md) when attach() was given a stage, else null.
  ZeroShard* zero() const { return zero_.get(); }
  /// The FP8 state (docs/fp8.md) when the options ask for FP8, else null.
  Fp8State* fp8() const { return fp8_.get(); }
  /// What the optimizer side holds on this rank (see HeldBytes).
  HeldBytes held_bytes() const;
  /// Unscales and checks one reduced bucket into the optimizer's gradients; false when no loss that unscales is
  /// being backpropagated (DDP then writes the average back as usual).
  bool consume_bucket(const ddp::ReducedBucket& bucket);

  // The step protocol (see amp::Optimizer).
  at::Tensor step(const torch::optim::Optimizer::LossClosure& closure = nullptr);
  void zero_grad();
  /// Gradients the optimizer will read (master grads where masters exist), for clipping.
  std::vector<at::Tensor> optimizer_grads() const;
  const at::Tensor& step_found_inf() const { return step_found_inf_; }
  StepOutcome& step_outcome() { return *outcome_; }

  /// Name of the parameter at slot `index` (what scalers record as the first non-finite index), or "<none>".
  std::string param_name(int64_t index) const;
  void set_overflow_logger(std::function<void(const std::string&)> logger) { logger_ = std::move(logger); }

  void save(torch::serialize::OutputArchive& archive) const;
  void load(torch::serialize::InputArchive& archive);
  /// Writes the model's state with fp32 values (masters where they exist), like Apex's model.state_dict().
  void save_model(torch::serialize::OutputArchive& archive) const;
  /// Reads a model state saved by save_model (or any fp32 state with the same names and shapes) into masters
  /// and model tensors. Checks everything before changing anything.
  void load_model(torch::serialize::InputArchive& archive);
  /// The checked (destination, value) copies load_model would make, without making them.
  std::vector<std::pair<at::Tensor, at::Tensor>> prepare_model_load(torch::serialize::InputArchive& archive);
  /// Checks that load() would succeed, without changing anything.
  void validate_amp_state(torch::serialize::InputArchive& archive);

 private:
  friend class ZeroShard;
  void create_master_weights(const std::vector<at::Tensor>& fp32_values);
  void check_diagnostics();

  Options options_;
  Options::Resolved policy_;
  ForwardPolicy forward_;
  c10::Device device_;
  torch::nn::Module* module_;
  torch::optim::Optimizer* optimizer_;
  FusedOptimizer* fused_;  // the optimizer, when it is one of amp's fused optimizers
  std::vector<std::unique_ptr<LossScaler>> scalers_;
  std::vector<ParamSlot> slots_;
  std::vector<at::Tensor> stash_;  // unscaled grads of direct (masterless) params, kept across losses
  at::Tensor step_found_inf_;
  std::unique_ptr<StepOutcome> outcome_;  // whether the last step() skipped
  bool grads_scaled_ = false;             // a delay_unscale backward left scaled gradients behind
  int64_t scaled_loss_id_ = -1;           // the loss whose scale those gradients carry
  bool unscaled_this_step_ = false;
  int64_t active_loss_id_ = -1;        // the loss of the scale_loss scope being backpropagated, -1 outside one
  bool active_delay_unscale_ = false;  // that scope's delay_unscale
  struct ConsumedGrad {  // a masterless gradient consume_bucket unscaled in place during this loss's backward
    const c10::TensorImpl* grad = nullptr;
    int64_t version = 0;
  };
  std::vector<ConsumedGrad> consumed_direct_;                    // per slot
  std::unordered_map<const c10::TensorImpl*, int64_t> slot_of_;  // model tensor -> slot, for consume_bucket
  at::Tensor bucket_scale_;  // consume_bucket's average * inv_scale (1-element fp32 on the device)
  int64_t steps_ = 0;
  std::vector<int64_t> last_logged_step_;
  std::vector<int64_t> overflows_since_log_;
  std::function<void(const std::string&)> logger_;
  std::unique_ptr<ZeroShard> zero_;  // attach() with a ZeRO stage
  std::unique_ptr<Fp8State> fp8_;    // Options::fp8
};

}  // namespace detail
}  // namespace amp
