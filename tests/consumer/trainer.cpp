// A user's own trainer, built against the install tree (not an example): amp in its loop, watched by run::Monitor
// (progress, metrics JSON lines, HTML report), its data from run::DistributedSampler, and saved every K steps into an
// amp::CheckpointDir with run::RunState, from which a restarted run continues exactly.
//   trainer DIR [--epochs E] [--save-every K] [--kill-after-step S]
// writes DIR/checkpoints/step-*.pt, DIR/metrics.jsonl, DIR/report.html and, at the end, DIR/final.pt. With
// --kill-after-step S it kills itself (SIGKILL) right after the save of step S, as a preemption would.
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <optional>
#include <stdexcept>
#include <string>

#include <torch/torch.h>

#include <amp/amp.h>
#include <amp/io/checkpoint_dir.h>
#include <amp/optim/fused_optimizers.h>
#include <run/monitor.h>
#include <run/run_state.h>
#include <run/sampler.h>
#include <run/training_checkpoint.h>

namespace {

constexpr int64_t kSamples = 480;
constexpr int64_t kBatch = 32;

struct NetImpl : torch::nn::Module {
  NetImpl()
      : hidden(register_module("hidden", torch::nn::Linear(16, 64))),
        dropout(register_module("dropout", torch::nn::Dropout(0.2))),  // draws from the CPU generator
        out(register_module("out", torch::nn::Linear(64, 4))) {}
  torch::Tensor forward(const torch::Tensor& x) { return out(dropout(torch::relu(hidden(x)))); }
  torch::nn::Linear hidden;
  torch::nn::Dropout dropout;
  torch::nn::Linear out;
};
TORCH_MODULE(Net);

int64_t flag(int argc, char** argv, const std::string& name, int64_t fallback) {
  for (int i = 2; i + 1 < argc; ++i) {
    if (argv[i] == name) return std::atoll(argv[i + 1]);
  }
  return fallback;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: trainer DIR [--epochs E] [--save-every K] [--kill-after-step S]\n");
    return 2;
  }
  const std::string dir = argv[1];
  const int64_t epochs = flag(argc, argv, "--epochs", 3);
  const int64_t save_every = flag(argc, argv, "--save-every", 5);
  const int64_t kill_after = flag(argc, argv, "--kill-after-step", 0);
  std::filesystem::create_directories(dir);

  // The data: a fixed task (the label is which quarter of the inputs is largest).
  torch::manual_seed(7);
  const auto inputs = torch::randn({kSamples, 16});
  const auto labels = inputs.view({kSamples, 4, 4}).sum(2).argmax(1);
  torch::manual_seed(0);  // the model's initialization, and dropout's draws after it
  Net net;
  amp::FusedSGD sgd(net->parameters(), amp::FusedSgdOptions(0.05).momentum(0.9));
  auto initialized = amp::initialize(net, sgd, amp::Options().opt_level(amp::OptLevel::O1).half_dtype(at::kBFloat16));
  auto& model = initialized.model;  // (not a structured binding: the lambdas below capture them)
  auto& optimizer = initialized.optimizer;

  // Continue from the newest checkpoint that loads, if there is one.
  amp::CheckpointDir checkpoints(dir + "/checkpoints", /*keep_last=*/2);
  run::TrainingPosition position;
  const auto resumed = checkpoints.load_newest([&](const std::string& path) {
    const std::optional<run::RunState> state = run::load_training_checkpoint(path, model, optimizer);
    if (!state) throw std::runtime_error("no run state");
    run::restore_cpu_generator(state->cpu_generator_state);
    position = state->position;
  });
  if (resumed) std::printf("resumed from %s at step %lld\n", resumed->path.c_str(), (long long)position.steps);

  run::DistributedSampler sampler(kSamples, kBatch);  // one process: rank 0 of 1
  run::MonitorOptions watch;
  watch.progress = run::progress_style(/*quiet=*/false, stdout);
  watch.epochs = epochs;
  watch.observe.metrics = dir + "/metrics.jsonl";
  watch.observe.metrics_every = 3;
  watch.observe.report = dir + "/report.html";
  watch.observe.resumed = resumed.has_value();
  watch.first_step = position.steps + 1;
  watch.last_step = epochs * sampler.batches_per_epoch();
  run::Monitor monitor(watch, 0, 1, torch::kCPU,
                       {"consumer trainer", [&] { return run::step_values(sgd, &optimizer); }});

  while (position.epoch <= epochs) {
    const int64_t epoch = position.epoch;
    sampler.set_epoch(epoch, position.batches_done);
    monitor.begin_epoch(epoch, sampler.batches_per_epoch(), position.batches_done, position.epoch_loss);
    while (const auto indices = sampler.next()) {
      run::StepPhases& phases = monitor.begin_step();
      optimizer.zero_grad();
      auto loss =
          torch::cross_entropy_loss(model.forward(inputs.index_select(0, *indices)), labels.index_select(0, *indices));
      phases.end(run::Phase::kForward);
      {
        auto scaled = amp::scale_loss(loss, optimizer);
        scaled.backward();
      }
      phases.end(run::Phase::kBackward);
      optimizer.step();
      phases.end(run::Phase::kOptimizer);
      const double step_loss = loss.item<double>();
      position.step_done(sampler.batches_done(), sampler.batches_per_epoch(), step_loss);
      monitor.step(step_loss, indices->numel());
      if (position.steps % save_every == 0) {
        run::RunState state;
        state.position = position;
        state.batch_size = kBatch;
        state.train_samples = kSamples;
        state.cpu_generator_state = run::cpu_generator_state();
        monitor.interrupt();
        checkpoints.save(position.steps, [&](const std::string& path) {
          run::save_training_checkpoint(path, model, optimizer, state);
        });
        if (position.steps == kill_after) std::raise(SIGKILL);
      }
    }
    torch::NoGradGuard no_grad;
    model.module()->eval();
    const double accuracy = model.forward(inputs).argmax(1).eq(labels).to(torch::kDouble).mean().item<double>();
    model.module()->train();
    monitor.end_epoch(accuracy);
  }
  monitor.finish();
  torch::serialize::OutputArchive final_weights;
  net->save(final_weights);
  final_weights.save_to(dir + "/final.pt");
  std::printf("trainer: done at step %lld\n", (long long)position.steps);
  return 0;
}
