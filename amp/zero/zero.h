#pragma once

// ZeRO (stages 1 and 2) for amp's data parallel training: what amp::Optimizer::attach takes. See docs/zero.md.

#include <cstdint>

namespace amp {

/// How amp::Optimizer::attach(ddp, stage) shares the optimizer's memory across the data parallel ranks.
enum class ZeroStage {
  /// Every rank holds all fp32 masters, master gradients and optimizer state (plain DDP + amp).
  kNone = 0,
  /// Each rank holds the fp32 masters, the fp32 master gradients and the optimizer state of its shard only;
  /// gradients are all-reduced as without ZeRO and each rank unscales only its shard of each bucket; after the step the
  /// updated shards are all-gathered
  /// into every rank's (half) model parameters.
  kOne = 1,
  /// Stage 1, and each gradient bucket is reduce-scattered instead of all-reduced, as soon as it is ready: a rank
  /// receives and keeps only its shard of the reduced gradients.
  kTwo = 2,
};

/// Bytes of tensor storage the optimizer side of amp holds on this rank (each storage counted once): what ZeRO
/// shards. The model's own parameters, DDP's buckets and the transient all-gather buffer are not counted.
struct HeldBytes {
  int64_t masters = 0;          // fp32 master weights (ZeRO: this rank's shard)
  int64_t master_grads = 0;     // the gradients the optimizer reads (fp32 masters' gradients; ZeRO: the shard's)
  int64_t optimizer_state = 0;  // moments, momentum buffers, step counts (FusedOptimizer::state_tensors)
  int64_t total() const { return masters + master_grads + optimizer_state; }
};

}  // namespace amp
