// The starting point the four ways extend: one process trains the small CNN on Fashion-MNIST (real data from
// /usr/share/datasets/fashion-mnist, or --synthetic) and prints loss, throughput and test accuracy.
//   ./train_fashion_mnist --synthetic --epochs 2 --checkpoint-dir runs/cnn --save-every 100
// Everything that watches and resumes the run is the library's (libtorch_amp::run, docs/run.md): the sampler, the
// monitor (progress line, --metrics, --report), the run state in each checkpoint, the checkpoint folder.
#include <memory>

#include <fmt/format.h>
#include <torch/torch.h>

#include "common/example_flags.h"
#include "common/preemption.h"
#include "common/small_cnn.h"

int main(int argc, char** argv) {
  examples::CommonFlags flags;
  CLI::App app{"Train a small CNN on Fashion-MNIST with LibTorch (no Python)"};
  examples::add_common_flags(app, flags);
  if (const auto status = examples::parse_flags(app, argc, argv)) return *status;

  return examples::run_main("train_fashion_mnist", [&] {
    examples::check_common_flags(flags);
    // First: from here on --stop-signal stops the run at the next step boundary, which saves it.
    const std::unique_ptr<run::StopSignal> stop_signal = examples::watch_stop_signal(flags);
    // --checkpoint-dir: continue from its newest checkpoint that reads (a fresh start in an empty folder).
    examples::resume_from_checkpoint_dir(flags, examples::Rank{}, amp::check_archive_readable);
    torch::manual_seed(flags.seed);
    const torch::Device device = examples::pick_device(flags.device);
    const examples::Data data = examples::load_data(flags);
    const int64_t train_samples = data.train.images.size(0);
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
    run::TrainingPosition position;  // epoch 1, batch 0, step 0; a resume continues where its checkpoint stood
    if (!flags.resume.empty()) {
      const auto saved = examples::load_checkpoint(flags.resume, *model, optimizer);
      position = examples::resume_position(flags.resume, saved, flags, 1, train_samples, examples::Rank{});
    }
    const run::Checkpoints checkpoints = examples::checkpoints_from(flags);
    const auto save = [&](const run::TrainingPosition& at) {
      checkpoints.save(at.steps, [&](const std::string& path) {
        examples::save_checkpoint(path, *model, optimizer, examples::capture_run_state(flags, 1, train_samples, at));
      });
    };

    run::DistributedSampler sampler = examples::sampler_from(flags, train_samples, examples::Rank{});
    run::Monitor monitor(examples::monitor_options(flags, position, sampler.batches_per_epoch()), 0, 1, device,
                         {header_line, [&] { return run::step_values(optimizer); }});
    const run::TrainingPosition start = position;
    bool preempted = examples::stop_signalled(stop_signal.get(), position);  // (a signal during the start)
    while (position.epoch <= flags.epochs && !examples::stop_requested(flags, start, position) && !preempted) {
      const int64_t epoch = position.epoch;
      sampler.set_epoch(epoch, position.batches_done);
      monitor.begin_epoch(epoch, sampler.batches_per_epoch(), position.batches_done, position.epoch_loss);
      while (const auto indices = sampler.next()) {
        const auto [images, labels] = data.train.batch(*indices, device);
        run::StepPhases& phases = monitor.begin_step();
        optimizer.zero_grad();
        auto loss = torch::cross_entropy_loss(model->forward(images), labels);
        phases.end(run::Phase::kForward);
        loss.backward();
        phases.end(run::Phase::kBackward);
        optimizer.step();
        phases.end(run::Phase::kOptimizer);
        const double step_loss = loss.item<double>();  // the step's one host sync
        position.step_done(sampler.batches_done(), sampler.batches_per_epoch(), step_loss);
        preempted = examples::stop_signalled(stop_signal.get(), position);
        const bool stop = examples::stop_requested(flags, start, position) || preempted;
        monitor.step(step_loss, indices->numel(), /*last=*/stop);
        if (checkpoints.due(position.steps)) {
          monitor.interrupt();  // the save's line below the progress line
          save(position);
        }
        if (stop) break;
      }
      const double mean_loss = monitor.epoch_trained();
      if (position.epoch > epoch) {  // the whole epoch ran: evaluate it
        const double accuracy = examples::test_accuracy(
            *model, [&](const torch::Tensor& x) { return model->forward(x); }, data.test, device);
        monitor.end_epoch(examples::print_epoch_result(static_cast<int>(epoch), flags.epochs, mean_loss, accuracy));
      }
    }
    monitor.finish();
    examples::print_if_stopped(flags, start, position, examples::Rank{});
    if (checkpoints.final_save_needed(start, position)) save(position);  // (a stop's save too)
    return preempted ? examples::stopped_resumable(flags, *stop_signal, examples::Rank{}, position) : 0;
  });
}
