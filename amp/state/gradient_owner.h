#pragma once

// Who holds the gradients the optimizer reads and the masters it updates: one of State's parts (Note [State's parts]
// in amp/state/state.h), the one a new data parallel mode replaces. Internal: users go through amp::Optimizer.

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/archive.h>

#include <amp/options.h>
#include <amp/state/shard_file.h>
#include <amp/zero/zero.h>

namespace ddp {
struct ReducedBucket;
}  // namespace ddp

namespace amp {

class FusedOptimizer;
class LossScaler;

namespace detail {

class ParamSlots;

/// What an owner may use of State: the slots (which it may reshape: ZeRO drops the replicated masters), the optimizer
/// (whose param groups it may rewrite), and the policy.
struct OwnerContext {
  ParamSlots& slots;
  torch::optim::Optimizer& optimizer;
  FusedOptimizer* fused;  ///< the optimizer, when it is one of amp's fused optimizers, else null
  const Options::Resolved& policy;
  /// No scale_loss scope has begun and no step() has run since initialize (an owner that reshapes state needs it).
  bool untouched;
};

/// Note [gradient owner]
/// State runs the scale_loss protocol (LossScopes) and the step's bookkeeping (StepProgress); where the gradients
/// live between backward and step() is the owner's business. Two implement it:
/// - ReplicatedGradients (one process, and plain DDP + amp): every rank holds every gradient, unscaled in place for
///   fp32 parameters and in fp32 into the masters' gradients for half ones; DDP's reduced buckets are unscaled as
///   they arrive (consume_bucket), the rest at the scope's end.
/// - ZeroShard (amp/zero/, ZeroStage::kOne and kTwo): each rank holds its slice of every bucket's masters,
///   gradients and optimizer state; its step all-gathers the updated slices into the model.
/// - ShardedGradients (amp/fsdp/, amp::initialize over a ddp::FullyShardedDataParallel): the slots are the fp32
///   shards, which are the masters; the replicated arithmetic on them, with the overflow flag and the norm reduced
///   over the ranks.
/// attach() with a ZeroStage swaps the first for the second; the fully sharded constructor of State chooses the
/// third. A new mode implements this interface and is chosen there; nothing else of State changes.
class GradientOwner {
 public:
  virtual ~GradientOwner() = default;

