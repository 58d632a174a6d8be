#pragma once

// amp::initialize, amp::scale_loss and friends: Apex's mixed-precision recipe for LibTorch.
//
//   auto [model, optimizer] = amp::initialize(net, sgd, amp::Options().opt_level(amp::OptLevel::O2));
//   for (...) {
//     optimizer.zero_grad();
//     auto loss = criterion(model(x), y);
//     {
//       auto scaled = amp::scale_loss(loss, optimizer);
//       scaled.backward();
//     }                      // gradients unscaled and checked, loss scale updated
//     optimizer.step();      // skipped when a gradient overflowed
//   }
//
// See docs/opt_levels.md for what each level does and docs/checkpointing.md for saving and resuming.

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <amp/nn/float8_linear.h>
#include <amp/options.h>
#include <amp/state/state.h>
#include <ddp/distributed_data_parallel.h>
#include <ddp/fsdp/fully_sharded.h>

namespace amp {

/// The model amp::initialize returns: calls the wrapped module's forward under the opt level's policy (O1:
/// autocast; O2/O3: floating tensor arguments cast to half) and returns a floating tensor result as fp32 (other
/// result types unchanged, see ForwardPolicy::output). `->` reaches the module.
template <typename ModuleHolder>
class Model {
 public:
  /// Made by amp::initialize: `module` is the prepared module holder (cast under O2/O3), `state` the amp state it
  /// shares with the returned Optimizer. Checks nothing itself (initialize did).
  Model(ModuleHolder module, std::shared_ptr<detail::State> state)
      : module_(std::move(module)), state_(std::move(state)) {}

  /// Under ZeroPublish::kAtNextForward, forward() and call() first complete the all-gather the last step() left in
  /// flight (Optimizer::wait_for_parameters).
  template <typename... Args>
  auto forward(Args&&... args) {
    state_->wait_for_parameters();
    return state_->forward_policy().run(
        [this](auto&&... a) { return module_->forward(std::forward<decltype(a)>(a)...); }, std::forward<Args>(args)...);
  }
  /// Same as forward(args...).
  template <typename... Args>
  auto operator()(Args&&... args) {
    return forward(std::forward<Args>(args)...);
  }
  /// Runs `f(args...)` under this model's policy instead of the module's own forward: the way to combine amp
  /// with a wrapper applied after initialize, e.g. data parallel training:
  ///   ddp::DistributedDataParallel ddp(net, group);
  ///   auto out = model.call([&](const at::Tensor& in) { return ddp.forward(in); }, x);
  template <typename F, typename... Args>
  auto call(F&& f, Args&&... args) {
    state_->wait_for_parameters();
    return state_->forward_policy().run(std::forward<F>(f), std::forward<Args>(args)...);
  }
  /// The wrapped module, for its members (parameters, submodules). A forward called through it bypasses amp's
  /// policy (no autocast, no input or output casts) and, under ZeroPublish::kAtNextForward, the parameter wait.
  auto operator->() { return module_.operator->(); }
  /// The wrapped module holder: the one passed to amp::initialize, cast in place under O2/O3.
  ModuleHolder& module() { return module_; }

  /// Saves the model's parameters and buffers with fp32 values (the masters where they exist).
  void save(torch::serialize::OutputArchive& archive) const { state_->save_model(archive); }
  /// Loads what save() wrote (into masters and model tensors); checks names and shapes before changing anything.
  void load(torch::serialize::InputArchive& archive) { state_->load_model(archive); }

 private:
  ModuleHolder module_;
  std::shared_ptr<detail::State> state_;
};

/// The optimizer amp::initialize returns: steps the user's optimizer unless this step's gradients overflowed.
/// With one of amp's fused optimizers the decision is made on the device (no host sync); with a plain
/// torch::optim optimizer step() reads one flag on the host, the same price torch.amp pays.
class Optimizer {
 public:
  /// Made by amp::initialize: `state` is the amp state it shares with the returned Model.
  explicit Optimizer(std::shared_ptr<detail::State> state) : state_(std::move(state)) {}

