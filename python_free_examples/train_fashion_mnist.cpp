// The main job until the AMP-vs-FP32 benchmark lands: train the small CNN on Fashion-MNIST (real data from
// /usr/share/datasets/fashion-mnist, or --synthetic) and print loss, throughput and test accuracy.
#include <fmt/format.h>
#include <torch/torch.h>

#include "common/small_cnn.h"
#include "common/training.h"

int main(int argc, char** argv) {
  examples::CommonFlags flags;
  CLI::App app{"Train a small CNN on Fashion-MNIST with LibTorch (no Python)"};
  examples::add_common_flags(app, flags);
  if (const auto status = examples::parse_flags(app, argc, argv)) return *status;

  return examples::run_main("train_fashion_mnist", [&] {
    examples::check_common_flags(flags);
    examples::resume_from_checkpoint_dir(flags, examples::Rank{}, amp::check_archive_readable);
    torch::manual_seed(flags.seed);
    const torch::Device device = examples::pick_device(flags.device);
    const examples::Data data = examples::load_data(flags);
    examples::RunHeader header;
    header.where = "device " + device.str();
    header.precision = "fp32";
    header.optimizer = examples::sgd_description();
    const std::string header_line = examples::run_header_line(flags, data, header);
    fmt::print("{}\n", header_line);

    examples::SmallCnn model;
    model->to(device);
    torch::optim::SGD optimizer(model->parameters(),
                                torch::optim::SGDOptions(flags.lr).momentum(examples::kSgdMomentum));
    const int64_t train_samples = data.train.images.size(0);
    run::TrainingPosition position;
    if (!flags.resume.empty()) {
      const auto saved = examples::load_checkpoint(flags.resume, *model, optimizer);
      position = examples::resume_position(flags.resume, saved, flags, 1, train_samples, examples::Rank{});
    }
    auto forward = [&](const torch::Tensor& images) { return model->forward(images); };
    auto save = [&](const run::TrainingPosition& at) {
      examples::write_checkpoint(flags, at, examples::Rank{}, [&](const std::string& path) {
        examples::save_checkpoint(path, *model, optimizer, examples::capture_run_state(flags, 1, train_samples, at));
      });
    };
    examples::Loop loop;
    loop.step = [&](const torch::Tensor& images, const torch::Tensor& labels, run::StepPhases& phases) {
      optimizer.zero_grad();
      auto l = torch::cross_entropy_loss(forward(images), labels);
      phases.end(run::Phase::kForward);
      l.backward();
      phases.end(run::Phase::kBackward);
      optimizer.step();
      phases.end(run::Phase::kOptimizer);
      return l;
    };
    loop.observed.description = header_line;
    loop.observed.values = [&] { return run::step_values(optimizer); };
    loop.save = save;
    loop.end_epoch = [&](int64_t epoch, double loss) -> std::optional<double> {
      return examples::print_epoch_result(static_cast<int>(epoch), flags.epochs, loss,
                                          examples::test_accuracy(*model, forward, data.test, device));
    };
    const auto end = examples::train_epochs(flags, data.train, device, examples::Rank{}, position, loop);
    if (examples::final_save_needed(flags, position, end)) save(end);
  });
}
