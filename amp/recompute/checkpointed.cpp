#include <amp/recompute/checkpointed.h>

#include <utility>

#include <c10/util/Exception.h>

namespace amp {

CheckpointedImpl::CheckpointedImpl(std::shared_ptr<torch::nn::Module> module,
                                   std::function<torch::Tensor(const torch::Tensor&)> forward,
                                   ActivationCheckpointOptions options)
    : torch::nn::Module("amp::Checkpointed"),
      module_(std::move(module)),
      forward_(std::move(forward)),
      options_(options) {
  TORCH_CHECK(module_, "amp::Checkpointed: no module given (an empty holder)");
  // The wrapped module's own members, registered here under their names: the wrapper adds no level to the names.
  for (const auto& p : module_->named_parameters(/*recurse=*/false)) {
    register_parameter(p.key(), p.value(), p.value().requires_grad());
  }
  for (const auto& b : module_->named_buffers(/*recurse=*/false)) register_buffer(b.key(), b.value());
  for (const auto& child : module_->named_children()) register_module(child.key(), child.value());
  train(module_->is_training());
}

torch::Tensor CheckpointedImpl::forward(const torch::Tensor& input) {
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