  /// Steps (or skips), refreshes half model parameters from their fp32 masters, and checks the lazily read
  /// diagnostics: rate-limited overflow log lines, and an error naming the parameter when the scale has sat at
  /// its floor while overflowing for max_overflows_at_floor steps.
  ///
  /// `closure` (optional, as torch.optim's): called once before the step, with gradients enabled; it may run the
  /// forward pass and the scale_loss scope. Returns the closure's result (the loss), whether or not the step was
  /// skipped, and an undefined tensor without a closure. The inner optimizer's own return value is not passed on
  /// (the fused optimizers have none). Whether the step was skipped: last_step_skipped() / last_step().
  at::Tensor step(torch::optim::Optimizer::LossClosure closure = nullptr) { return state_->step(closure); }
  /// Clears model and master gradients (set to undefined, as set_to_none=True).
  void zero_grad() { state_->zero_grad(); }
  /// Data parallel training: `ddp` (which must wrap the module amp::initialize prepared) hands each bucket to amp
  /// as soon as its allreduce completes, and amp unscales and checks it in one fused pass per bucket on DDP's
  /// communication stream, straight into the gradients the optimizer reads (fp32 masters under O2). Gradients are
  /// reduced while still scaled, so an inf or NaN on any rank reaches every rank through the sum: every rank sets
  /// the same found_inf with no extra collective and skips the same step. Without attach() the same results come
  /// from a second pass over all gradients when the scale_loss scope ends. Buckets the fused kernels do not take
  /// (a non-contiguous gradient, allreduce_dtype(kDouble)) get DDP's own write-back and are unscaled at the scope's
  /// end. `ddp` may be destroyed first. Backward passes outside a scale_loss scope, or with delay_unscale=true, get
  /// DDP's plain average.
  ///
  /// ZeRO (docs/zero.md): with `stage` kOne or kTwo this rank keeps the fp32 masters, master gradients and optimizer
  /// state of its shard only (slices of DDP's buckets, whose layout attach() freezes), unscales only its slice of
  /// each bucket (kTwo: DDP reduce-scatters the buckets, so only that slice arrives), agrees on the overflow flag
  /// with one 1-element allreduce per scale_loss scope, and after each step all-gathers the updated slices into
  /// every rank's model parameters. Needs one of amp's fused optimizers holding every parameter DDP reduces, and
  /// must come before the first scale_loss. The loop stays the same; scale_loss scopes, step() and
  /// amp::clip_grad_norm_ become collective (call them on every rank). Under kTwo every synchronized backward
  /// must run in a scale_loss scope with delay_unscale=false (accumulate with no_sync).
  ///
  /// `publish` (ZeRO only; kAtNextForward with kNone is refused): kInStep waits for the all-gather inside step();
  /// kAtNextForward leaves it in flight until the next model.forward / model.call (see ZeroPublish), so that what
  /// runs in between overlaps it. The parameters end bit-identical either way.
  void attach(ddp::DistributedDataParallel& ddp, ZeroStage stage = ZeroStage::kNone,
              ZeroPublish publish = ZeroPublish::kInStep) {
    state_->attach(ddp, stage, publish);
  }
  /// ZeroPublish::kAtNextForward: completes the parameter all-gather the last step() left in flight, so that the
  /// module's parameters hold the stepped values; does nothing when none is pending (and always without ZeRO).
  /// amp::Model's forward() and call() do this themselves: call it before anything else reads the parameters, e.g.
  /// an evaluation forward through the raw module or DDP's forward. Not collective. Blocks the host for Gloo; for
  /// NCCL it orders the current stream after the transfer. A failed all-gather throws here ("ZeRO parameter
  /// all-gather failed on rank ...").
  void wait_for_parameters() { state_->wait_for_parameters(); }
  /// Bytes this rank holds for fp32 masters, the optimizer's gradients and its state (ZeRO shards all three).
  HeldBytes held_bytes() const { return state_->held_bytes(); }
  /// Options::fp8: what initialize logged about the model's layers (which run in FP8, which not and why); empty
  /// without FP8.
  std::vector<std::string> fp8_report() const;
  /// The torch::optim optimizer passed to amp::initialize. Under master weights (O2) its parameters are the fp32
  /// masters; under ZeRO, 1-D views of this rank's shard (docs/zero.md). Stepping it directly skips amp's overflow
  /// check and, under master weights, the copy from the masters into the model's half parameters.
  torch::optim::Optimizer& inner() { return state_->optimizer(); }
  /// The loss scaler of `loss_id` (scale, diagnostics, device tensors).
  LossScaler& scaler(int64_t loss_id = 0) { return state_->scaler(loss_id); }
  /// Gradients the optimizer reads (the fp32 masters' under master weights): what clipping must act on.
  std::vector<at::Tensor> gradients() const { return state_->optimizer_grads(); }
  /// The overflow flag of the step being prepared (1-element fp32 on the device, the sum of this step's losses'
  /// flags and clip_grad_norm_'s): what the next step() decides on, e.g. for fused consumers. step() zeroes it
  /// for the next step; what it decided stays in last_step_skipped().
  const at::Tensor& found_inf() const { return state_->step_found_inf(); }
  /// 1-element fp32 on the device: 1 when the last step() skipped the update (a gradient or the clipped norm was
  /// inf/NaN), 0 when it stepped (and before any step). Written by step() without a host sync; kept until the next.
  const at::Tensor& last_step_skipped() const { return state_->step_outcome().skipped(); }
  /// The same on the host, read lazily like LossScaler::diagnostics(): the newest step whose copy has completed
  /// (on CUDA with a fused optimizer usually the previous step; at once with a plain torch::optim optimizer).
  /// Never blocks. step is -1 before the first step().
  StepReport last_step() { return state_->step_outcome().latest(); }
  /// Waits for the last step()'s report (a host sync: not for the step path).
  StepReport last_step_now() { return state_->step_outcome().latest_now(); }
  /// Where overflow report lines go (default: stderr). Called at most once per 100 steps per loss.
  void set_overflow_logger(std::function<void(const std::string&)> logger) {
    state_->set_overflow_logger(std::move(logger));
  }
  /// Name of the parameter a scaler diagnostic points at (see ScalerDiagnostics::first_nonfinite_index).
  std::string parameter_name(int64_t loss_id, const ScalerDiagnostics& diagnostics) const {
    (void)loss_id;
    return state_->param_name(diagnostics.first_nonfinite_index);
  }

