#pragma once

// Gradient sharding (ZeRO stage 2, DistributedDataParallel::set_gradient_sharding): how one bucket is
// reduce-scattered instead of all-reduced, and where this rank's slice of the sum lands. The reducer calls it at
// launch and at the end of backward; the split itself is ddp/shard_layout.h's. Internal to ddp/ (ddp::detail).

#include <vector>

#include <ATen/core/Tensor.h>

#include <ddp/process_group.h>
#include <ddp/shard_layout.h>

namespace ddp::detail {

/// The buffers of one bucket's reduction under gradient sharding: they live from its launch to the end of backward.
struct ShardedReduction {
  at::Tensor wire;   ///< the collective's input (NCCL: the padded slices, slice q at q * chunk; Gloo: the flat bucket)
  at::Tensor shard;  ///< NCCL: the reduce-scatter's output (this rank's padded slice); Gloo: undefined
  c10::intrusive_ptr<c10d::Work> work;
};

/// Flattens `grads` (times `prescale`, in `dtype`'s bucket) and starts the reduction of a bucket of `shards.numel`
/// elements: NCCL reduce-scatters the padded slices; Gloo all-reduces the flat bucket itself, since its
/// reduce-scatter is an allreduce of the whole input followed by taking this rank's chunk (PyTorch #118911): the same
/// bytes on the wire, without the padded copy. Host syncs: none.
ShardedReduction launch_sharded_reduction(const ProcessGroup& pg, const BucketShards& shards,
                                          const at::TensorOptions& bucket_options, const std::vector<at::Tensor>& grads,
                                          double prescale);

/// This rank's slice of the reduced bucket (shards.size(rank) elements, at shards.begin(rank) of the bucket), once
/// `r.work` is done.
at::Tensor received_slice(const ProcessGroup& pg, const BucketShards& shards, const ShardedReduction& r);

}  // namespace ddp::detail
