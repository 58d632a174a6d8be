#include "common/training_tasks.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include <ATen/CPUGeneratorImpl.h>
#include <fmt/format.h>

namespace bench {
namespace {

/// Test images scored per forward call: large enough to be cheap, small enough for any device.
constexpr int64_t kEvalBatch = 1000;
/// Fashion-MNIST's split sizes, used for the synthetic stand-in too.
constexpr int64_t kFashionTrainSize = 60000;
constexpr int64_t kFashionTestSize = 10000;

examples::ImageSplit first(examples::ImageSplit split, int64_t n) {
  if (n > 0 && n < split.images.size(0)) {
    split.images = split.images.slice(0, 0, n);
    split.labels = split.labels.slice(0, 0, n);
  }
  return split;
}

examples::ImageSplit to_device(const examples::ImageSplit& split, const torch::Device& device) {
  return {split.images.to(device).contiguous(), split.labels.to(device).contiguous()};
}

}  // namespace

CnnTask::CnnTask(const Settings& settings, const torch::Device& device) : settings_(settings), device_(device) {
  TORCH_CHECK(settings.batch_size > 0 && settings.epochs > 0, "cnn: batch_size and epochs must be > 0, got ",
              settings.batch_size, " and ", settings.epochs);
  examples::ImageSplit train, test;
  if (!settings.synthetic) {
    try {
      train = examples::load_fashion_mnist(settings.data_dir, /*train=*/true);
      test = examples::load_fashion_mnist(settings.data_dir, /*train=*/false);
      real_data_ = true;
    } catch (const c10::Error& e) {
      fmt::print(
          "NOTE: Fashion-MNIST could not be read ({}).\n      The CNN trains on SYNTHETIC data instead; its "
          "accuracy says nothing about Fashion-MNIST.\n",
          e.what_without_backtrace());
    }
  }
  if (!real_data_) {
    train = examples::synthetic_fashion_mnist(settings.train_samples > 0 ? settings.train_samples : kFashionTrainSize,
                                              settings.seed, /*train=*/true);
    test = examples::synthetic_fashion_mnist(settings.test_samples > 0 ? settings.test_samples : kFashionTestSize,
                                             settings.seed, /*train=*/false);
  }
  train_ = to_device(first(train, settings.train_samples), device);
  test_ = to_device(first(test, settings.test_samples), device);

  // Full batches only (drop_last): every step has the same shape in every run.
  const int64_t n_train = train_.images.size(0);
  const int64_t steps_per_epoch = n_train / settings.batch_size;
  TORCH_CHECK(steps_per_epoch > 0, "cnn: ", n_train, " training samples do not fill one batch of ",
              settings.batch_size);
  std::vector<torch::Tensor> epochs;
  for (int64_t e = 0; e < settings.epochs; ++e) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(settings.seed + 1000 + static_cast<uint64_t>(e));
    epochs.push_back(torch::randperm(n_train, gen, torch::kInt64).slice(0, 0, steps_per_epoch * settings.batch_size));
  }
  order_ = torch::cat(epochs).to(device);
  num_steps_ = settings.epochs * steps_per_epoch;
  if (settings.max_steps > 0) num_steps_ = std::min(num_steps_, settings.max_steps);
}

std::string CnnTask::description() const {
  return fmt::format("small CNN on {} ({} train / {} test images), batch {}, {} steps, SGD lr {} momentum 0.9",
                     real_data_ ? "Fashion-MNIST" : "SYNTHETIC Fashion-MNIST-shaped data", train_.images.size(0),
                     test_.images.size(0), settings_.batch_size, num_steps_, settings_.lr);
}

CnnTask::Net CnnTask::make_model() const {
  torch::manual_seed(settings_.seed);
  Net net;
  net->to(device_);
  return net;
}

std::unique_ptr<torch::optim::Optimizer> CnnTask::make_optimizer(Net& net) const {
  return std::make_unique<torch::optim::SGD>(net->parameters(), torch::optim::SGDOptions(settings_.lr).momentum(0.9));
}

Batch CnnTask::batch(int64_t step) const {
  auto idx = order_.slice(0, step * settings_.batch_size, (step + 1) * settings_.batch_size);
  return {train_.images.index_select(0, idx), train_.labels.index_select(0, idx)};
}

NamedTensors CnnTask::peer_data() const {
  return {{"train_images", train_.images.cpu()},
          {"train_labels", train_.labels.cpu()},
          {"test_images", test_.images.cpu()},
          {"test_labels", test_.labels.cpu()},
          {"order", order_.slice(0, 0, num_steps_ * settings_.batch_size).cpu()}};
}