  /// Saves amp's own state into `archive`: the options, every loss scaler and, with FP8, the layers' scaling state.
  void save_amp_state(torch::serialize::OutputArchive& archive) const { state_->save(archive); }
  /// Loads what save_amp_state() wrote. Refuses (c10::Error) a checkpoint written with other options and changes
  /// nothing on any error; after a load the overflow flag of the step being prepared is clear.
  void load_amp_state(torch::serialize::InputArchive& archive) { state_->load(archive); }

  /// amp's internal state, shared with the Model (what amp's free functions such as clip_grad_norm_ and the
  /// checkpoint functions act on). Not a stable interface.
  detail::State& state() { return *state_; }
  /// The shared pointer to that state (a ScaledLoss keeps one).
  const std::shared_ptr<detail::State>& state_ptr() const { return state_; }

 private:
  std::shared_ptr<detail::State> state_;
};

/// What amp::initialize returns, for a structured binding: `auto [model, optimizer] = amp::initialize(...)`. Both
/// share one amp state.
template <typename ModuleHolder>
struct Initialized {
  Model<ModuleHolder> model;  ///< the model to call forward on
  Optimizer optimizer;        ///< the optimizer to step, pass to scale_loss and clip_grad_norm_
};

/// Prepares `module` and `optimizer` for mixed precision per `options`: checks the model (fp32 parameters on
/// one device, not already wrapped for data parallel) and the optimizer (its parameters belong to the model,
/// not initialized before), casts the model (O2/O3), creates fp32 master weights and points the optimizer at
/// them (O2), and creates num_losses loss scalers on the model's device. Errors name the offending parameter.
/// The optimizer must outlive the returned objects.
template <typename ModuleHolder>
Initialized<ModuleHolder> initialize(ModuleHolder module, torch::optim::Optimizer& optimizer,
                                     const Options& options = Options()) {
  auto state = std::make_shared<detail::State>(*module.ptr(), optimizer, options);
  return {Model<ModuleHolder>(std::move(module), state), Optimizer(state)};
}

/// What amp::Model holds for a fully sharded model: `->` reaches the ddp::FullyShardedDataParallel, so that
/// model.forward(x) runs its forward under the opt level's policy.
class FullyShardedModule {
 public:
  /// Refers to `fsdp`, which must outlive it.
  explicit FullyShardedModule(ddp::FullyShardedDataParallel& fsdp) : fsdp_(&fsdp) {}
  /// The FullyShardedDataParallel.
  ddp::FullyShardedDataParallel* operator->() const { return fsdp_; }
  /// The FullyShardedDataParallel.
  ddp::FullyShardedDataParallel& operator*() const { return *fsdp_; }

