#include "common/training.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

#include <fmt/format.h>

namespace examples {

namespace {
constexpr int64_t kSyntheticTrain = 6000;
constexpr int64_t kSyntheticTest = 1000;
constexpr int64_t kEvalBatch = 1000;
constexpr int kProgressWidth = 30;    // characters of the bar
constexpr int kProgressUpdates = 20;  // redraws per epoch: often enough to watch, rare enough to be cheap
}  // namespace

void add_common_flags(CLI::App& app, CommonFlags& flags) {
  app.add_option("--data", flags.data_dir, "Folder with the Fashion-MNIST IDX files (.gz or not)");
  app.add_flag("--synthetic", flags.synthetic, "Use generated data with the same shapes instead of the data set");
  app.add_option("--epochs", flags.epochs, "Epochs")->check(CLI::PositiveNumber);
  app.add_option("--batch-size", flags.batch_size, "Batch size per process")->check(CLI::PositiveNumber);
  app.add_option("--lr", flags.lr, "Learning rate")->check(CLI::PositiveNumber);
  app.add_option("--seed", flags.seed, "Random seed (model initialization and synthetic data)");
  app.add_option("--limit-train", flags.limit_train, "Train on the first N samples only (0: all)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--device", flags.device, "auto, cpu, cuda or cuda:N");
  app.add_option("--save", flags.save, "Write a checkpoint here after training (rank 0)");
  app.add_option("--resume", flags.resume, "Start from this checkpoint")->check(CLI::ExistingFile);
}

Data load_data(const CommonFlags& flags) {
  Data data;
  if (flags.synthetic) {
    data.train = synthetic_fashion_mnist(kSyntheticTrain, flags.seed);
    data.test = synthetic_fashion_mnist(kSyntheticTest, flags.seed + 1);
  } else {
    data.train = load_fashion_mnist(flags.data_dir, /*train=*/true);
    data.test = load_fashion_mnist(flags.data_dir, /*train=*/false);
  }
  if (flags.limit_train > 0 && flags.limit_train < data.train.images.size(0)) {
    data.train.images = data.train.images.slice(0, 0, flags.limit_train);
    data.train.labels = data.train.labels.slice(0, 0, flags.limit_train);
  }
  return data;
}

torch::Device pick_device(const std::string& name, int local_rank) {
  if (name == "auto") {
    return torch::cuda::is_available() ? torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(local_rank))
                                       : torch::Device(torch::kCPU);
  }
  return torch::Device(name);
}

double train_epoch(const ImageSplit& train, int epoch, int epochs, int64_t batch_size, const torch::Device& device,
                   const Rank& rank, const StepFn& step) {
  const auto n = static_cast<size_t>(train.images.size(0));
  torch::data::samplers::DistributedRandomSampler sampler(n, static_cast<size_t>(rank.world_size),
                                                          static_cast<size_t>(rank.rank));
  sampler.set_epoch(static_cast<size_t>(epoch));
  sampler.reset();
  const std::vector<size_t> shard = sampler.next(n).value_or(std::vector<size_t>{});
  std::vector<int64_t> shard64(shard.begin(), shard.end());
  const auto order = torch::tensor(shard64, torch::kInt64);
  const auto local = static_cast<int64_t>(shard64.size());
  const int64_t steps = (local + batch_size - 1) / batch_size;
  const int64_t redraw_every = std::max<int64_t>(1, steps / kProgressUpdates);

  const auto start = std::chrono::steady_clock::now();
  double loss_sum = 0.0;
  for (int64_t s = 0; s < steps; ++s) {
    auto idx = order.slice(0, s * batch_size, std::min(local, (s + 1) * batch_size));
    auto images = train.images.index_select(0, idx).to(device, /*non_blocking=*/true);
    auto labels = train.labels.index_select(0, idx).to(device, /*non_blocking=*/true);
    loss_sum += step(images, labels).item<double>();  // the progress line needs it; one sync per step
    if (rank.rank == 0 && ((s + 1) % redraw_every == 0 || s + 1 == steps)) {
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      const auto seen = static_cast<double>(std::min(local, (s + 1) * batch_size) * rank.world_size);
      const int filled = static_cast<int>(kProgressWidth * (s + 1) / steps);
      fmt::print("\repoch {}/{} [{}{}] {}/{} loss {:.4f} | {:.0f} samples/s", epoch, epochs, std::string(filled, '#'),
                 std::string(kProgressWidth - filled, '.'), s + 1, steps, loss_sum / static_cast<double>(s + 1),
                 seen / seconds);
      std::fflush(stdout);
    }
  }
  if (rank.rank == 0) fmt::print("\n");
  return steps > 0 ? loss_sum / static_cast<double>(steps) : 0.0;
}

double test_accuracy(torch::nn::Module& module, const std::function<torch::Tensor(const torch::Tensor&)>& forward,
                     const ImageSplit& split, const torch::Device& device) {
  torch::NoGradGuard no_grad;
  module.eval();
  int64_t correct = 0;
  const int64_t n = split.images.size(0);
  for (int64_t begin = 0; begin < n; begin += kEvalBatch) {
    const int64_t end = std::min(n, begin + kEvalBatch);
    auto logits = forward(split.images.slice(0, begin, end).to(device));
    correct += logits.argmax(1).eq(split.labels.slice(0, begin, end).to(logits.device())).sum().item<int64_t>();
  }
  module.train();
  return static_cast<double>(correct) / static_cast<double>(n);
}

void print_epoch_result(int epoch, int epochs, double mean_loss, double accuracy) {
  fmt::print("epoch {}/{}: mean loss {:.4f} | test accuracy {:.2f}%\n", epoch, epochs, mean_loss, 100.0 * accuracy);
}

void save_checkpoint(const std::string& path, torch::nn::Module& module, torch::optim::Optimizer& optimizer) {
  torch::serialize::OutputArchive archive, model_archive, optimizer_archive;
  module.save(model_archive);
  optimizer.save(optimizer_archive);
  archive.write("model", model_archive);
  archive.write("optimizer", optimizer_archive);
  archive.save_to(path);
  fmt::print("saved model and optimizer to {}\n", path);
}

void load_checkpoint(const std::string& path, torch::nn::Module& module, torch::optim::Optimizer& optimizer) {
  torch::serialize::InputArchive archive, model_archive, optimizer_archive;
  archive.load_from(path);
  archive.read("model", model_archive);
  archive.read("optimizer", optimizer_archive);
  module.load(model_archive);
  optimizer.load(optimizer_archive);
}

int run_main(const char* program, const std::function<void()>& body) {
  try {
    body();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: %s\n", program, e.what());
    return 1;
  }
  return 0;
}

}  // namespace examples
