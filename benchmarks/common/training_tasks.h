#pragma once

// The two training jobs of the AMP benchmark. A task owns its data (on the device, fixed order from the seed),
// builds an identically initialized model and optimizer for every run, and scores a trained model, so every
// precision configuration trains the same model on the same batches in the same order.

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include <torch/torch.h>

#include "common/fashion_mnist.h"
#include "common/peer_bundle.h"
#include "common/small_cnn.h"
#include "common/tiny_transformer.h"

namespace bench {

struct Batch {
  torch::Tensor input;
  torch::Tensor target;
};

/// Inference under a run's precision: input batch -> fp32 logits.
using ForwardFn = std::function<torch::Tensor(const torch::Tensor&)>;

/// Small CNN on Fashion-MNIST (python_free_examples/common), SGD with momentum.
class CnnTask {
 public:
  using Net = examples::SmallCnn;
  struct Settings {
    std::string data_dir = examples::kDefaultFashionMnistDir;
    bool synthetic = false;     // true: generated data; false: the data set, or generated data if it is missing
    int64_t train_samples = 0;  // 0: the whole training split
    int64_t test_samples = 0;   // 0: the whole test split
    int64_t epochs = 1;
    int64_t max_steps = 0;  // > 0: stop after this many steps
    int64_t batch_size = 128;
    double lr = 0.05;
    uint64_t seed = 0;
  };
  CnnTask(const Settings& settings, const torch::Device& device);

  std::string name() const { return "cnn"; }
  /// One line: data source, sizes, batch, steps, optimizer.
  std::string description() const;
  /// Whether the real data set was read (false: synthetic, by request or because it is missing).
  bool real_data() const { return real_data_; }
  Net make_model() const;
  std::unique_ptr<torch::optim::Optimizer> make_optimizer(Net& net) const;
  int64_t num_steps() const { return num_steps_; }
  int64_t samples_per_step() const { return settings_.batch_size; }
  Batch batch(int64_t step) const;
  /// logits: fp32 [batch, 10].
  torch::Tensor loss(const torch::Tensor& logits, const Batch& batch) const;
  /// Test-set accuracy in [0, 1] of `forward` (called under NoGradGuard, model in eval mode).
  double accuracy(const ForwardFn& forward) const;
  const Settings& settings() const { return settings_; }
  /// What a peer needs to build exactly our batches and score exactly our test set (CPU copies): train_images,
  /// train_labels, test_images, test_labels, and order (the sample index of every step's batch, num_steps() *
  /// batch_size of them): batch(step) is train_images/labels.index_select(0, order[step * batch : (step+1) * batch]).
  NamedTensors peer_data() const;

 private:
  Settings settings_;
  torch::Device device_;
  bool real_data_ = false;
  examples::ImageSplit train_, test_;  // on device_
  torch::Tensor order_;                // sample index of every step's batch, concatenated epochs
  int64_t num_steps_ = 0;
};

/// TinyTransformer on synthetic bigram tokens, next-token cross-entropy, AdamW.
class TransformerTask {
 public:
  using Net = TinyTransformer;
  struct Settings {
    TinyTransformerOptions model;
    int64_t steps = 40;
    int64_t batch_size = 16;       // sequences per step
    int64_t eval_sequences = 256;  // held-out sequences for next-token accuracy
    double lr = 1e-3;
    uint64_t seed = 0;
  };
  TransformerTask(const Settings& settings, const torch::Device& device);

  std::string name() const { return "transformer"; }
  std::string description() const;
  Net make_model() const;
  std::unique_ptr<torch::optim::Optimizer> make_optimizer(Net& net) const;
  int64_t num_steps() const { return settings_.steps; }
  int64_t samples_per_step() const { return settings_.batch_size; }
  Batch batch(int64_t step) const;
  /// logits: fp32 [batch, seq, vocab].
  torch::Tensor loss(const torch::Tensor& logits, const Batch& batch) const;
  /// Next-token accuracy in [0, 1] on held-out sequences.
  double accuracy(const ForwardFn& forward) const;
  /// On the held-out sequences: the mean next-token cross-entropy (nats) and the next-token accuracy in [0, 1].
  struct HeldOut {
    double loss = 0;
    double accuracy = 0;
  };
  HeldOut held_out(const ForwardFn& forward) const;
  /// The lowest mean next-token cross-entropy any model can reach on this data: the entropy of the bigram rule's
  /// next-token distribution (synthetic_token_sequences: the rule's successor with probability p + (1 - p) / V, each
  /// other token (1 - p) / V).
  double loss_floor() const;
  const Settings& settings() const { return settings_; }
  /// What a peer needs (CPU copies): train_tokens [steps * batch, seq_len + 1], step s using rows
  /// [s * batch, (s+1) * batch) (input: the first seq_len columns, target: the last seq_len), and eval_tokens.
  NamedTensors peer_data() const;

 private:
  Settings settings_;
  torch::Device device_;
  torch::Tensor train_tokens_, eval_tokens_;  // [n, seq_len + 1] int64 on device_
};

}  // namespace bench
