// Question: what do --metrics (at its default interval) and a --report with its timeline window cost a training
// step? Trains the examples' CNN (DDP over the launcher's ranks when started by ddp-launch, else one process) in the
// loop every example writes (run::DistributedSampler, run::Monitor), one epoch per run, under three settings: nothing
// recorded;
// --metrics every --metrics-every steps (each logged step: phase times, one allgather of the ranks' times, a JSON
// line); and --metrics plus --report and --timeline (the default 3-step window recorded and gathered, the report
// written). The settings take turns, --rounds times, the order rotating each round, and it prints each setting's
// median step time against the unrecorded one's in the same round: the ratio, and its spread over the rounds. Since a
// 1% cost is far inside the rounds' spread on a shared 2-core machine, it also times the recording alone: the
// observer's per-step calls (RunObserver::begin_step, the phase marks, end_step with its gather and JSON line on logged
// steps) for --observer-steps steps without training, as microseconds per step and as a share of the measured step.
//   ./bench_observability_overhead --rounds 9
//   ddp-launch --nproc-per-node 2 ./bench_observability_overhead --rounds 9
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include <ddp/distributed_data_parallel.h>
#include <ddp/launch/launch_env.h>
#include <ddp/process_group.h>
#include <fmt/format.h>
#include <torch/torch.h>
#include <CLI/CLI.hpp>

#include "common/command_line.h"
#include "common/example_flags.h"
#include "common/small_cnn.h"
#include "common/timing.h"

namespace {

struct Setting {
  std::string name;
  bool metrics = false;
  bool report = false;
};

}  // namespace

