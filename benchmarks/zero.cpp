// Question: what do ZeRO stages 1 and 2 (amp::Optimizer::attach(ddp, amp::ZeroStage)) save in memory per rank, and
// what do they cost per training iteration, against DDP + amp O2 on the same model, with the parameter all-gather
// waited for in step() (amp::ZeroPublish::kInStep) and at the next forward (kAtNextForward)? Goals (issue 13): stage 2
// at 8 ranks under 0.35x of DDP + amp's bytes per rank; an iteration at most 1.10x DDP + amp's (2 ranks, Gloo on the
// CPU).
//
// Memory: a transformer-shaped stack of ~100 M parameters (per layer: qkv and output projections, a 4x MLP, two
// LayerNorms; no attention scores, which hold no parameters), O2 bf16, FusedAdamW. After one step each rank counts
// tensor storage: amp's masters, master gradients and optimizer state (Optimizer::held_bytes), the model's own
// parameters, and DDP's bucket storage between steps (BucketInfo::bytes). 2 and 4 ranks are measured (forked ranks,
// Gloo); 8 ranks are computed from the measured bucket layout with ddp::shard_bucket (masters, gradients and Adam's
// two moments are 4 bytes per element of the rank's slices; the per-piece step counts are left out of that row).
//
// Iteration time: a smaller stack of the same shape, 2 ranks, the five setups (DDP + amp; stages 1 and 2, each with
// the all-gather in step() and at the next forward) interleaved round by round on the same data (each rank its own
// batch), medians. An iteration is zero_grad, forward, backward and step(); a sample of k iterations ends with
// Optimizer::wait_for_parameters() inside the timed window, so the deferred all-gather of its last step is counted
// (and does not spill into the next sample). step() alone is timed too: under kAtNextForward it excludes the wait,
// which the next forward pays, so only the iteration column compares the setups.
#include <algorithm>
#include <chrono>
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
#include <ddp/shard_layout.h>

#include "common/block_stack.h"
#include "common/command_line.h"
#include "common/timing.h"

