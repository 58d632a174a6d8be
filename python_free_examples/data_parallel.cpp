// The tutorial's first way: one process, the model replicated over all visible GPUs each step
// (torch::nn::parallel::data_parallel, PyTorch's nn.DataParallel): the batch is split across the GPUs and the
// outputs gathered on --output-device.
//   ./data_parallel --synthetic --output-device 0
// Without GPUs it says so and trains on the CPU.
#include <optional>
#include <vector>

#include <fmt/format.h>
#include <torch/nn/parallel/data_parallel.h>

#include "common/small_cnn.h"
#include "common/training.h"

int main(int argc, char** argv) {
  examples::CommonFlags flags;
  int output_device = 0;
  CLI::App app{"Single-process data parallel training on Fashion-MNIST over all visible GPUs"};
  examples::add_common_flags(app, flags);
  app.add_option("--output-device", output_device, "GPU index that gathers the outputs")->check(CLI::NonNegativeNumber);
  CLI11_PARSE(app, argc, argv);

  return examples::run_main("data_parallel", [&] {
    torch::manual_seed(flags.seed);
    const int gpus = flags.device == "cpu" ? 0 : static_cast<int>(torch::cuda::device_count());
    std::vector<torch::Device> devices;
    for (int i = 0; i < gpus; ++i) devices.emplace_back(torch::kCUDA, static_cast<c10::DeviceIndex>(i));
    TORCH_CHECK(gpus == 0 || output_device < gpus, "--output-device ", output_device, " but only ", gpus,
                " GPU(s) are visible");
    // The master copy lives on the first GPU; data_parallel replicates it from there every step.
    const torch::Device device = gpus > 0 ? devices.front() : torch::Device(torch::kCPU);
    if (gpus == 0)
      fmt::print("no GPU visible: training on the CPU without replication\n");
    else
      fmt::print("replicating over {} GPU(s), outputs gathered on cuda:{}\n", gpus, output_device);

    const examples::Data data = examples::load_data(flags);
    examples::SmallCnn model;
    model->to(device);
    torch::optim::SGD optimizer(model->parameters(),
                                torch::optim::SGDOptions(flags.lr).momentum(examples::kSgdMomentum));
    if (!flags.resume.empty()) examples::load_checkpoint(flags.resume, *model, optimizer);

    auto forward = [&](const torch::Tensor& images) {
      if (gpus == 0) return model->forward(images);
      return torch::nn::parallel::data_parallel(
          model.ptr(), images, devices, torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(output_device)));
    };
    for (int epoch = 1; epoch <= flags.epochs; ++epoch) {
      const double loss =
          examples::train_epoch(data.train, epoch, flags.epochs, flags.batch_size, device, examples::Rank{},
                                [&](const torch::Tensor& images, const torch::Tensor& labels) {
                                  optimizer.zero_grad();
                                  auto out = forward(images);
                                  auto l = torch::cross_entropy_loss(out, labels.to(out.device()));
                                  l.backward();  // gradients of all replicas flow back into the master copy
                                  optimizer.step();
                                  return l;
                                });
      examples::print_epoch_result(epoch, flags.epochs, loss,
                                   examples::test_accuracy(*model, forward, data.test, device));
    }
    if (!flags.save.empty()) examples::save_checkpoint(flags.save, *model, optimizer);
  });
}
