#pragma once

#include <torch/torch.h>

namespace examples {

/// The tutorial's "model = ...": a small CNN for 28x28 grey images, 10 classes.
/// conv(1->32,3) BN ReLU pool, conv(32->64,3) BN ReLU pool, fc(64*7*7 -> 128) ReLU, fc(128 -> 10).
/// Cloneable so that torch::nn::parallel::data_parallel can replicate it onto each GPU.
struct SmallCnnImpl : torch::nn::Cloneable<SmallCnnImpl> {
  SmallCnnImpl();
  /// Builds (or, in a clone, rebuilds) the layers; Cloneable::clone() calls it on the copy.
  void reset() override;
  torch::Tensor forward(torch::Tensor x);

  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr};
  torch::nn::BatchNorm2d bn1{nullptr}, bn2{nullptr};
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(SmallCnn);

}  // namespace examples