namespace {

using bench::Stack;
using Clock = std::chrono::steady_clock;
constexpr std::chrono::milliseconds kTimeout{600000};
constexpr double kMemoryGoal = 0.35;
constexpr double kStepGoal = 1.10;

struct Setup {
  amp::ZeroStage stage;
  amp::ZeroPublish publish;
  Stack net{nullptr};
  std::unique_ptr<amp::FusedAdamW> inner;
  std::unique_ptr<amp::Initialized<Stack>> amp_;
  std::unique_ptr<ddp::DistributedDataParallel> ddp_net;
  std::vector<double> iteration_seconds, step_seconds;  // per sample, per iteration
};

std::unique_ptr<Setup> make_setup(const ddp::ProcessGroup& pg, amp::ZeroStage stage, amp::ZeroPublish publish,
                                  int64_t d, int layers) {
  auto s = std::make_unique<Setup>();
  s->stage = stage;
  s->publish = publish;
  torch::manual_seed(0);
  s->net = Stack(d, layers);
  s->inner = std::make_unique<amp::FusedAdamW>(s->net->parameters(), amp::FusedAdamOptions(1e-4).weight_decay(1e-2));
  s->amp_ = std::make_unique<amp::Initialized<Stack>>(
      amp::initialize(s->net, *s->inner, amp::Options().opt_level(amp::OptLevel::O2).half_dtype(torch::kBFloat16)));
  s->ddp_net = std::make_unique<ddp::DistributedDataParallel>(s->net, pg);
  s->amp_->optimizer.attach(*s->ddp_net, stage, publish);
  return s;
}

/// One training iteration: zero_grad, forward (which completes a deferred all-gather first), backward, step().
/// Returns the seconds step() took.
double iteration(Setup& s, const torch::Tensor& x) {
  auto& optimizer = s.amp_->optimizer;
  optimizer.zero_grad();
  const auto y = s.amp_->model.call([&](const torch::Tensor& in) { return s.ddp_net->forward(in); }, x);
  {
    auto scaled = amp::scale_loss(y.pow(2).mean(), optimizer);
    scaled.backward();
  }
  const auto start = Clock::now();
  optimizer.step();
  return std::chrono::duration<double>(Clock::now() - start).count();
}

const char* stage_name(amp::ZeroStage stage) {
  return stage == amp::ZeroStage::kNone  ? "DDP + amp O2"
         : stage == amp::ZeroStage::kOne ? "ZeRO stage 1"
                                         : "ZeRO stage 2";
}

std::string setup_name(const Setup& s) {
  if (s.stage == amp::ZeroStage::kNone) return stage_name(s.stage);
  return std::string(stage_name(s.stage)) +
         (s.publish == amp::ZeroPublish::kInStep ? ", all-gather in step" : ", all-gather at next forward");
}

struct Bytes {
  int64_t amp_held = 0, model = 0, buckets = 0;
  int64_t total() const { return amp_held + model + buckets; }
};

Bytes measure(Setup& s) {
  Bytes b;
  b.amp_held = s.amp_->optimizer.held_bytes().total();
  for (const auto& p : s.net->parameters()) b.model += static_cast<int64_t>(p.nbytes());
  for (const auto& info : s.ddp_net->buckets()) b.buckets += info.bytes;
  return b;
}

double mib(int64_t bytes) { return static_cast<double>(bytes) / (1024.0 * 1024.0); }

void memory(int world, int64_t d, int layers) {
  ddp::spawn(world, [&](int, int) {
    at::set_num_threads(1);
    const ddp::ProcessGroup pg = ddp::init_process_group(ddp::InitOptions().timeout(kTimeout));
    const auto x = torch::randn({2, 8, d});
    std::vector<Bytes> measured;
    std::vector<int64_t> bucket_numels;
    int64_t params = 0;
    for (const auto stage : {amp::ZeroStage::kNone, amp::ZeroStage::kOne, amp::ZeroStage::kTwo}) {
      auto s = make_setup(pg, stage, amp::ZeroPublish::kInStep, d, layers);
      iteration(*s, x);
      measured.push_back(measure(*s));
      if (stage == amp::ZeroStage::kNone) {
        for (const auto& info : s->ddp_net->buckets()) bucket_numels.push_back(info.num_elements);
        for (const auto& p : s->net->parameters()) params += p.numel();
      }
    }
    if (pg.rank() != 0) return;
    fmt::print(
        "\nmemory per rank (rank 0), {} ranks, {:.1f} M parameters, MiB: amp (masters + master grads + Adam) | "
        "model (bf16/fp32 params) | DDP buckets | total | x DDP + amp\n",
        world, static_cast<double>(params) / 1e6);
    for (size_t i = 0; i < measured.size(); ++i) {
      const Bytes& b = measured[i];
      fmt::print("| {} | {:.1f} | {:.1f} | {:.1f} | {:.1f} | {:.3f}x |\n", stage_name(static_cast<amp::ZeroStage>(i)),
                 mib(b.amp_held), mib(b.model), mib(b.buckets), mib(b.total()),
                 static_cast<double>(b.total()) / static_cast<double>(measured[0].total()));
    }
    if (world != 2) return;
    // 8 ranks by arithmetic from this layout: the largest rank's slices of every bucket.
    constexpr int kEight = 8;
    int64_t slice = 0;
    for (int r = 0; r < kEight; ++r) {
      int64_t mine = 0;
      for (const int64_t n : bucket_numels) mine += ddp::shard_bucket(n, kEight).size(r);
      slice = std::max(slice, mine);
    }
    const Bytes& ddp_amp = measured[0];
    const int64_t sharded_amp = 16 * slice;  // fp32 master, master gradient, exp_avg, exp_avg_sq
    const Bytes stage1{sharded_amp, ddp_amp.model, ddp_amp.buckets};
    const Bytes stage2{sharded_amp, ddp_amp.model, measured[2].buckets};  // none kept between steps
    fmt::print("8 ranks (computed from the layout above; step counts left out):\n");
    for (const auto& [name, b] : {std::pair<const char*, Bytes>{"ZeRO stage 1", stage1}, {"ZeRO stage 2", stage2}}) {
      const double ratio = static_cast<double>(b.total()) / static_cast<double>(ddp_amp.total());
      fmt::print("| {} | {:.1f} | {:.1f} | {:.1f} | {:.1f} | {:.3f}x |\n", name, mib(b.amp_held), mib(b.model),
                 mib(b.buckets), mib(b.total()), ratio);
    }
    const double ratio2 = static_cast<double>(stage2.total()) / static_cast<double>(ddp_amp.total());
    fmt::print("stage 2 at 8 ranks: {:.3f}x DDP + amp's bytes per rank (goal < {:.2f}x: {})\n", ratio2, kMemoryGoal,
               ratio2 < kMemoryGoal ? "met" : "NOT met");
  });
}

void iteration_time(int64_t d, int layers, int64_t tokens, int rounds, int iterations_per_sample, int threads) {
  ddp::spawn(2, [&](int, int) {
    at::set_num_threads(threads);
    const ddp::ProcessGroup pg = ddp::init_process_group(ddp::InitOptions().timeout(kTimeout));
    std::vector<std::unique_ptr<Setup>> setups;
    setups.push_back(make_setup(pg, amp::ZeroStage::kNone, amp::ZeroPublish::kInStep, d, layers));
    for (const auto stage : {amp::ZeroStage::kOne, amp::ZeroStage::kTwo}) {
      for (const auto publish : {amp::ZeroPublish::kInStep, amp::ZeroPublish::kAtNextForward}) {
        setups.push_back(make_setup(pg, stage, publish, d, layers));
      }
    }
    torch::manual_seed(1 + static_cast<uint64_t>(pg.rank()));
    const auto x = torch::randn({tokens, d});
    for (auto& s : setups) {  // warm-up
      iteration(*s, x);
      s->amp_->optimizer.wait_for_parameters();
    }
    for (int r = 0; r < rounds; ++r) {
      for (auto& s : setups) {
        pg.barrier();
        const auto start = Clock::now();
        double step_seconds = 0;
        for (int k = 0; k < iterations_per_sample; ++k) step_seconds += iteration(*s, x);
        s->amp_->optimizer.wait_for_parameters();  // the last step's deferred all-gather belongs to this sample
        const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
        s->iteration_seconds.push_back(seconds / iterations_per_sample);
        s->step_seconds.push_back(step_seconds / iterations_per_sample);
      }
    }
    if (pg.rank() != 0) return;
    int64_t params = 0;
    for (const auto& p : setups[0]->net->parameters()) params += p.numel();
    fmt::print(
        "\niteration time (zero_grad + forward + backward + step), 2 ranks (Gloo), {} thread(s) each, {:.1f} M "
        "parameters, {} tokens per rank, median of {} rounds of {} iterations\n"
        "| setup | iteration ms | x DDP + amp | step() ms (excludes a deferred wait) |\n|---|---|---|---|\n",
        threads, static_cast<double>(params) / 1e6, tokens, rounds, iterations_per_sample);
    const double base = bench::median(setups[0]->iteration_seconds);
    double worst = 0;
    for (const auto& s : setups) {
      const double t = bench::median(s->iteration_seconds);
      if (s->stage != amp::ZeroStage::kNone) worst = std::max(worst, t / base);
      fmt::print("| {} | {:.2f} | {:.3f}x | {:.2f} |\n", setup_name(*s), t * 1e3, t / base,
                 bench::median(s->step_seconds) * 1e3);
    }
    for (size_t i = 1; i + 1 < setups.size(); i += 2) {  // each stage: in step, then at next forward
      fmt::print("{}: all-gather at next forward / in step: {:.3f}x the iteration\n", stage_name(setups[i]->stage),
                 bench::median(setups[i + 1]->iteration_seconds) / bench::median(setups[i]->iteration_seconds));
    }
    fmt::print("slowest ZeRO setup: {:.3f}x DDP + amp's iteration (goal <= {:.2f}x: {})\n", worst, kStepGoal,
               worst <= kStepGoal ? "met" : "NOT met");
  });
}

}  // namespace

int main(int argc, char** argv) {
  bool full = false;
  int threads = 1;
  CLI::App app{
      "ZeRO stages 1 and 2 vs DDP + amp O2: memory per rank and iteration time, with the all-gather in step() and at "
      "the next forward (Gloo, forked local ranks)"};
  app.add_flag("--full", full, "Memory at ~100 M parameters on 2 and 4 ranks, and 20 timed rounds");
  app.add_option("--threads", threads, "Intra-op threads per rank for the iteration time")->check(CLI::PositiveNumber);
  bool step_only = false;
  app.add_flag("--step-time-only", step_only, "With --full: only the iteration-time table (no memory runs)");
  if (const auto status = examples::parse_flags(app, argc, argv)) return *status;
  if (full && step_only) {
    iteration_time(512, 4, 512, 20, 3, threads);
  } else if (full) {
    memory(2, 1024, 8);
    memory(4, 1024, 8);
    iteration_time(512, 4, 512, 20, 3, threads);
  } else {
    memory(2, 256, 2);
    iteration_time(256, 2, 128, 5, 2, threads);
  }
  return 0;
}