 private:
  ddp::FullyShardedDataParallel* fsdp_;
};

/// Mixed precision over a fully sharded model (docs/fsdp.md): `optimizer` is built over fsdp.parameters(), the fp32
/// shards, and those shards are the master weights: O2 computes in half from units gathered in half (construct
/// `fsdp` with FullyShardOptions().param_dtype(the half dtype)) and needs no second fp32 copy; O0/O1 leave the
/// parameters fp32 (param_dtype unset). One loss scale and one overflow flag for all ranks (the flag is reduced over
/// `fsdp`'s group once per scale_loss scope that unscales), clip_grad_norm_ over every rank's shards: scale_loss
/// scopes, step() and amp::clip_grad_norm_ are collective (call them on every rank). Refused in one line: O3,
/// keep_layernorm_fp32, BatchNorm kept fp32 under O2, FP8, LBFGS, a param_dtype other than the opt level's.
/// amp::save_checkpoint writes one consolidated file (with one of amp's fused optimizers) that loads at any world size
/// and into an unsharded run; model.save / model.load write and read the consolidated model. `fsdp` must outlive the
/// returned objects.
inline Initialized<FullyShardedModule> initialize(ddp::FullyShardedDataParallel& fsdp,
                                                  torch::optim::Optimizer& optimizer,
                                                  const Options& options = Options()) {
  auto state = std::make_shared<detail::State>(fsdp, optimizer, options);
  return {Model<FullyShardedModule>(FullyShardedModule(fsdp), state), Optimizer(state)};
}

/// The loss scaled for backward (Apex's `with amp.scale_loss(loss, optimizer) as scaled_loss`). When it goes
/// out of scope after backward(), the gradients are unscaled and checked (into the fp32 masters' gradients
/// under master weights), and the loss scale is updated; the next optimizer.step() skips on overflow.
/// delay_unscale=true leaves the gradients scaled so several backward passes accumulate them (the scale does
/// not move meanwhile); the last one of the accumulation uses false. If an exception leaves the scope, the
/// scope's end does nothing (with Optimizer::attach, buckets DDP reduced before the exception were already
/// unscaled): zero_grad() before the next step.
class ScaledLoss {
 public:
  /// What amp::scale_loss calls: multiplies `loss` (converted to fp32) by the current scale of scaler `loss_id`.
  /// Throws (c10::Error) for a loss_id outside [0, num_losses), an undefined or non-floating loss, a loss on
  /// another device than the scaler, a loss_id other than the one a delay_unscale=true scope left pending, and
  /// under ZeroPublish::kAtNextForward while the parameter all-gather is still pending.
  ScaledLoss(Optimizer& optimizer, const at::Tensor& loss, int64_t loss_id, bool delay_unscale);
  ~ScaledLoss() noexcept(false);
  /// Takes over `other`'s scope; `other`'s end then does nothing.
  ScaledLoss(ScaledLoss&& other) noexcept;
  ScaledLoss(const ScaledLoss&) = delete;
  ScaledLoss& operator=(const ScaledLoss&) = delete;
  ScaledLoss& operator=(ScaledLoss&&) = delete;

  /// scaled.backward(): backpropagates the scaled loss.
  void backward(bool retain_graph = false);
  /// The scaled loss tensor (fp32).
  const at::Tensor& tensor() const { return scaled_; }

