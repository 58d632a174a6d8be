#pragma once

// ddp::ShardedUnit: marks a block of a model as one unit of full sharding (ddp/fsdp/fully_sharded.h).

#include <functional>
#include <memory>
#include <ostream>

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>
#include <torch/types.h>

namespace ddp {

namespace detail {
class ShardedRun;
}  // namespace detail

// Note [sharding a LibTorch module]
// A C++ module has no forward hooks and no forward pre-hooks, so FSDP2's way (hooks registered on the module)
// does not exist. The unit is a module that wraps the block and holds its parameters, buffers and submodules under
// their own names (so names, state dictionaries and optimizers read as without it, as amp::Checkpointed does): its
// forward() is where the unit starts and ends, so it gathers there and frees after. Backward needs two more places:
// - before the unit's backward: a hook on the block's output gathers the parameters again (and prefetches the next
//   unit of backward); autograd runs a tensor's hooks when its gradient is computed, before the node that made it,
//   so before any node of the block. A hook rather than an identity autograd function: the output stays the block's
//   own, so an in-place op on it works as without sharding (a hook stays with the node it was registered on);
// - after it: a post hook on each parameter's gradient accumulator (as DDP's reducer does) counts the unit's
//   gradients; the last one launches the unit's reduce-scatter and frees the full gradients and parameters.
// The parameters stay the same tensors all along (autograd saved them, optimizers and state dictionaries name
// them): set_data() swaps what they view, the unit's flat storage when gathered and an empty tensor when sharded,
// and the flat storage is freed and refilled in place, so views of the parameters that autograd saved in forward
// read the gathered values again in backward. The gradient accumulators are created while the parameters are full
// and kept alive, so they keep the full shapes they check gradients against.

/// Wraps a module with forward(Tensor) -> Tensor (a transformer block) as one unit of FullyShardedDataParallel:
/// its parameters are gathered by one all-gather when it runs and reduce-scattered by one collective after its
/// backward. Wrap where the block is built or held (`blocks->push_back(ddp::ShardedUnit(Block(...)))`); the wrapper
/// holds the block's parameters, buffers and submodules under their own names, so the model's names and state
/// dictionaries read as without it. Until a FullyShardedDataParallel is built over the model, forward() is the
/// block's own. Do not nest units; activation checkpointing goes inside (ShardedUnit(amp::Checkpointed(block))).
class ShardedUnitImpl : public torch::nn::Module {
 public:
  /// `module`: a module holder or a shared_ptr to a module whose forward takes and returns one tensor.
  template <typename ModuleType>
  explicit ShardedUnitImpl(const torch::nn::ModuleHolder<ModuleType>& module) : ShardedUnitImpl(module.ptr()) {}
  /// The same, from the module's shared pointer.
  template <typename ModuleType>
  explicit ShardedUnitImpl(std::shared_ptr<ModuleType> module)
      : ShardedUnitImpl(module, [module](const torch::Tensor& x) -> torch::Tensor { return module->forward(x); }) {}

  /// The wrapped module's forward, with its parameters gathered (see FullyShardedDataParallel).
  torch::Tensor forward(const torch::Tensor& input);
  /// The wrapped module.
  const std::shared_ptr<torch::nn::Module>& wrapped() const { return module_; }
  /// Sets training mode on the wrapper, its registered members and the wrapped module itself.
  void train(bool on = true) override;
  /// Writes "ddp::ShardedUnit(<the wrapped module>)".
  void pretty_print(std::ostream& stream) const override;

 private:
  ShardedUnitImpl(std::shared_ptr<torch::nn::Module> module, std::function<torch::Tensor(const torch::Tensor&)> fn);

  friend class detail::ShardedRun;
  std::shared_ptr<torch::nn::Module> module_;
  std::function<torch::Tensor(const torch::Tensor&)> forward_;
  std::weak_ptr<detail::ShardedRun> run_;  ///< set by FullyShardedDataParallel; empty before
  size_t index_ = 0;                       ///< this unit's index in the run
  bool attached_ = false;                  ///< a FullyShardedDataParallel was built over it
};
TORCH_MODULE(ShardedUnit);

}  // namespace ddp
