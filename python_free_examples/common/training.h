#pragma once

// What the four "ways" examples share: the flag set, the data, the epoch loop with its progress line, test
// accuracy, and checkpoints. Each example keeps only what makes its way different.

#include <cstdint>
#include <functional>
#include <string>

#include <torch/torch.h>
#include <CLI/CLI.hpp>

#include "common/fashion_mnist.h"

namespace examples {

/// SGD momentum of every example's plain SGD (and amp_ddp's FusedSGD).
constexpr double kSgdMomentum = 0.9;

/// The flags every example takes (--epochs, --batch-size, --lr, --seed, --device, --synthetic, --data,
/// --limit-train, --save, --resume).
struct CommonFlags {
  std::string data_dir = kDefaultFashionMnistDir;
  bool synthetic = false;
  int epochs = 1;
  int64_t batch_size = 128;  // per process
  double lr = 0.05;
  uint64_t seed = 0;
  int64_t limit_train = 0;  // 0: the whole training split
  std::string device = "auto";
  std::string save;    // checkpoint written after the last epoch (rank 0); empty: none
  std::string resume;  // checkpoint read before training; empty: start fresh
};

/// Registers CommonFlags on `app`.
void add_common_flags(CLI::App& app, CommonFlags& flags);

/// The training and test splits the flags ask for (the data set, or --synthetic), the training split cut to
/// --limit-train. Throws with the path and a hint when the data set is missing.
struct Data {
  ImageSplit train;
  ImageSplit test;
};
Data load_data(const CommonFlags& flags);

/// "auto": cuda:`local_rank` when CUDA is available, else the CPU; otherwise the device named ("cpu", "cuda:1").
torch::Device pick_device(const std::string& name, int local_rank = 0);

/// One training step on a batch already on the device: zero the gradients, forward, backward, optimizer step.
/// Returns the loss (any device, one element).
using StepFn = std::function<torch::Tensor(const torch::Tensor& images, const torch::Tensor& labels)>;

/// Where this process stands in the job: its shard of each epoch and whether it prints.
struct Rank {
  int rank = 0;
  int world_size = 1;
};

/// Runs one epoch over this rank's shard of `train` (torch::data::samplers::DistributedRandomSampler with
/// set_epoch(epoch), so every rank shuffles alike and the shards are disjoint), in batches of `batch_size`
/// moved to `device`. Rank 0 prints a progress line with the mean loss and the job's samples/s (all ranks).
/// Returns the mean loss of this rank's batches.
double train_epoch(const ImageSplit& train, int epoch, int epochs, int64_t batch_size, const torch::Device& device,
                   const Rank& rank, const StepFn& step);

/// Fraction of `split` that `forward` classifies correctly, in eval mode on `module` (restored to train mode
/// after). Local: no collectives.
double test_accuracy(torch::nn::Module& module, const std::function<torch::Tensor(const torch::Tensor&)>& forward,
                     const ImageSplit& split, const torch::Device& device);

/// Prints "epoch E/N: ... test accuracy X%" (rank 0's line after its progress line).
void print_epoch_result(int epoch, int epochs, double mean_loss, double accuracy);

/// Saves / loads `module` and `optimizer` (a plain torch::optim optimizer) to / from one file.
void save_checkpoint(const std::string& path, torch::nn::Module& module, torch::optim::Optimizer& optimizer);
void load_checkpoint(const std::string& path, torch::nn::Module& module, torch::optim::Optimizer& optimizer);

/// Runs `body` and turns an exception into "program: message" on stderr and exit status 1.
int run_main(const char* program, const std::function<void()>& body);

}  // namespace examples
