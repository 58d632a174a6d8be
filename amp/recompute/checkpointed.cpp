#include <amp/recompute/checkpointed.h>

#include <utility>

#include <c10/util/Exception.h>

#include <amp/nn/float8_linear.h>
#include <amp/state/model_cast.h>
#include <ddp/wrapped_module.h>

namespace amp {

CheckpointedImpl::CheckpointedImpl(std::shared_ptr<torch::nn::Module> module,
                                   std::function<torch::Tensor(const torch::Tensor&)> forward,
                                   ActivationCheckpointOptions options)
    : torch::nn::Module("amp::Checkpointed"),
      module_(std::move(module)),
      forward_(std::move(forward)),
      options_(options) {
  TORCH_CHECK(module_, "amp::Checkpointed: no module given (an empty holder)");
  // A layer that amp or DDP treat by its type (amp::initialize keeps norms fp32 and runs Float8Linear in FP8,
  // convert_sync_batch_norm swaps BatchNorm) would be hidden behind the wrapper: wrap the block that holds it.
  const bool special = is_batch_norm(*module_) || is_layer_or_group_norm(*module_) ||
                       dynamic_cast<const Float8LinearImpl*>(module_.get()) != nullptr;
  TORCH_CHECK(!special, "amp::Checkpointed: wrap a block, not a single ", module_->name(),
              ": amp::initialize and convert_sync_batch_norm find such a layer by its type, which the wrapper hides");
  ddp::register_members_of(*this, *module_);  // the wrapper adds no level to the names
}

torch::Tensor CheckpointedImpl::forward(const torch::Tensor& input) {
  // The wrapper's submodules are the wrapped module's; one swapped in the wrapper's registry only (by
  // convert_sync_batch_norm after wrapping) would train other parameters than the forward uses.
  const auto mine = named_children();
  const auto theirs = module_->named_children();
  for (const auto& child : mine) {
    TORCH_CHECK(theirs.contains(child.key()) && theirs[child.key()] == child.value(), "amp::Checkpointed: submodule '",
                child.key(),
                "' was replaced after wrapping (by convert_sync_batch_norm?): the wrapped module still runs ",
                "the old one; convert before wrapping");
  }
  TORCH_CHECK(mine.size() == theirs.size(),
              "amp::Checkpointed: the wrapped module's submodules changed after wrapping; wrap it last");
  return activation_checkpoint(forward_, input, options_);
}

void CheckpointedImpl::train(bool on) {
  torch::nn::Module::train(on);
  module_->train(on);
}

void CheckpointedImpl::pretty_print(std::ostream& stream) const {
  stream << "amp::Checkpointed(";
  module_->pretty_print(stream);
  stream << ")";
}

}  // namespace amp
