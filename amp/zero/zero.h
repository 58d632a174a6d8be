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

/// When the all-gather that brings every rank's updated slices into the model parameters after a ZeRO step
/// completes (Note [pipelined publish], Note [deferred publish] in amp/zero/zero_publish.cpp; docs/zero.md). Either way
/// the parameters end bit-identical; only where the wait happens differs.
enum class ZeroPublish {
  /// step() starts the all-gathers and waits for them before it returns: the parameters are current as soon as
  /// step() returns.
  kInStep = 0,
  /// step() starts the all-gathers and returns; they complete (each bucket waited for and copied into the model) at
  /// the next amp::Model::forward / call, or earlier in Optimizer::wait_for_parameters(), the next step() and
  /// checkpoint calls. What runs between step() and the next forward (data loading, zero_grad, logging) overlaps the
  /// transfer, as DeepSpeed's overlap_comm and FSDP's forward prefetch do. Until then the module's parameters hold the
  /// previous step's values: a forward through the raw module (not through amp::Model) must call
  /// wait_for_parameters() first, and a scale_loss scope that begins while the all-gather is still pending throws.
  /// The all-gather buffers (the whole model in its parameter dtypes) stay allocated until the wait.
  kAtNextForward = 1,
};

/// Bytes of tensor storage the optimizer side of amp holds on this rank (each storage counted once): what ZeRO
/// shards. The model's own parameters, DDP's buckets and the transient all-gather buffer are not counted.
struct HeldBytes {
  int64_t masters = 0;          ///< fp32 master weights (ZeRO: this rank's shard)
  int64_t master_grads = 0;     ///< the gradients the optimizer reads (fp32 masters' gradients; ZeRO: the shard's)
  int64_t optimizer_state = 0;  ///< moments, momentum buffers, step counts (FusedOptimizer::state_tensors)
  /// masters + master_grads + optimizer_state.
  int64_t total() const { return masters + master_grads + optimizer_state; }
};

}  // namespace amp
