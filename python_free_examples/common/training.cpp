#include "common/training.h"

#include <sys/stat.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <stdexcept>
#include <vector>

#include <amp/atomic_file.h>
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
  app.add_flag("--synthetic", flags.synthetic,
               "Use generated data with the same shapes instead of the data set (a learnable task: each class has its "
               "own pattern; training and test samples come from the same distribution)");
  app.add_option("--epochs", flags.epochs, "Epochs (> 0)");
  app.add_option("--batch-size", flags.batch_size, "Batch size per process (> 0)");
  app.add_option("--lr", flags.lr, "Learning rate (> 0, finite)");
  app.add_option("--seed", flags.seed, "Random seed (model initialization and synthetic data)");
  app.add_option("--limit-train", flags.limit_train, "Train on the first N samples only (0: all)");
  app.add_option("--device", flags.device, "auto, cpu, cuda or cuda:N");
  app.add_option("--save", flags.save, "Write a checkpoint here after training (rank 0), atomically");
  app.add_option("--resume", flags.resume, "Start from this checkpoint");
}

std::optional<int> parse_flags(CLI::App& app, int argc, char** argv) {
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    const std::string program = argc > 0 ? argv[0] : app.get_name();
    const size_t slash = program.rfind('/');
    std::fprintf(stderr, "%s: %s (see --help)\n", program.substr(slash == std::string::npos ? 0 : slash + 1).c_str(),
                 one_line(e.what()).c_str());
    return e.get_exit_code() != 0 ? e.get_exit_code() : 2;
  }
  return std::nullopt;
}

void require_positive(const char* flag, int64_t value) {
  if (value <= 0) throw std::invalid_argument(fmt::format("{} must be a positive integer, got {}", flag, value));
}

void check_common_flags(const CommonFlags& flags) {
  require_positive("--epochs", flags.epochs);
  require_positive("--batch-size", flags.batch_size);
  if (!(std::isfinite(flags.lr) && flags.lr > 0)) {
    throw std::invalid_argument(fmt::format("--lr must be a positive finite number, got {}", flags.lr));
  }
  if (flags.limit_train < 0) {
    throw std::invalid_argument(fmt::format("--limit-train must be 0 (all) or positive, got {}", flags.limit_train));
  }
  struct stat info {};
  if (!flags.resume.empty()) {
    if (::stat(flags.resume.c_str(), &info) != 0) {
      throw std::invalid_argument(fmt::format("--resume '{}': no such file", flags.resume));
    }
    if (!S_ISREG(info.st_mode)) throw std::invalid_argument(fmt::format("--resume '{}': not a file", flags.resume));
  }
  if (!flags.save.empty()) {
    // Checked now, not after an hour of training.
    const size_t slash = flags.save.rfind('/');
    const std::string folder = slash == std::string::npos ? "." : slash == 0 ? "/" : flags.save.substr(0, slash);
    if (::stat(folder.c_str(), &info) != 0 || !S_ISDIR(info.st_mode)) {
      throw std::invalid_argument(fmt::format("--save '{}': the folder '{}' does not exist", flags.save, folder));
    }
    if (::stat(flags.save.c_str(), &info) == 0 && S_ISDIR(info.st_mode)) {
      throw std::invalid_argument(fmt::format("--save '{}': it is a folder, not a file", flags.save));
    }
  }
}

Data load_data(const CommonFlags& flags) {
  Data data;
  if (flags.synthetic) {
    data.train = synthetic_fashion_mnist(kSyntheticTrain, flags.seed, /*train=*/true);
    data.test = synthetic_fashion_mnist(kSyntheticTest, flags.seed, /*train=*/false);
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
  std::optional<torch::Device> device;
  try {
    device.emplace(name);
  } catch (const c10::Error&) {
    throw std::invalid_argument(fmt::format("--device '{}' is not a device: use auto, cpu, cuda or cuda:N", name));
  }
  if (device->is_cpu()) return *device;
  if (!device->is_cuda()) {
    throw std::invalid_argument(fmt::format("--device '{}': the examples run on cpu or cuda", name));
  }
  const auto visible = static_cast<int64_t>(torch::cuda::device_count());
  if (visible == 0) {
    throw std::invalid_argument(fmt::format("--device {}: no CUDA GPU is visible (use --device cpu)", name));
  }
  const int64_t index = device->has_index() ? device->index() : local_rank;
  if (index >= visible) {
    throw std::invalid_argument(
        fmt::format("--device {}: cuda:{} asked for, but only {} CUDA GPU(s) are visible", name, index, visible));
  }
  return torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(index));
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
  amp::save_archive_atomically(archive, path);
  fmt::print("saved model and optimizer to {}\n", path);
}

void load_checkpoint(const std::string& path, torch::nn::Module& module, torch::optim::Optimizer& optimizer) {
  load_resume_checkpoint(path, [&] {
    torch::serialize::InputArchive archive, model_archive, optimizer_archive;
    try {
      archive.load_from(path);
    } catch (const c10::Error& e) {
      throw std::runtime_error(std::string("not a checkpoint (") + e.what_without_backtrace() + ")");
    }
    for (const auto& [key, part] : {std::pair<const char*, torch::serialize::InputArchive*>{"model", &model_archive},
                                    {"optimizer", &optimizer_archive}}) {
      if (!archive.try_read(key, *part)) {
        throw std::runtime_error(fmt::format("no '{}' part: not a checkpoint written by --save of this example", key));
      }
    }
    module.load(model_archive);
    optimizer.load(optimizer_archive);
  });
}

void load_resume_checkpoint(const std::string& path, const std::function<void()>& load) {
  try {
    load();
  } catch (const c10::Error& e) {
    throw std::invalid_argument(fmt::format("--resume '{}': {}", path, one_line(e.what_without_backtrace())));
  } catch (const std::exception& e) {
    throw std::invalid_argument(fmt::format("--resume '{}': {}", path, one_line(e.what())));
  }
}

std::string one_line(const std::string& message) {
  // LibTorch appends its backtrace to what(); a message that embeds another error's what() carries it along.
  std::string text = message.substr(0, message.find("\nException raised from"));
  while (!text.empty() && (text.back() == '\n' || text.back() == ' ')) text.pop_back();
  std::string out;
  for (const char c : text) {
    const auto byte = static_cast<unsigned char>(c);
    if (byte == '\n') {
      out += "; ";
    } else if (byte == '\t') {
      out += ' ';
    } else if (byte < 0x20 || byte >= 0x7f) {
      out += fmt::format("\\x{:02x}", byte);
    } else {
      out += c;
    }
  }
  return out;
}

int run_main(const char* program, const std::function<void()>& body) {
  try {
    body();
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "%s: %s\n", program, one_line(e.what_without_backtrace()).c_str());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: %s\n", program, one_line(e.what()).c_str());
    return 1;
  }
  return 0;
}

}  // namespace examples
