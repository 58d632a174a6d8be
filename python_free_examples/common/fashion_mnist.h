#pragma once

#include <string>
#include <utility>

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

namespace examples {

/// Where the Debian package dataset-fashion-mnist puts the data.
inline const char* kDefaultFashionMnistDir = "/usr/share/datasets/fashion-mnist";

/// One split of Fashion-MNIST (or MNIST: same IDX format): images [N, 1, 28, 28] float32 scaled to [0, 1]
/// and normalized by the split's mean/std, labels [N] int64 in [0, 9].
struct ImageSplit {
  torch::Tensor images;
  torch::Tensor labels;

  /// The samples at `indices` (int64, a run::DistributedSampler batch), copied to `device`: {images, labels}.
  std::pair<torch::Tensor, torch::Tensor> batch(const torch::Tensor& indices, const torch::Device& device) const {
    return {images.index_select(0, indices).to(device, /*non_blocking=*/true),
            labels.index_select(0, indices).to(device, /*non_blocking=*/true)};
  }
};

/// Reads an IDX file (`*-idx3-ubyte` images or `*-idx1-ubyte` labels), gzip-compressed or not, into a uint8
/// tensor shaped as the file says. Throws naming the path when the file is missing, truncated, or not IDX.
torch::Tensor read_idx_file(const std::string& path);

/// Loads `train` (60k) or `test` (10k) from `dir` (train-images-idx3-ubyte[.gz] and so on). Throws with the
/// path and a hint (apt-get install dataset-fashion-mnist, or --synthetic) when the files are missing.
ImageSplit load_fashion_mnist(const std::string& dir, bool train);

/// A deterministic synthetic stand-in with Fashion-MNIST's shapes, for machines without the data set: `n` images
/// [n, 1, 28, 28] float32 with labels [n] int64 in [0, 9]. The task is learnable and about as hard for the examples'
/// CNN as Fashion-MNIST (Note [synthetic difficulty]): classes in Fashion-MNIST's groups (tops, footwear, three
/// alone), each a smooth pattern drawn from `seed`, seen at random contrast and shift under pixel noise, 5% of the
/// labels random. The training split (`train`) and the test split share the patterns (the same `seed`) and differ
/// only in which samples are drawn, so accuracy on the test split measures what was learned on the training split.
ImageSplit synthetic_fashion_mnist(int64_t n, uint64_t seed, bool train);

}  // namespace examples