int main(int argc, char** argv) {
  int rounds = 9;
  int64_t samples = 4096;
  int64_t batch = 64;
  int64_t metrics_every = 10;
  std::string out = "/tmp";
  int64_t observer_steps = 2000;
  CLI::App app{"What --metrics and --report cost a training step (the examples' loop with run::Monitor, CPU)"};
  app.add_option("--rounds", rounds, "Rounds; each runs every setting once, in rotating order")
      ->check(CLI::PositiveNumber);
  app.add_option("--samples", samples, "Synthetic training samples per epoch (one epoch per run)")
      ->check(CLI::PositiveNumber);
  app.add_option("--batch-size", batch, "Batch per process")->check(CLI::PositiveNumber);
  app.add_option("--metrics-every", metrics_every, "The metrics' interval in steps (the examples' default: 10)")
      ->check(CLI::PositiveNumber);
  app.add_option("--out", out, "Folder for the scratch metrics, report and trace files");
  app.add_option("--observer-steps", observer_steps, "Steps of the observer timed alone")->check(CLI::PositiveNumber);
  if (const auto status = examples::parse_flags(app, argc, argv)) return *status;

  return examples::run_main("bench_observability_overhead", [&] {
    std::optional<ddp::ProcessGroup> group;
    if (ddp::launched_by_launcher()) group.emplace(ddp::init_process_group(ddp::InitOptions().backend("gloo")));
    const examples::Rank rank{group ? group->rank() : 0, group ? group->size() : 1};
    torch::manual_seed(0);
    const examples::ImageSplit train = examples::synthetic_fashion_mnist(samples, 0, /*train=*/true);
    examples::SmallCnn net;
    std::optional<ddp::DistributedDataParallel> ddp;
    if (group) ddp.emplace(net, *group);
    torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.01).momentum(examples::kSgdMomentum));

    const auto flags_of = [&](const Setting& setting) {
      examples::CommonFlags flags;
      flags.batch_size = batch;
      flags.quiet = true;
      if (setting.metrics) {
        flags.observe.metrics = out + "/observability_overhead.jsonl";
        flags.observe.metrics_every = metrics_every;
      }
      if (setting.report) {
        flags.observe.report = out + "/observability_overhead.html";
        flags.observe.timeline = out + "/observability_overhead_trace.json";
      }
      return flags;
    };
    const std::vector<Setting> settings = {{"nothing recorded", false, false},
                                           {fmt::format("--metrics (every {} steps)", metrics_every), true, false},
                                           {"--metrics --report --timeline", true, true}};
    std::vector<std::vector<double>> step_ms(settings.size());  // [setting][round]
    const int64_t steps = run::DistributedSampler::batches_per_epoch(samples, batch, rank.world_size,
                                                                     run::DistributedSampler::Order::kPerRank);
    for (int round = 0; round < rounds; ++round) {
      for (size_t k = 0; k < settings.size(); ++k) {
        const size_t s = (k + static_cast<size_t>(round)) % settings.size();
        const examples::CommonFlags flags = flags_of(settings[s]);
        const run::ObservedRun observed{"bench_observability_overhead", [&] { return run::step_values(sgd); },
                                        group ? &*group : nullptr, ddp ? &*ddp : nullptr};
        if (group) group->barrier();
        const auto began = std::chrono::steady_clock::now();
        run::DistributedSampler sampler = examples::sampler_from(flags, samples, rank);
        run::Monitor monitor(examples::monitor_options(flags, {}, sampler.batches_per_epoch()), rank.rank,
                             rank.world_size, torch::kCPU, observed);
        sampler.set_epoch(1);
        monitor.begin_epoch(1, sampler.batches_per_epoch());
        while (const auto indices = sampler.next()) {  // the examples' loop, as each of them writes it
          const auto [images, labels] = train.batch(*indices, torch::kCPU);
          run::StepPhases& phases = monitor.begin_step();
          sgd.zero_grad();
          auto loss = torch::cross_entropy_loss(ddp ? ddp->forward(images) : net->forward(images), labels);
          phases.end(run::Phase::kForward);
          loss.backward();
          phases.end(run::Phase::kBackward);
          sgd.step();
          phases.end(run::Phase::kOptimizer);
          monitor.step(loss.item<double>(), indices->numel() * rank.world_size);
        }
        monitor.end_epoch();
        monitor.finish();
        const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - began).count();
        step_ms[s].push_back(ms / static_cast<double>(steps));
      }
    }
    // The recording alone: what the observer adds to each step, without the training around it.
    std::vector<double> observer_us(settings.size(), 0.0);
    for (size_t s = 1; s < settings.size(); ++s) {
      const run::ObservedRun observed{"bench_observability_overhead", [&] { return run::step_values(sgd); },
                                      group ? &*group : nullptr, ddp ? &*ddp : nullptr};
      run::RunObserver observer(flags_of(settings[s]).observe, rank.rank, rank.world_size, torch::kCPU, observed, 1,
                                observer_steps);
      if (group) group->barrier();
      const auto began = std::chrono::steady_clock::now();
      for (int64_t step = 1; step <= observer_steps; ++step) {
        run::StepPhases phases = observer.begin_step(step);
        phases.begin();
        phases.end(run::Phase::kForward);
        phases.end(run::Phase::kBackward);
        phases.end(run::Phase::kOptimizer);
        phases.finish();
        observer.end_step(step, 1, 1.0, phases, batch * rank.world_size);
      }
      observer.finish();
      observer_us[s] = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - began).count() /
                       static_cast<double>(observer_steps);
    }
    if (rank.rank != 0) return 0;
    fmt::print("{} process(es), {} steps of batch {} per run, {} rounds, CPU threads {}\n", rank.world_size, steps,
               batch, rounds, at::get_num_threads());
    fmt::print("{:<36} {:>14} {:>28} {:>22}\n", "setting", "step ms (med)", "x nothing: med [min, max]",
               "recording us/step (%)");
    const double step_med_ms = bench::median(step_ms[0]);
    for (size_t s = 0; s < settings.size(); ++s) {
      std::vector<double> ratios;
      for (int r = 0; r < rounds; ++r) ratios.push_back(step_ms[s][r] / step_ms[0][r]);
      fmt::print("{:<36} {:>14.3f} {:>10.4f} [{:.4f}, {:.4f}] {:>12.2f} ({:.3f}%)\n", settings[s].name,
                 bench::median(step_ms[s]), bench::median(ratios), *std::min_element(ratios.begin(), ratios.end()),
                 *std::max_element(ratios.begin(), ratios.end()), observer_us[s],
                 100.0 * observer_us[s] / (1000.0 * step_med_ms));
    }
    return 0;
  });
}
