#pragma once

// The state amp::initialize creates and that amp::Model, amp::Optimizer and amp::ScaledLoss share.
// Internal: users go through amp/amp.h.

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <amp/loss_scaler.h>
#include <amp/options.h>
#include <amp/state/forward_policy.h>
#include <amp/state/gradient_owner.h>
#include <amp/state/loss_scopes.h>
#include <amp/state/param_slots.h>
#include <amp/step_outcome.h>
#include <amp/zero/zero.h>

namespace ddp {
class DistributedDataParallel;
class FullyShardedDataParallel;
struct ReducedBucket;
}  // namespace ddp

namespace amp {

class FusedOptimizer;

namespace detail {

class ZeroShard;
class Fp8State;

/// Where overflow report lines go unless set_overflow_logger says otherwise: stderr.
void default_overflow_logger(const std::string& line);

/// The step in progress: what the scale_loss scopes since the last step() found, and the steps so far.
struct StepProgress {
  explicit StepProgress(const c10::Device& device);
  /// A scope unscaled its gradients with `scaler`: the step takes its overflow flag.
  void add_loss(const LossScaler& scaler);
  at::Tensor found_inf;                  ///< 1-element fp32 on the device: the sum of the step's losses' flags
  bool unscaled = false;                 ///< a scope unscaled gradients since the last step()
  int64_t steps = 0;                     ///< step() calls so far
  std::unique_ptr<StepOutcome> outcome;  ///< whether the last step() skipped
};

/// Note [State's parts]
/// State is a composition; each part has one job and a narrow interface:
/// - ParamSlots (param_slots.h): the parameters the optimizer updates and their fp32 masters;
/// - LossScopes (loss_scopes.h): the loss scalers and the scale_loss protocol's bookkeeping;
/// - StepProgress (above): the step's overflow flag, step count and outcome;
/// - a GradientOwner (gradient_owner.h, Note [gradient owner]): where gradients live between backward and step;
///   ReplicatedGradients by default, ZeroShard after attach() with a ZeroStage;
/// - Fp8State (amp/fp8/) when the options ask for FP8, ForwardPolicy for the forward pass.
/// State itself only sequences them: begin_loss / end_loss, step, attach, checkpoints. docs/design.md follows a
/// gradient through them.
class State : public std::enable_shared_from_this<State> {
 public:
  State(torch::nn::Module& module, torch::optim::Optimizer& optimizer, const Options& options);
  /// Over a fully sharded model (amp/fsdp/, docs/fsdp.md): the optimizer's parameters are `fsdp`'s fp32 shards, which
  /// are the master weights; the owner is a ShardedGradients. Refuses, in one line, what full sharding cannot take.
  State(ddp::FullyShardedDataParallel& fsdp, torch::optim::Optimizer& optimizer, const Options& options);
  ~State();
  State(const State&) = delete;
  State& operator=(const State&) = delete;

  const Options& options() const { return options_; }
  const Options::Resolved& policy() const { return policy_; }
  const ForwardPolicy& forward_policy() const { return forward_; }
  /// Completes whatever the last step() left in flight into the model parameters (a ZeRO parameter all-gather under
  /// ZeroPublish::kAtNextForward, Note [deferred publish]): amp::Model's forward() and call() run it first, and
  /// Optimizer::wait_for_parameters(). One virtual call when nothing is pending.
  void wait_for_parameters() { owner_->wait_for_parameters(); }
  const c10::Device& device() const { return slots_.device(); }
  torch::optim::Optimizer& optimizer() { return *optimizer_; }
  torch::nn::Module& module() { return *module_; }
  LossScaler& scaler(int64_t loss_id) { return losses_.scaler(loss_id); }
  const ParamSlots& slots() const { return slots_; }

  // The scale_loss protocol (see ScaledLoss).
  at::Tensor begin_loss(const at::Tensor& loss, int64_t loss_id, bool delay_unscale);
  void end_loss(int64_t loss_id, bool delay_unscale);
  /// A scale_loss scope left by an exception: no loss is active any more (nothing is unscaled).
  void abandon_loss() { losses_.abandon(); }

