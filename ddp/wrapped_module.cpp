#include <ddp/wrapped_module.h>

namespace ddp {

void register_members_of(torch::nn::Module& wrapper, const torch::nn::Module& wrapped) {
  for (const auto& p : wrapped.named_parameters(/*recurse=*/false)) {
    wrapper.register_parameter(p.key(), p.value(), p.value().requires_grad());
  }
  for (const auto& b : wrapped.named_buffers(/*recurse=*/false)) wrapper.register_buffer(b.key(), b.value());
  for (const auto& child : wrapped.named_children()) wrapper.register_module(child.key(), child.value());
  wrapper.train(wrapped.is_training());
}

}  // namespace ddp
