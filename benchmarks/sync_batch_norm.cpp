// Question: what does ddp::SyncBatchNorm cost per training step of the example CNN (python_free_examples'
// SmallCnn, two BatchNorm2d layers) against plain BatchNorm, with DDP on 2 ranks? Goal (issue 14): at most 1.15x
// the BatchNorm step on the CPU. Two setups, each the step of an example: ddp_launch's (fp32, SGD with momentum)
// and amp_ddp's (O2, bf16 model with fp32 BatchNorm and masters, FusedSGD, amp attached to DDP's buckets).
// 2 ranks forked by ddp::spawn meet over Gloo; the BatchNorm and SyncBatchNorm steps alternate round by round
// (each sample a few steps, after a barrier), and rank 0 prints medians and their ratio.
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <torch/torch.h>
#include <CLI/CLI.hpp>

#include <amp/amp.h>
#include <amp/optim/fused_optimizers.h>
#include <ddp/distributed_data_parallel.h>
#include <ddp/launch/spawn.h>
#include <ddp/process_group.h>
#include <ddp/sync_batch_norm.h>

#include "common/command_line.h"
#include "common/small_cnn.h"
#include "common/timing.h"

namespace {

using Clock = std::chrono::steady_clock;

constexpr int kWorld = 2;
constexpr std::chrono::milliseconds kTimeout{120000};
constexpr int64_t kImageSide = 28;
constexpr int64_t kClasses = 10;
constexpr double kLr = 0.05;
constexpr double kMomentum = 0.9;
constexpr double kGoalRatio = 1.15;

struct Sizes {
  int64_t batch_per_rank;
  int steps_per_sample;
  int rounds;
};

/// One model of one setup: the CNN with BatchNorm or SyncBatchNorm, its optimizer (plain or amp) and DDP.
struct Variant {
  std::string name;
  examples::SmallCnn net{nullptr};
  std::unique_ptr<torch::optim::Optimizer> inner;
  std::unique_ptr<amp::Initialized<examples::SmallCnn>> amp;  // the amp setup only
  std::unique_ptr<ddp::DistributedDataParallel> ddp;
  std::vector<double> seconds;  // per step, one sample per round
};

Variant make_variant(const ddp::ProcessGroup& pg, bool sync, bool use_amp) {
  Variant v;
  v.name = sync ? "SyncBatchNorm" : "BatchNorm";
  torch::manual_seed(0);
  v.net = examples::SmallCnn(examples::SmallCnnOptions().sync_batch_norm(sync));
  if (sync) ddp::set_sync_batch_norm_process_group(*v.net, pg);
  if (use_amp) {
    v.inner = std::make_unique<amp::FusedSGD>(v.net->parameters(), amp::FusedSgdOptions(kLr).momentum(kMomentum));
    v.amp = std::make_unique<amp::Initialized<examples::SmallCnn>>(
        amp::initialize(v.net, *v.inner, amp::Options().opt_level(amp::OptLevel::O2).half_dtype(torch::kBFloat16)));
  } else {
    v.inner =
        std::make_unique<torch::optim::SGD>(v.net->parameters(), torch::optim::SGDOptions(kLr).momentum(kMomentum));
  }
  v.ddp = std::make_unique<ddp::DistributedDataParallel>(v.net, pg);
  if (v.amp) v.amp->optimizer.attach(*v.ddp);
  return v;
}

void step(Variant& v, const torch::Tensor& images, const torch::Tensor& labels) {
  if (!v.amp) {
    v.inner->zero_grad();
    torch::cross_entropy_loss(v.ddp->forward(images), labels).backward();
    v.inner->step();
    return;
  }
  auto& optimizer = v.amp->optimizer;
  optimizer.zero_grad();
  const auto out = v.amp->model.call([&](const torch::Tensor& in) { return v.ddp->forward(in); }, images);
  {
    auto scaled = amp::scale_loss(torch::cross_entropy_loss(out, labels), optimizer);
    scaled.backward();
  }
  optimizer.step();
}

void compare(const ddp::ProcessGroup& pg, const std::string& setup, bool use_amp, const Sizes& sizes) {
  std::vector<Variant> variants;
  variants.push_back(make_variant(pg, /*sync=*/false, use_amp));
  variants.push_back(make_variant(pg, /*sync=*/true, use_amp));
  // Each rank its own batch (its share of the global one), as in DDP training.
  torch::manual_seed(1 + static_cast<uint64_t>(pg.rank()));
  const auto images = torch::randn({sizes.batch_per_rank, 1, kImageSide, kImageSide});
  const auto labels = torch::randint(0, kClasses, {sizes.batch_per_rank});
  for (auto& v : variants) step(v, images, labels);  // warm-up (and DDP's bucket rebuild)
  for (int r = 0; r < sizes.rounds; ++r) {
    for (auto& v : variants) {
      pg.barrier();
      const auto start = Clock::now();
      for (int s = 0; s < sizes.steps_per_sample; ++s) step(v, images, labels);
      v.seconds.push_back(std::chrono::duration<double>(Clock::now() - start).count() / sizes.steps_per_sample);
    }
  }
  if (pg.rank() != 0) return;
  const double base = bench::median(variants[0].seconds);
  fmt::print("\n{}: example CNN, batch {} per rank, {} ranks (Gloo), median of {} rounds of {} steps\n", setup,
             sizes.batch_per_rank, pg.size(), sizes.rounds, sizes.steps_per_sample);
  fmt::print("| normalization | step ms | x BatchNorm |\n|---|---|---|\n");
  for (const auto& v : variants) {
    const double s = bench::median(v.seconds);
    fmt::print("| {} | {:.2f} | {:.3f}x |\n", v.name, s * 1e3, s / base);
  }
  const double ratio = bench::median(variants[1].seconds) / base;
  fmt::print("SyncBatchNorm / BatchNorm: {:.3f}x (goal <= {:.2f}x: {})\n", ratio, kGoalRatio,
             ratio <= kGoalRatio ? "met" : "NOT met");
}

}  // namespace

int main(int argc, char** argv) {
  bool full = false;
  int threads = 1;
  Sizes sizes{32, 2, 5};
  CLI::App app{"SyncBatchNorm vs BatchNorm: training step of the example CNN with DDP on 2 local ranks (Gloo)"};
  app.add_flag("--full", full, "The examples' batch (128 per rank), 5 steps per sample, 20 rounds");
  app.add_option("--rounds", sizes.rounds, "Timed rounds per normalization (default 5; 20 with --full)")
      ->check(CLI::PositiveNumber);
  app.add_option("--threads", threads, "Intra-op threads per rank")->check(CLI::PositiveNumber);
  if (const auto status = examples::parse_flags(app, argc, argv)) return *status;
  if (full) {
    sizes.batch_per_rank = 128;
    sizes.steps_per_sample = 5;
    if (app.count("--rounds") == 0) sizes.rounds = 20;
  }
  ddp::spawn(kWorld, [&](int, int) {
    at::set_num_threads(threads);
    const ddp::ProcessGroup pg = ddp::init_process_group(ddp::InitOptions().timeout(kTimeout));
    compare(pg, "ddp_launch's step (fp32, SGD)", /*use_amp=*/false, sizes);
    compare(pg, "amp_ddp's step (O2 bf16, FusedSGD, amp attached to DDP)", /*use_amp=*/true, sizes);
  });
  return 0;
}
