#pragma once
// What the layers below activation checkpointing (amp::activation_checkpoint) must know about it: a block's forward
// that runs a second time, in backward, to rebuild its activations, and the backward of that rebuilt block, which
// autograd runs nested inside the outer one (reentrant). DistributedDataParallel's reducer and SyncBatchNorm consult
// this; amp's checkpoint sets it. in_recompute() is per thread (the recompute runs on the thread of the node that
// started it); the nested-backward scopes are process-wide (the nested backward's nodes may run on other threads).
#include <functional>
#include <vector>

namespace ddp {

/// True on this thread while a checkpointed block's forward runs again in backward. A module with side effects in
/// its forward has them once: SyncBatchNorm updates its running statistics in the first forward only (its
/// collectives run in both, on every rank alike, since every rank recomputes the same blocks in the same order).
bool in_recompute();

/// Marks this thread as recomputing while alive (in_recompute()). Nests.
class RecomputeScope {
 public:
  RecomputeScope();
  ~RecomputeScope();
  RecomputeScope(const RecomputeScope&) = delete;
  RecomputeScope& operator=(const RecomputeScope&) = delete;

 private:
  bool previous_;
};

/// Around a backward nested in another (the rebuilt block's, started from a node of the outer backward): work that
/// must run when the *outer* backward ends, queued while this scope is alive, is held here and handed to the outer
/// backward by finish(). DistributedDataParallel queues its end-of-backward step (wait for the buckets, write the
/// averages back) at the first gradient of a pass; were that gradient the rebuilt block's, autograd would run the
/// step when the nested backward ends, before the rest of the model has its gradients. Call finish() after the
/// nested backward returned, from the outer backward's node; if the nested backward threw, the held work is dropped
/// (the outer backward fails too, and DDP clears the pass at the next forward). Nests. Process-wide: work queued on
/// any thread while a scope is alive goes to the innermost live scope (DDP runs one backward at a time).
class NestedBackwardScope {
 public:
  NestedBackwardScope();
  ~NestedBackwardScope();
  NestedBackwardScope(const NestedBackwardScope&) = delete;
  NestedBackwardScope& operator=(const NestedBackwardScope&) = delete;

  /// Ends the scope and queues what it held on the backward now running (or the enclosing scope, if nested).
  void finish();

 private:
  std::vector<std::function<void()>> held_;
  bool finished_ = false;

  friend void queue_end_of_backward(std::function<void()> callback);
};

/// Runs `callback` when the outermost backward now running on this thread ends (torch::autograd::Engine's
/// queue_callback, but past any NestedBackwardScope). Only during a backward.
void queue_end_of_backward(std::function<void()> callback);

}  // namespace ddp
