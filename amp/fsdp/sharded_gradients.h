#pragma once

// The gradient owner of full sharding (Note [gradient owner] in amp/state/gradient_owner.h): amp over a
// ddp::FullyShardedDataParallel. Internal: users go through amp::initialize(fsdp, ...) (amp/fsdp/fully_sharded_amp.h).

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include <amp/options.h>
#include <amp/state/gradient_owner.h>
#include <amp/state/replicated_gradients.h>
#include <ddp/process_group.h>

namespace ddp {
class FullyShardedDataParallel;
}  // namespace ddp

namespace amp::detail {

/// The optimizer's parameters are the fp32 shards of a FullyShardedDataParallel (one flat 1-D tensor per unit): they
/// are the master weights (under O2 the units gather them cast to the half dtype), and backward leaves each rank the
/// average of its slice of the scaled gradients in the shards' fp32 .grad. So the replicated owner's arithmetic
/// applies to them unchanged (unscaled in place, stashed across losses, the fused step on the shards) with two
/// differences: each rank checked only its slice, so the overflow flag is reduced over the ranks (MAX, one
/// 1-element allreduce per scope that unscales), and clip_grad_norm_ takes the norm over every rank's shards.
///
/// Consolidated checkpoints (sharded_checkpoint.cpp) write the optimizer's state in the unsharded layout: in group g
/// the parameters of the units whose shards group g holds, in the module's order, each entry shaped like its
/// parameter (what the optimizer writes for the unsharded model built with one group per such set of units: one group
/// over model->parameters() for a one-group optimizer). Needs one of amp's fused optimizers (their state is per
/// element and named by field). Sharded checkpoints write each rank's shards as pieces of the parameters by name and
/// range (amp/state/shard_file.h), as ZeRO does: the units step together (every unit's shard gets a gradient in
/// every synchronized backward, zeros for a unit that did not run), so a rank whose shard of a unit holds only padding
/// takes that unit's step count and whether it has state from its other units, or from the files when it holds no
/// parameter's part at all; step counts that differ are refused.
class ShardedGradients final : public GradientOwner, public ShardedOwner {
 public:
  ShardedGradients(const OwnerContext& context, ddp::FullyShardedDataParallel& fsdp);

  void begin_loss(bool starts_cycle) override { shards_.begin_loss(starts_cycle); }
  /// No buckets: full sharding reduces each unit's gradients itself.
  bool consume_bucket(const ddp::ReducedBucket&, LossScaler*) override { return false; }
  bool end_loss(LossScaler& scaler, bool reduce_flag) override;
  void step(FusedOptimizer& fused, const at::Tensor& found_inf) override { shards_.step(fused, found_inf); }
  std::vector<at::Tensor> grads() const override { return shards_.grads(); }
  at::Tensor clip_grad_norm_(double max_norm, const at::Tensor& found_inf) override;
  void zero_grad() override { shards_.zero_grad(); }
  /// masters: the fp32 shards; master_grads: their gradients; optimizer_state: a fused optimizer's state.
  HeldBytes held_bytes() const override;
  /// The shards (each slot's value is its shard: the full values are FullyShardedDataParallel::full_parameters()).
  std::vector<at::Tensor> full_masters() const override { return shards_.full_masters(); }
  /// Nothing: the slots are the masters.
  void master_copies(const std::vector<at::Tensor>&, std::vector<std::pair<at::Tensor, at::Tensor>>&) const override {}

  void save_consolidated_optimizer(torch::serialize::OutputArchive& archive) const override;
  std::string shard_optimizer_archive(torch::serialize::InputArchive& full) const override;
  int64_t count_failures(bool ok) const override;
  int rank() const override { return pg_.rank(); }
  int64_t broadcast_from_root(int64_t value) const override;

  /// Sharded checkpoints (ShardedOwner): the parameters' parts in this rank's shard of each unit, in a shard file;
  /// a load from the files of any world size (full sharding's or ZeRO's).
  std::string save_shard() const override;
  ShardLoad begin_shard_load() const override;
  void read_shard(const std::string& bytes, ShardLoad& load) const override;
  std::string finish_shard_load(const ShardLoad& load,
                                std::vector<std::pair<at::Tensor, at::Tensor>>& copies) const override;
  /// Nothing: the next forward gathers the loaded shards.
  void after_shard_load() override {}

 private:
  /// A parameter of a unit in the consolidated layout.
  struct LaidOut {
    std::string name;
    std::vector<int64_t> shape;
    int64_t offset = 0;  ///< in the unit's flat layout
    int64_t index = 0;   ///< j: its index in its group of the unsharded layout
  };
  /// A slot (one unit's shard) and where the optimizer and the unsharded layout hold it.
  struct ShardLayout {
    int64_t group = 0;  ///< g: the optimizer's param group
    int64_t index = 0;  ///< its index in that group
    int64_t chunk = 0;  ///< elements per rank
    std::vector<LaidOut> params;
  };
  void check_fused(const char* what) const;
  /// Every parameter's part in this rank's shards (zero-length where it holds none), at its place in the shards laid
  /// back to back in slot order; `slot_of` (when given) gets each piece's slot.
  std::vector<ShardPiece> shard_pieces(std::vector<size_t>* slot_of = nullptr) const;

  Options::Resolved policy_;  ///< the opt level's, without master weights: the shards are fp32 already
  ReplicatedGradients shards_;
  const ParamSlots& slots_;
  torch::optim::Optimizer& optimizer_;
  FusedOptimizer* fused_;
  ddp::ProcessGroup pg_;
  std::vector<ShardLayout> layout_;  ///< per slot
};

}  // namespace amp::detail
