#pragma once

// amp::Checkpointed: a module whose forward runs under activation_checkpoint (docs/activation_checkpointing.md), as
// torch.distributed.algorithms._checkpoint.checkpoint_wrapper wraps a module in Python.

#include <functional>
#include <memory>
#include <ostream>

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>
#include <torch/types.h>

#include <amp/recompute/activation_checkpoint.h>

namespace amp {

/// Wraps a module with forward(Tensor) -> Tensor (a transformer block, a Sequential) so that its forward keeps only
/// its input and runs again in backward (activation_checkpoint). Swap a block for `amp::Checkpointed(block)` where
/// it is built or held (a Sequential, a ModuleList): the wrapper holds the wrapped module's own parameters, buffers
/// and submodules under their own names, so parameters(), named_parameters() and state dictionaries read as the
/// unwrapped module's (a checkpoint written without the wrapper loads with it, and back), and DDP, amp::initialize
/// and the optimizers see the same tensors. train() and eval() reach the wrapped module. Wrap a block, not a single
/// norm or FP8 layer (refused with one line: amp::initialize and convert_sync_batch_norm find those by their type),
/// and convert BatchNorm to SyncBatchNorm before wrapping (a submodule swapped after wrapping is refused at forward).
/// Not clonable (clone() throws, as for any module without Cloneable).
class CheckpointedImpl : public torch::nn::Module {
 public:
  /// `module`: a module holder (torch::nn::Sequential, a TORCH_MODULE of your own) or a shared_ptr to a module whose
  /// forward takes and returns one tensor.
  template <typename ModuleType>
  explicit CheckpointedImpl(const torch::nn::ModuleHolder<ModuleType>& module, ActivationCheckpointOptions options = {})
      : CheckpointedImpl(module.ptr(), options) {}
  /// The same, from the module's shared pointer.
  template <typename ModuleType>
  explicit CheckpointedImpl(std::shared_ptr<ModuleType> module, ActivationCheckpointOptions options = {})
      : CheckpointedImpl(
            module, [module](const torch::Tensor& x) -> torch::Tensor { return module->forward(x); }, options) {}

  /// activation_checkpoint(the wrapped module's forward, input); with grad off (evaluation), that forward itself.
  torch::Tensor forward(const torch::Tensor& input);
  /// The wrapped module.
  const std::shared_ptr<torch::nn::Module>& wrapped() const { return module_; }
  /// The options it recomputes with.
  const ActivationCheckpointOptions& options() const { return options_; }

  /// Sets training mode on the wrapper, its registered members and the wrapped module itself.
  void train(bool on = true) override;
  /// Writes "amp::Checkpointed(<the wrapped module>)".
  void pretty_print(std::ostream& stream) const override;

 private:
  CheckpointedImpl(std::shared_ptr<torch::nn::Module> module,
                   std::function<torch::Tensor(const torch::Tensor&)> forward, ActivationCheckpointOptions options);

  std::shared_ptr<torch::nn::Module> module_;
  std::function<torch::Tensor(const torch::Tensor&)> forward_;
  ActivationCheckpointOptions options_;
};
TORCH_MODULE(Checkpointed);

}  // namespace amp
