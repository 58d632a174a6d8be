#pragma once

#include <torch/torch.h>

#include <amp/nn/float8_linear.h>
#include <ddp/fsdp/sharded_unit.h>

namespace examples {

/// How SmallCnn normalizes.
struct SmallCnnOptions {
  /// ddp::SyncBatchNorm (2d) instead of torch::nn::BatchNorm2d: batch statistics over the ranks of a process
  /// group, set after joining it with ddp::set_sync_batch_norm_process_group. Parameter and buffer names stay
  /// those of BatchNorm2d, so checkpoints move between the two.
  TORCH_ARG(bool, sync_batch_norm) = false;
  /// fc1 (3136 -> 128, 95% of the parameters) in a ddp::ShardedUnit: under ddp::FullyShardedDataParallel its
  /// parameters are gathered only while it runs (amp_fsdp). The names stay "fc1.weight", "fc1.bias".
  TORCH_ARG(bool, sharded_fc1) = false;
};

/// The tutorial's "model = ...": a small CNN for 28x28 grey images, 10 classes.
/// conv(1->32,3) BN ReLU pool, conv(32->64,3) BN ReLU pool, fc(64*7*7 -> 128) ReLU, fc(128 -> 10).
/// Cloneable so that torch::nn::parallel::data_parallel can replicate it onto each GPU.
struct SmallCnnImpl : torch::nn::Cloneable<SmallCnnImpl> {
  explicit SmallCnnImpl(const SmallCnnOptions& options = {});
  /// Builds (or, in a clone, rebuilds) the layers; Cloneable::clone() calls it on the copy.
  void reset() override;
  torch::Tensor forward(torch::Tensor x);

  SmallCnnOptions options;
  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr};
  /// BatchNorm2d, or ddp::SyncBatchNorm with options.sync_batch_norm(). Held type-erased because forward() calls
  /// them through these members: ddp::convert_sync_batch_norm could not replace a typed member (see its
  /// limitation), so the type is chosen at construction instead.
  torch::nn::AnyModule bn1, bn2;
  /// amp::Float8Linear: exactly torch::nn::Linear until amp::Options::fp8 turns their GEMMs to FP8 (fc2, 128 -> 10,
  /// stays out: 10 is not a multiple of 16).
  amp::Float8Linear fc1{nullptr}, fc2{nullptr};
  /// With options.sharded_fc1(): the unit around fc1, registered as "fc1" in its place; forward() calls it.
  ddp::ShardedUnit fc1_unit{nullptr};
};
TORCH_MODULE(SmallCnn);

}  // namespace examples
