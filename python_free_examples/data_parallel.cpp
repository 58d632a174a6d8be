// The tutorial's first way: one process, the model replicated over all visible GPUs each step (ddp::DataParallel,
// PyTorch's nn.DataParallel): the batch is split across the GPUs and the outputs gathered on --output-device.
// --opt-level adds mixed precision (amp::initialize before wrapping; the forward goes through the amp policy).
//   ./data_parallel --synthetic --output-device 0 --opt-level O2
// Without GPUs it replicates over --cpu-replicas CPU threads instead (the same code path, for trying it out).
#include <algorithm>
#include <memory>
#include <optional>
#include <stdexcept>
#include <vector>

#include <amp/amp.h>
#include <ddp/data_parallel.h>
#include <fmt/format.h>

#include "common/example_flags.h"
#include "common/preemption.h"
#include "common/small_cnn.h"

int main(int argc, char** argv) {
  examples::CommonFlags flags;
  int output_device = 0;
  int cpu_replicas = 2;
  std::string opt_level = "none";
  CLI::App app{"Single-process data parallel training on Fashion-MNIST over all visible GPUs"};
  examples::add_common_flags(app, flags);
  app.add_option("--output-device", output_device, "GPU index that gathers the outputs");
  app.add_option("--cpu-replicas", cpu_replicas, "Replicas on the CPU when no GPU is used");
  app.add_option("--opt-level", opt_level, "none (fp32, the tutorial's way), or amp's O0, O1, O2, O3")
      ->check(CLI::IsMember({"none", "O0", "O1", "O2", "O3"}));
  if (const auto status = examples::parse_flags(app, argc, argv)) return *status;

  return examples::run_main("data_parallel", [&] {
    examples::check_common_flags(flags);
    // First: from here on --stop-signal stops the run at the next step boundary, which saves it.
    const std::unique_ptr<run::StopSignal> stop_signal = examples::watch_stop_signal(flags);
    examples::require_positive("--cpu-replicas", cpu_replicas);
    // amp's checkpoints carry checksums: a damaged newest one is skipped for its predecessor.
    examples::resume_from_checkpoint_dir(flags, examples::Rank{},
                                         opt_level != "none" ? amp::verify_checkpoint : amp::check_archive_readable);
    // "auto" replicates over every visible GPU, or over CPU replicas when there is none; "cuda" (or "cuda:N")
    // asks for GPUs, and having none is an error (pick_device's), not a silent fall back to the CPU.
    const bool use_gpus =
        flags.device == "auto" ? torch::cuda::is_available() : examples::pick_device(flags.device).is_cuda();
    const int gpus = use_gpus ? static_cast<int>(torch::cuda::device_count()) : 0;
    if (output_device < 0 || (gpus > 0 && output_device >= gpus)) {
      throw std::invalid_argument(fmt::format("--output-device must be a visible GPU's index (0..{}), got {}",
                                              std::max(gpus - 1, 0), output_device));
    }
    torch::manual_seed(flags.seed);
    std::vector<torch::Device> devices;
    for (int i = 0; i < gpus; ++i) devices.emplace_back(torch::kCUDA, static_cast<c10::DeviceIndex>(i));
    if (gpus == 0) devices.assign(static_cast<size_t>(cpu_replicas), torch::Device(torch::kCPU));
    const torch::Device gather_on = gpus > 0 ? devices[static_cast<size_t>(output_device)] : devices.front();
    // The module lives on the first device; DataParallel replicates it from there every step.
    const torch::Device device = devices.front();
    const examples::Data data = examples::load_data(flags);
    const c10::ScalarType half = device.is_cuda() ? at::kHalf : at::kBFloat16;
    examples::RunHeader header;
    header.where = fmt::format("replicated over {} {}(s), outputs gathered on {}", devices.size(),
                               gpus > 0 ? "GPU" : "CPU replica", gather_on.str());
    header.precision = opt_level == "none" ? "fp32" : opt_level + " " + examples::dtype_name(half);
    header.optimizer = examples::sgd_description();
    const std::string header_line = examples::run_header_line(flags, data, header);
    fmt::print("{}\n", header_line);
    if (gpus == 0 && app.get_option("--output-device")->count() > 0) {  // a GPU's index, given where none is used
      fmt::print("--output-device {}: no GPU is in use, so the outputs are gathered on the CPU\n", output_device);
    }
    examples::SmallCnn net;
    net->to(device);
    torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(flags.lr).momentum(examples::kSgdMomentum));

    // amp, when asked: initialize first (it may cast the model), then wrap the initialized module.
    std::optional<amp::Initialized<examples::SmallCnn>> mixed;
    if (opt_level != "none") {
      mixed.emplace(
          amp::initialize(net, sgd, amp::Options().opt_level(amp::parse_opt_level(opt_level)).half_dtype(half)));
    }
    // The run state (position, generator) travels in amp checkpoints as an extra, in plain ones as a part.
    std::optional<run::RunState> saved;
    if (!flags.resume.empty() && mixed) {
      saved = examples::load_amp_checkpoint(flags.resume, mixed->model, mixed->optimizer);
    } else if (!flags.resume.empty()) {
      saved = examples::load_checkpoint(flags.resume, *net, sgd);
    }
    const int64_t train_samples = data.train.images.size(0);
    run::TrainingPosition position;
    if (!flags.resume.empty()) {
      position = examples::resume_position(flags.resume, saved, flags, 1, train_samples, examples::Rank{});
    }
    ddp::DataParallel<examples::SmallCnnImpl> dp(net,
                                                 ddp::DataParallelOptions().devices(devices).output_device(gather_on));
    auto forward = [&](const torch::Tensor& images) {
      if (mixed) return mixed->model.call([&](const torch::Tensor& in) { return dp.forward(in); }, images);
      return dp.forward(images);
    };

    const run::Checkpoints checkpoints = examples::checkpoints_from(flags);
    const auto save = [&](const run::TrainingPosition& at) {
      const auto state = examples::capture_run_state(flags, 1, train_samples, at);
      checkpoints.save(at.steps, [&](const std::string& path) {
        if (mixed) {
          examples::save_amp_checkpoint(path, mixed->model, mixed->optimizer, state);
        } else {
          examples::save_checkpoint(path, *net, sgd, state);
        }
      });
    };
    run::DistributedSampler sampler = examples::sampler_from(flags, train_samples, examples::Rank{});
    run::Monitor monitor(examples::monitor_options(flags, position, sampler.batches_per_epoch()), 0, 1, device,
                         {header_line, [&] { return run::step_values(sgd, mixed ? &mixed->optimizer : nullptr); }});
    const run::TrainingPosition start = position;
    bool preempted = examples::stop_signalled(stop_signal.get(), position);  // (a signal during the start)
    while (position.epoch <= flags.epochs && !examples::stop_requested(flags, start, position) && !preempted) {
      const int64_t epoch = position.epoch;
      sampler.set_epoch(epoch, position.batches_done);
      monitor.begin_epoch(epoch, sampler.batches_per_epoch(), position.batches_done, position.epoch_loss);
      while (const auto indices = sampler.next()) {
        const auto [images, labels] = data.train.batch(*indices, device);  // DataParallel splits it over the replicas
        run::StepPhases& phases = monitor.begin_step();
        auto out = forward(images);
        auto loss = torch::cross_entropy_loss(out, labels.to(out.device()));
        phases.end(run::Phase::kForward);
        if (mixed) {
          mixed->optimizer.zero_grad();
          {
            auto scaled = amp::scale_loss(loss, mixed->optimizer);
            scaled.backward();  // the replicas' gradients flow back into the module, unscaled into fp32 masters
          }
          phases.end(run::Phase::kBackward);
          mixed->optimizer.step();
        } else {
          sgd.zero_grad();
          loss.backward();  // the replicas' gradients flow back into the module
          phases.end(run::Phase::kBackward);
          sgd.step();
        }
        phases.end(run::Phase::kOptimizer);
        const double step_loss = loss.item<double>();  // the step's one host sync
        position.step_done(sampler.batches_done(), sampler.batches_per_epoch(), step_loss);
        preempted = examples::stop_signalled(stop_signal.get(), position);
        const bool stop = examples::stop_requested(flags, start, position) || preempted;
        monitor.step(step_loss, indices->numel(), /*last=*/stop);
        if (checkpoints.due(position.steps)) {
          monitor.interrupt();
          save(position);
        }
        if (stop) break;
      }
      const double mean_loss = monitor.epoch_trained();
      if (position.epoch > epoch) {
        const double accuracy = examples::test_accuracy(*net, forward, data.test, device);
        monitor.end_epoch(examples::print_epoch_result(static_cast<int>(epoch), flags.epochs, mean_loss, accuracy));
      }
    }
    monitor.finish();
    examples::print_if_stopped(flags, start, position, examples::Rank{});
    if (checkpoints.final_save_needed(start, position)) save(position);  // (a stop's save too)
    return preempted ? examples::stopped_resumable(flags, *stop_signal, examples::Rank{}, position) : 0;
  });
}