 private:
  std::shared_ptr<detail::State> state_;
  at::Tensor scaled_;
  int64_t loss_id_;
  bool delay_unscale_;
  int uncaught_at_start_;
  bool active_ = true;
};

/// `auto scaled = amp::scale_loss(loss, optimizer [, loss_id] [, delay_unscale]); scaled.backward();`
ScaledLoss scale_loss(const at::Tensor& loss, Optimizer& optimizer, int64_t loss_id = 0, bool delay_unscale = false);

/// Clips the gradients `optimizer` will apply (unscaled: call after the scale_loss scope) to a total L2 norm of
/// max_norm, on the device with no host sync; a non-finite norm leaves them untouched and marks the step as
/// overflowed so it is skipped. Returns the total norm (1-element fp32 device tensor).
at::Tensor clip_grad_norm_(Optimizer& optimizer, double max_norm);

/// Saves model (fp32 values), optimizer and amp state into one file (Apex's checkpoint recipe), with a checksum of
/// each part and the optimizer's type name (see docs/checkpointing.md). The file is replaced atomically
/// (amp::write_file_atomically): a writer stopped at any point leaves the previous file whole. Errors are
/// c10::Error, one line naming the path, without a C++ backtrace.
template <typename ModuleHolder>
void save_checkpoint(const std::string& path, const Model<ModuleHolder>& model, Optimizer& optimizer);
/// Restores what save_checkpoint wrote, after initialize() with the same options and the same optimizer type.
/// Verifies the checksums and reads and checks all three parts before changing anything: a missing, truncated or
/// corrupted file (a single flipped bit included), one from another optimizer type, another model or other
/// options is an error that leaves model, optimizer and scalers as they were. Errors are c10::Error, one line
/// naming the path and the offending value, without a C++ backtrace. After a load, the scalers' diagnostics report
/// the loaded state and the floor-overflow count is the saved one (see LossScaler::load).
template <typename ModuleHolder>
void load_checkpoint(const std::string& path, Model<ModuleHolder>& model, Optimizer& optimizer);

/// Named byte strings a caller keeps in the checkpoint file beside model, optimizer and amp state: a training loop's
/// position and RNG state, so that the file stays one atomic write (Note [checkpoint extras] in amp/io/checkpoint.cpp).
/// Names are 1 to 64 characters of [A-Za-z0-9_-]; values any bytes.
using CheckpointExtras = std::map<std::string, std::string>;

/// save_checkpoint that also stores `extras`, each with its own checksum. Throws (c10::Error, one line) for a name
/// outside the alphabet above, before anything is written.
template <typename ModuleHolder>
void save_checkpoint(const std::string& path, const Model<ModuleHolder>& model, Optimizer& optimizer,
                     const CheckpointExtras& extras);
/// load_checkpoint that also returns the extras the file holds (empty for a file saved without any, or of format
/// 1). They are verified against their checksums with the other parts, before anything changes.
template <typename ModuleHolder>
void load_checkpoint(const std::string& path, Model<ModuleHolder>& model, Optimizer& optimizer,
                     CheckpointExtras& extras);

/// The checks load_checkpoint makes of the file alone, with no model or optimizer to load into: it reads as a
/// checkpoint of a known format and every part and extra matches its checksum (a flipped bit fails). Throws
/// c10::Error, one line naming the path, as load_checkpoint does. Loading can still fail after it passes (another
/// model, other options). A check for amp::CheckpointDir::load_newest where the real load comes later; the index
/// of a sharded ZeRO checkpoint does not pass (its shards are checked when it loads).
void verify_checkpoint(const std::string& path);

/// ZeRO (docs/zero.md): each rank writes its own shard (masters and optimizer state of its pieces) to
/// "PATH.zero-<generation>-<rank>-of-<N>" and rank 0 then writes the small index at `path`, atomic as a set: `path`
/// always names a complete set (Note [sharded checkpoint] in amp/io/checkpoint.cpp). Collective: call it on every rank.
/// amp::load_checkpoint reads it at any world size into a run attached with a ZeroStage. Errors are c10::Error, one
/// line naming the file, raised on every rank.
template <typename ModuleHolder>
void save_checkpoint_sharded(const std::string& path, const Model<ModuleHolder>& model, Optimizer& optimizer,
                             const CheckpointExtras& extras = {});

namespace detail {
void save_checkpoint_sharded(const std::string& path, State& state, const CheckpointExtras& extras);
void save_checkpoint(const std::string& path, State& state, const CheckpointExtras& extras = {});
/// `extras`: where to put the file's extras (nullptr: not wanted; they are verified all the same).
void load_checkpoint(const std::string& path, State& state, CheckpointExtras* extras = nullptr);
}  // namespace detail

template <typename ModuleHolder>
void save_checkpoint_sharded(const std::string& path, const Model<ModuleHolder>&, Optimizer& optimizer,
                             const CheckpointExtras& extras) {
  detail::save_checkpoint_sharded(path, optimizer.state(), extras);
}
template <typename ModuleHolder>
void save_checkpoint(const std::string& path, const Model<ModuleHolder>&, Optimizer& optimizer) {
  detail::save_checkpoint(path, optimizer.state());
}
template <typename ModuleHolder>
void load_checkpoint(const std::string& path, Model<ModuleHolder>&, Optimizer& optimizer) {
  detail::load_checkpoint(path, optimizer.state());
}
template <typename ModuleHolder>
void save_checkpoint(const std::string& path, const Model<ModuleHolder>&, Optimizer& optimizer,
                     const CheckpointExtras& extras) {
  detail::save_checkpoint(path, optimizer.state(), extras);
}
template <typename ModuleHolder>
void load_checkpoint(const std::string& path, Model<ModuleHolder>&, Optimizer& optimizer, CheckpointExtras& extras) {
  detail::load_checkpoint(path, optimizer.state(), &extras);
}

}  // namespace amp