  // Data parallel training (see amp::Optimizer::attach).
  void attach(ddp::DistributedDataParallel& ddp, ZeroStage stage = ZeroStage::kNone,
              ZeroPublish publish = ZeroPublish::kInStep);
  /// The ZeRO shard (docs/zero.md) when attach() was given a stage, else null: for what only a sharded owner does
  /// (sharded checkpoints).
  ZeroShard* zero() const { return zero_; }
  /// The owner, when its optimizer state is split among the ranks (ZeRO, full sharding), else null: what the
  /// consolidated checkpoints gather and split.
  ShardedOwner* sharded_owner() const { return sharded_owner_; }
  /// The FullyShardedDataParallel this state was initialized over, else null.
  ddp::FullyShardedDataParallel* fully_sharded() const { return fsdp_; }
  /// The FP8 state (docs/fp8.md) when the options ask for FP8, else null.
  Fp8State* fp8() const { return fp8_.get(); }
  /// What the optimizer side holds on this rank (see HeldBytes).
  HeldBytes held_bytes() const { return owner_->held_bytes(); }
  /// Unscales and checks one reduced bucket into the optimizer's gradients; false when no loss that unscales is
  /// being backpropagated (DDP then writes the average back as usual).
  bool consume_bucket(const ddp::ReducedBucket& bucket) { return owner_->consume_bucket(bucket, losses_.unscaling()); }

  // The step protocol (see amp::Optimizer).
  at::Tensor step(const torch::optim::Optimizer::LossClosure& closure = nullptr);
  void zero_grad();
  /// Gradients the optimizer will read (master grads where masters exist), for clipping.
  std::vector<at::Tensor> optimizer_grads() const { return owner_->grads(); }
  /// amp::clip_grad_norm_: over every rank's gradients when they are sharded.
  at::Tensor clip_grad_norm_(double max_norm) { return owner_->clip_grad_norm_(max_norm, progress_.found_inf); }
  const at::Tensor& step_found_inf() const { return progress_.found_inf; }
  StepOutcome& step_outcome() { return *progress_.outcome; }

  /// Name of the parameter at slot `index` (what scalers record as the first non-finite index), or "<none>".
  std::string param_name(int64_t index) const { return slots_.name(index); }
  void set_overflow_logger(std::function<void(const std::string&)> logger) { logger_ = std::move(logger); }

  void save(torch::serialize::OutputArchive& archive) const;
  void load(torch::serialize::InputArchive& archive);
  /// Writes the model's state with fp32 values (masters where they exist), like Apex's model.state_dict(). Fully
  /// sharded: the full values gathered from every rank's shards (collective; every rank gets the same archive).
  void save_model(torch::serialize::OutputArchive& archive) const;
  /// Reads a model state saved by save_model (or any fp32 state with the same names and shapes) into masters
  /// and model tensors. Checks everything before changing anything. Fully sharded: each rank keeps its slices.
  void load_model(torch::serialize::InputArchive& archive);
  /// The checked (destination, value) copies load_model would make, without making them.
  std::vector<std::pair<at::Tensor, at::Tensor>> prepare_model_load(torch::serialize::InputArchive& archive);
  /// Checks that load() would succeed, without changing anything.
  void validate_amp_state(torch::serialize::InputArchive& archive);

 private:
  Options options_;
  Options::Resolved policy_;
  ForwardPolicy forward_;
  torch::nn::Module* module_;
  torch::optim::Optimizer* optimizer_;
  FusedOptimizer* fused_;  ///< the optimizer, when it is one of amp's fused optimizers
  ParamSlots slots_;
  LossScopes losses_;
  StepProgress progress_;
  std::unique_ptr<GradientOwner> owner_;
  ZeroShard* zero_ = nullptr;                      ///< owner_, when it is a ZeroShard
  ddp::FullyShardedDataParallel* fsdp_ = nullptr;  ///< the fully sharded model (owner_ is then a ShardedGradients)
  ShardedOwner* sharded_owner_ = nullptr;          ///< owner_, when it is a ZeroShard or a ShardedGradients
  std::unique_ptr<Fp8State> fp8_;                  ///< Options::fp8
  std::function<void(const std::string&)> logger_;

  void register_optimizer();  ///< Note [one amp state per optimizer]
  /// save_model / prepare_model_load of a fully sharded model (amp/fsdp/state_fully_sharded.cpp); the save is
  /// collective.
  void save_fully_sharded_model(torch::serialize::OutputArchive& archive) const;
  std::vector<std::pair<at::Tensor, at::Tensor>> prepare_fully_sharded_model_load(
      torch::serialize::InputArchive& archive);
  void set_forward_policy();
};

}  // namespace detail
}  // namespace amp