torch::Tensor CnnTask::loss(const torch::Tensor& logits, const Batch& batch) const {
  return torch::cross_entropy_loss(logits, batch.target);
}

double CnnTask::accuracy(const ForwardFn& forward) const {
  const int64_t n = test_.images.size(0);
  auto correct = torch::zeros({}, torch::TensorOptions().dtype(torch::kInt64).device(device_));
  for (int64_t begin = 0; begin < n; begin += kEvalBatch) {
    const int64_t end = std::min(n, begin + kEvalBatch);
    auto logits = forward(test_.images.slice(0, begin, end));
    correct += logits.argmax(1).eq(test_.labels.slice(0, begin, end)).sum();
  }
  return static_cast<double>(correct.item<int64_t>()) / static_cast<double>(n);
}

TransformerTask::TransformerTask(const Settings& settings, const torch::Device& device)
    : settings_(settings), device_(device) {
  TORCH_CHECK(settings.steps > 0 && settings.batch_size > 0, "transformer: steps and batch_size must be > 0, got ",
              settings.steps, " and ", settings.batch_size);
  const auto& m = settings.model;
  // One fixed rule for training and held-out sequences; different draws from it.
  auto all = synthetic_token_sequences(settings.steps * settings.batch_size + settings.eval_sequences, m.seq_len(),
                                       m.vocab_size(), settings.seed);
  train_tokens_ = all.slice(0, 0, settings.steps * settings.batch_size).to(device);
  eval_tokens_ = all.slice(0, settings.steps * settings.batch_size).to(device);
}

std::string TransformerTask::description() const {
  const auto& m = settings_.model;
  return fmt::format(
      "transformer ({} pre-LN blocks, d_model {}, {} heads, vocab {}) on synthetic bigram tokens, {} x {} tokens "
      "per step, {} steps, AdamW lr {}{}",
      m.num_layers(), m.d_model(), m.num_heads(), m.vocab_size(), settings_.batch_size, m.seq_len(), settings_.steps,
      settings_.lr, m.activation_checkpointing() ? ", activation checkpointing per block" : "");
}

TransformerTask::Net TransformerTask::make_model() const {
  torch::manual_seed(settings_.seed);
  Net net(settings_.model);
  net->to(device_);
  return net;
}

std::unique_ptr<torch::optim::Optimizer> TransformerTask::make_optimizer(Net& net) const {
  return std::make_unique<torch::optim::AdamW>(net->parameters(), torch::optim::AdamWOptions(settings_.lr));
}

Batch TransformerTask::batch(int64_t step) const {
  auto rows = train_tokens_.slice(0, step * settings_.batch_size, (step + 1) * settings_.batch_size);
  const int64_t seq = settings_.model.seq_len();
  return {rows.slice(1, 0, seq), rows.slice(1, 1, seq + 1)};
}

NamedTensors TransformerTask::peer_data() const {
  return {{"train_tokens", train_tokens_.cpu()}, {"eval_tokens", eval_tokens_.cpu()}};
}

torch::Tensor TransformerTask::loss(const torch::Tensor& logits, const Batch& batch) const {
  return torch::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}), batch.target.reshape({-1}));
}

double TransformerTask::accuracy(const ForwardFn& forward) const { return held_out(forward).accuracy; }

TransformerTask::HeldOut TransformerTask::held_out(const ForwardFn& forward) const {
  const int64_t seq = settings_.model.seq_len();
  auto correct = torch::zeros({}, torch::TensorOptions().dtype(torch::kInt64).device(device_));
  auto loss_sum = torch::zeros({}, torch::TensorOptions().dtype(torch::kDouble).device(device_));
  const int64_t n = eval_tokens_.size(0);
  for (int64_t begin = 0; begin < n; begin += settings_.batch_size) {
    auto rows = eval_tokens_.slice(0, begin, std::min(n, begin + settings_.batch_size));
    const auto logits = forward(rows.slice(1, 0, seq)).to(torch::kFloat);
    const auto target = rows.slice(1, 1, seq + 1);
    correct += logits.argmax(-1).eq(target).sum();
    loss_sum +=
        torch::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}), target.reshape({-1}), {}, at::Reduction::Sum)
            .to(torch::kDouble);
  }
  const auto tokens = static_cast<double>(n * seq);
  return {loss_sum.item<double>() / tokens, static_cast<double>(correct.item<int64_t>()) / tokens};
}

double TransformerTask::loss_floor() const {
  const double v = static_cast<double>(settings_.model.vocab_size());
  const double other = (1.0 - kBigramRuleProbability) / v;
  const double rule = kBigramRuleProbability + other;
  return -rule * std::log(rule) - (v - 1) * other * std::log(other);
}

}  // namespace bench