  /// Completes what the last step left in flight into the model parameters (Note [deferred publish]); called before
  /// every forward through amp::Model and before anything of amp reads or writes the parameters. Not collective.
  virtual void wait_for_parameters() {}
  /// Throws when the model parameters are not the last step's (a pending ZeRO publish: Note [deferred publish]);
  /// `what` says what found it. Runs first in scale_loss, before its own checks.
  virtual void check_parameters_current(const char* what) const { (void)what; }
  /// A scale_loss scope begins. `starts_cycle`: no delay_unscale gradients are pending, so the gradients this
  /// backward writes must be this loss's alone (earlier losses' unscaled ones are put aside or already moved out).
  virtual void begin_loss(bool starts_cycle) = 0;
  /// DDP reduced a bucket during backward. `scaler`: the scope's when one that unscales is being backpropagated,
  /// else null. Unscales and checks the bucket into the optimizer's gradients and returns true, or returns false and
  /// DDP writes its average back as usual.
  virtual bool consume_bucket(const ddp::ReducedBucket& bucket, LossScaler* scaler) = 0;
  /// The end of a scope that unscales: unscales and checks with `scaler` every gradient consume_bucket did not take.
  /// The scaler's overflow flag must then mean the same on every rank: an owner that checked only this rank's part
  /// of the gradients reduces it over the ranks (one collective) when `reduce_flag`, and otherwise returns true to
  /// say that the caller must (the FP8 amax reduction carries it). Returns false when the flag needs no reduction.
  virtual bool end_loss(LossScaler& scaler, bool reduce_flag) = 0;
  /// The step of one of amp's fused optimizers on the gradients held here (skipped on the device where `found_inf`
  /// is set), its results in the model parameters. A plain torch::optim optimizer steps in State on the slots.
  virtual void step(FusedOptimizer& fused, const at::Tensor& found_inf) = 0;
  /// Throws, saying why, when step() cannot be captured in a CUDA graph on `device`.
  virtual void check_capturable(const c10::Device& device) const { (void)device; }
  /// The gradients the optimizer will read.
  virtual std::vector<at::Tensor> grads() const = 0;
  /// clip_grad_norm_ over those gradients (over every rank's for a sharded owner; then collective).
  virtual at::Tensor clip_grad_norm_(double max_norm, const at::Tensor& found_inf) = 0;
  /// Drops what the owner holds beyond the slots' .grad (which State clears).
  virtual void zero_grad() = 0;
  virtual HeldBytes held_bytes() const = 0;
  /// Every slot's full fp32 value (its master, or its fp32 parameter). Collective for a sharded owner.
  virtual std::vector<at::Tensor> full_masters() const = 0;
  /// Appends the (destination, value) copies that put full fp32 `values` (one per slot) into the masters held here.
  virtual void master_copies(const std::vector<at::Tensor>& values,
                             std::vector<std::pair<at::Tensor, at::Tensor>>& out) const = 0;
};

/// A gradient owner whose optimizer state is split among the ranks (ZeroShard, ShardedGradients): what the
/// consolidated checkpoints (amp/io/checkpoint.cpp) ask of it. Every call but rank() is collective.
class ShardedOwner {
 public:
  virtual ~ShardedOwner() = default;
  /// Every parameter's optimizer state assembled from all ranks in the unsharded layout (`group<g>.<field>.<j>` for
  /// the parameter's index j in group g): what the optimizer's save() writes for the unsharded model.
  virtual void save_consolidated_optimizer(torch::serialize::OutputArchive& archive) const = 0;
  /// From an archive in the unsharded layout, this rank's part, as the bytes of an archive the optimizer's load()
  /// takes. Checks every entry's size first; changes nothing. Not collective.
  virtual std::string shard_optimizer_archive(torch::serialize::InputArchive& full) const = 0;
  /// How many ranks pass ok = false (one allreduce): every rank takes the same decision.
  virtual int64_t count_failures(bool ok) const = 0;
  virtual int rank() const = 0;
  /// Rank 0's `value` on every rank (one broadcast). Collective.
  virtual int64_t broadcast_from_root(int64_t value) const = 0;

  /// Sharded checkpoints (Note [sharded checkpoint] in amp/io/checkpoint.cpp): this rank's shard file
  /// (amp/state/shard_file.h: its pieces by parameter name and range, their masters, their optimizer state). Needs a
  /// fused optimizer. Not collective.
  virtual std::string save_shard() const = 0;
  /// An empty load of this rank's flat state.
  virtual ShardLoad begin_shard_load() const = 0;
  /// Takes from one shard file's bytes (any rank of any world size, ZeRO's or full sharding's) whatever overlaps this
  /// rank's pieces. Checks the file's structure; throws on anything malformed.
  virtual void read_shard(const std::string& bytes, ShardLoad& load) const = 0;
  /// Checks that the files covered every element this rank holds; appends the (destination, value) copies of the
  /// masters and returns the optimizer's archive of this rank's state (as shard_optimizer_archive).
  virtual std::string finish_shard_load(const ShardLoad& load,
                                        std::vector<std::pair<at::Tensor, at::Tensor>>& copies) const = 0;
  /// After a sharded load's copies: what makes the model read the loaded masters (ZeRO publishes them into the
  /// model parameters; full sharding's next forward gathers them). Collective where it does anything.
  virtual void after_shard_load() = 0;
};

/// Bytes of the distinct storages behind `tensors` (undefined ones skipped).
int64_t held_storage_bytes(const std::vector<at::Tensor>& tensors);

}  // namespace detail
}  // namespace amp
