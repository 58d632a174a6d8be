// The main job until the AMP-vs-FP32 benchmark lands: train the small CNN on Fashion-MNIST (real data from
// /usr/share/datasets/fashion-mnist, or --synthetic) and print loss, throughput and test accuracy.
#include <chrono>
#include <cstdio>
#include <string>

#include <fmt/format.h>
#include <torch/torch.h>
#include <CLI/CLI.hpp>

#include "common/fashion_mnist.h"
#include "common/small_cnn.h"

namespace {

struct Flags {
  std::string data_dir = examples::kDefaultFashionMnistDir;
  bool synthetic = false;
  int epochs = 1;
  int64_t batch_size = 128;
  double lr = 0.05;
  uint64_t seed = 0;
  int64_t limit_train = 0;  // 0: the whole training split
  std::string device = "auto";
};

torch::Device pick_device(const std::string& name) {
  if (name == "auto") return torch::cuda::is_available() ? torch::Device(torch::kCUDA) : torch::Device(torch::kCPU);
  return torch::Device(name);
}

double accuracy(examples::SmallCnn& model, const examples::ImageSplit& split, int64_t batch_size,
                const torch::Device& device) {
  torch::NoGradGuard no_grad;
  model->eval();
  int64_t correct = 0;
  const int64_t n = split.images.size(0);
  for (int64_t begin = 0; begin < n; begin += batch_size) {
    const int64_t end = std::min(n, begin + batch_size);
    auto logits = model->forward(split.images.slice(0, begin, end).to(device));
    correct += logits.argmax(1).eq(split.labels.slice(0, begin, end).to(device)).sum().item<int64_t>();
  }
  model->train();
  return static_cast<double>(correct) / static_cast<double>(n);
}

}  // namespace

int main(int argc, char** argv) {
  Flags flags;
  CLI::App app{"Train a small CNN on Fashion-MNIST with LibTorch (no Python)"};
  app.add_option("--data", flags.data_dir, "Folder with the Fashion-MNIST IDX files (.gz or not)");
  app.add_flag("--synthetic", flags.synthetic, "Use generated data with the same shapes instead of the data set");
  app.add_option("--epochs", flags.epochs, "Epochs")->check(CLI::PositiveNumber);
  app.add_option("--batch-size", flags.batch_size, "Batch size")->check(CLI::PositiveNumber);
  app.add_option("--lr", flags.lr, "SGD learning rate")->check(CLI::PositiveNumber);
  app.add_option("--seed", flags.seed, "Random seed");
  app.add_option("--limit-train", flags.limit_train, "Train on the first N samples only (0: all)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--device", flags.device, "auto, cpu, cuda or cuda:N");
  CLI11_PARSE(app, argc, argv);

  try {
    torch::manual_seed(flags.seed);
    const torch::Device device = pick_device(flags.device);
    examples::ImageSplit train, test;
    if (flags.synthetic) {
      train = examples::synthetic_fashion_mnist(6000, flags.seed);
      test = examples::synthetic_fashion_mnist(1000, flags.seed + 1);
    } else {
      train = examples::load_fashion_mnist(flags.data_dir, /*train=*/true);
      test = examples::load_fashion_mnist(flags.data_dir, /*train=*/false);
    }
    if (flags.limit_train > 0 && flags.limit_train < train.images.size(0)) {
      train.images = train.images.slice(0, 0, flags.limit_train);
      train.labels = train.labels.slice(0, 0, flags.limit_train);
    }
    const int64_t n_train = train.images.size(0);
    fmt::print("device {} | {} training samples, {} test samples | {} epoch(s), batch {}, lr {}\n", device.str(),
               n_train, test.images.size(0), flags.epochs, flags.batch_size, flags.lr);

    examples::SmallCnn model;
    model->to(device);
    torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(flags.lr).momentum(0.9));
    for (int epoch = 1; epoch <= flags.epochs; ++epoch) {
      const auto start = std::chrono::steady_clock::now();
      auto order = torch::randperm(n_train, torch::kInt64);
      double loss_sum = 0.0;
      int64_t batches = 0;
      for (int64_t begin = 0; begin < n_train; begin += flags.batch_size) {
        auto idx = order.slice(0, begin, std::min(n_train, begin + flags.batch_size));
        auto images = train.images.index_select(0, idx).to(device, /*non_blocking=*/true);
        auto labels = train.labels.index_select(0, idx).to(device, /*non_blocking=*/true);
        optimizer.zero_grad();
        auto loss = torch::cross_entropy_loss(model->forward(images), labels);
        loss.backward();
        optimizer.step();
        loss_sum += loss.item<double>();
        ++batches;
      }
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      fmt::print("epoch {}/{}: mean loss {:.4f} | {:.0f} samples/s | test accuracy {:.2f}%\n", epoch, flags.epochs,
                 loss_sum / static_cast<double>(batches), static_cast<double>(n_train) / seconds,
                 100.0 * accuracy(model, test, 1000, device));
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "train_fashion_mnist: %s\n", e.what());
    return 1;
  }
  return 0;
}
