#pragma once

// What the four "ways" examples share: the flag set, the data, the epoch loop with its progress line, test
// accuracy, and checkpoints. Each example keeps only what makes its way different.

#include <cstdint>
#include <functional>
#include <optional>
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

/// Registers CommonFlags on `app`. Values are checked after parsing by check_common_flags (CLI11's own range
/// checks print "Value 0 not in range 0.000000 to 1797...", a 300-digit bound).
void add_common_flags(CLI::App& app, CommonFlags& flags);

/// Parses the command line into `app`'s options. Returns nullopt to go on; otherwise the exit status: 0 after
/// --help (printed on stdout), non-zero after a bad command line, reported as one line on stderr
/// ("program: message (see --help)").
std::optional<int> parse_flags(CLI::App& app, int argc, char** argv);

/// Checks what CLI11 cannot say well: --epochs and --batch-size positive, --lr positive and finite, --limit-train
/// not negative, --resume an existing file, --save's folder existing. Throws std::invalid_argument naming the flag
/// and its value. Called before anything is loaded or written.
void check_common_flags(const CommonFlags& flags);

/// Throws std::invalid_argument("<flag> must be a positive integer, got <value>") unless value > 0.
void require_positive(const char* flag, int64_t value);

/// The training and test splits the flags ask for (the data set, or --synthetic), the training split cut to
/// --limit-train. Throws with the path and a hint when the data set is missing.
struct Data {
  ImageSplit train;
  ImageSplit test;
};
Data load_data(const CommonFlags& flags);

/// "auto": cuda:`local_rank` when CUDA is available, else the CPU; "cuda" alone: cuda:`local_rank`; otherwise the
/// device named ("cpu", "cuda:1"). Throws std::invalid_argument naming --device when the name is not a device,
/// when no CUDA GPU is visible, or when the GPU's index is not below the number visible.
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

/// Saves `module` and `optimizer` (a plain torch::optim optimizer) to one file, atomically
/// (amp::save_archive_atomically): a writer stopped at any point leaves the previous file whole.
void save_checkpoint(const std::string& path, torch::nn::Module& module, torch::optim::Optimizer& optimizer);
/// Loads what save_checkpoint wrote. A file that is not such a checkpoint (random bytes, truncated, another
/// model) throws std::invalid_argument "--resume 'path': ..." with the reason's first line.
void load_checkpoint(const std::string& path, torch::nn::Module& module, torch::optim::Optimizer& optimizer);

/// Runs `load` (which reads the --resume checkpoint `path`) and re-throws its failure as one line naming --resume
/// and the path: "--resume 'path': <what was wrong>".
void load_resume_checkpoint(const std::string& path, const std::function<void()>& load);

/// `message` as one printable line: a LibTorch backtrace nested in it ("Exception raised from ... frame #0")
/// is cut, line breaks become "; ", and bytes outside printable ASCII are written as \xNN.
std::string one_line(const std::string& message);

/// Runs `body` and turns an exception into "program: message" on stderr (one line: one_line of the message
/// without LibTorch's backtrace) and exit status 1.
int run_main(const char* program, const std::function<void()>& body);

}  // namespace examples
