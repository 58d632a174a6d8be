// Question: what does watching for a stop signal (run::StopSignal, --stop-signal) cost a training step? Trains the
// examples' CNN with DDP over the launcher's ranks, one epoch per run, with and without a joined run::StopSignal
// asked at every step boundary (no signal comes: the cost of watching). The two take turns, --rounds times, the order
// alternating, and it prints the median step time of each and their ratio with its spread over the rounds. Since
// 0.1% is far inside that spread on a shared 2-core machine, it also times stop_after() itself on the training
// thread (taking the last boundary's store read, posting the next) in the watched runs: microseconds per step, and
// as a share of the step. The store read runs on StopSignal's own thread, concurrently with the step.
//   ddp-launch --nproc-per-node 2 ./bench_stop_signal_overhead --rounds 9
#include <algorithm>
#include <chrono>
#include <csignal>
#include <memory>
#include <optional>
#include <vector>

#include <ddp/distributed_data_parallel.h>
#include <ddp/process_group.h>
#include <fmt/format.h>
#include <run/stop_signal.h>
#include <torch/torch.h>
#include <CLI/CLI.hpp>

#include "common/command_line.h"
#include "common/example_flags.h"
#include "common/small_cnn.h"
#include "common/timing.h"

int main(int argc, char** argv) {
  int rounds = 9;
  int64_t samples = 4096;
  int64_t batch = 64;
  CLI::App app{"What watching for a stop signal costs a training step (DDP over the launcher's ranks, CPU)"};
  app.add_option("--rounds", rounds, "Rounds; each trains one epoch without and one with the watch")
      ->check(CLI::PositiveNumber);
  app.add_option("--samples", samples, "Synthetic training samples per epoch")->check(CLI::PositiveNumber);
  app.add_option("--batch-size", batch, "Batch per process")->check(CLI::PositiveNumber);
  if (const auto status = examples::parse_flags(app, argc, argv)) return *status;

  return examples::run_main("bench_stop_signal_overhead", [&] {
    ddp::ProcessGroup group = ddp::init_process_group(ddp::InitOptions().backend("gloo"));
    torch::manual_seed(0);
    const examples::ImageSplit train = examples::synthetic_fashion_mnist(samples, 0, /*train=*/true);
    examples::SmallCnn net;
    ddp::DistributedDataParallel ddp(net, group);
    torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.01).momentum(examples::kSgdMomentum));
    examples::CommonFlags flags;
    flags.batch_size = batch;
    const examples::Rank rank{group.rank(), group.size()};
    std::vector<double> plain_ms, watched_ms, watch_us;
    for (int round = 0; round < rounds; ++round) {
      for (int k = 0; k < 2; ++k) {
        const bool watched = (k + round) % 2 == 1;
        std::unique_ptr<run::StopSignal> stop;
        if (watched) {
          stop = std::make_unique<run::StopSignal>(SIGUSR1);
          stop->join(group);
        }
        run::DistributedSampler sampler = examples::sampler_from(flags, samples, rank);
        sampler.set_epoch(1 + round);
        group.barrier();
        double watching = 0.0;
        int64_t steps = 0;
        const auto began = std::chrono::steady_clock::now();
        if (stop) stop->stop_after(0);
        while (const auto indices = sampler.next()) {
          const auto [images, labels] = train.batch(*indices, torch::kCPU);
          sgd.zero_grad();
          auto loss = torch::cross_entropy_loss(ddp.forward(images), labels);
          loss.backward();
          sgd.step();
          (void)loss.item<double>();
          ++steps;
          if (stop) {
            const auto asked = std::chrono::steady_clock::now();
            if (stop->stop_after(steps)) throw std::runtime_error("stopped without a signal");
            watching += std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - asked).count();
          }
        }
        const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - began).count();
        (watched ? watched_ms : plain_ms).push_back(ms / static_cast<double>(steps));
        if (watched) watch_us.push_back(watching / static_cast<double>(steps));
      }
    }
    if (rank.rank != 0) return 0;
    std::vector<double> ratios;
    for (int r = 0; r < rounds; ++r) ratios.push_back(watched_ms[r] / plain_ms[r]);
    fmt::print("{} process(es), {} samples, batch {} per process, {} rounds, CPU threads {}\n", rank.world_size,
               samples, batch, rounds, at::get_num_threads());
    fmt::print("step ms (median): unwatched {:.3f}, watched {:.3f}; watched / unwatched {:.4f} [{:.4f}, {:.4f}]\n",
               bench::median(plain_ms), bench::median(watched_ms), bench::median(ratios),
               *std::min_element(ratios.begin(), ratios.end()), *std::max_element(ratios.begin(), ratios.end()));
    fmt::print(
        "stop_after() on the training thread: {:.2f} us per step (median of rounds, max {:.2f}) = {:.4f}% of "
        "a step\n",
        bench::median(watch_us), *std::max_element(watch_us.begin(), watch_us.end()),
        100.0 * bench::median(watch_us) / (1000.0 * bench::median(plain_ms)));
    return 0;
  });
}
