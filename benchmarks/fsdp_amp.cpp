// Question: what does amp O2 over full sharding (amp::initialize over a ddp::FullyShardedDataParallel, bf16
// gathered from fp32 shards, amp::FusedAdamW) hold per rank, and what does an iteration cost, against DDP + amp O2
// and ZeRO stage 2 on the same model? Gloo on the CPU, forked local ranks.
//
// Memory: the transformer-shaped stack of bench_zero (8 blocks of d = 1024, 100.8 M parameters), each block a unit.
// Each mode runs in processes of its own (two iterations on a small batch); each rank counts, after the first
// iteration, amp's held bytes (fp32 masters, their gradients and AdamW's two moments: the shards under full
// sharding), the model's own parameters (bf16 under O2; none between steps under full sharding), DDP's buckets, and
// for full sharding the most bytes of gathered units and of gradient buffers in reduction at once; then, over the
// second iteration, the most tensor bytes live at once on the rank's thread (bench::AllocationTracker: the
// allocator's own count, activations included). The formula of the issue: (2 + 2 + 12) Ψ / N plus two gathered units
// for full sharding (ours keeps no bf16 shard and fp32 shard gradients: 4 + 4 + 8, the same 16 bytes); ZeRO stage 2:
// 2 Ψ of bf16 model plus 16 Ψ / N; DDP + amp: 2 + 2 + 16 Ψ.
//
// Iteration time: a smaller stack, 2 ranks, DDP + amp O2 and amp O2 over full sharding (with and without prefetch)
// interleaved round by round on the same data, medians. Then five recorded iterations of each (ddp::Timeline): the
// share of full sharding's all-gathers and reduce-scatters during which the host did not wait for them
// (ddp::collective_hidden_share) and DDP's allreduce overlap with backward (ddp::allreduce_overlap).
#include <algorithm>
#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <torch/torch.h>
#include <CLI/CLI.hpp>

#include <amp/amp.h>
#include <amp/optim/fused_optimizers.h>
#include <ddp/distributed_data_parallel.h>
#include <ddp/fsdp/fully_sharded.h>
#include <ddp/launch/spawn.h>
#include <ddp/process_group.h>
#include <ddp/timeline.h>

#include "common/allocation_tracker.h"
#include "common/block_stack.h"
#include "common/command_line.h"
#include "common/memory_cap.h"
#include "common/timing.h"

namespace {

using bench::mib;
using bench::Stack;
constexpr std::chrono::milliseconds kTimeout{600000};
constexpr double kStepGoal = 1.3;
constexpr double kMemoryGoal = 0.10;  // within 10% of the formula
constexpr int kFullD = 1024;
constexpr int kFullLayers = 8;

enum class Mode { kDdpAmp, kZero2, kFsdpAmp, kFsdpAmpNoPrefetch };

const char* mode_name(Mode m) {
  switch (m) {
    case Mode::kDdpAmp:
      return "DDP + amp O2";
    case Mode::kZero2:
      return "ZeRO stage 2 + amp O2";
    case Mode::kFsdpAmp:
      return "full sharding + amp O2";
    case Mode::kFsdpAmpNoPrefetch:
      return "full sharding + amp O2, no prefetch";
  }
  return "?";
}

bool sharded(Mode m) { return m == Mode::kFsdpAmp || m == Mode::kFsdpAmpNoPrefetch; }

amp::Options amp_options() {
  return amp::Options().opt_level(amp::OptLevel::O2).half_dtype(torch::kBFloat16).dynamic_loss_scale();
}

/// One mode's model, wrappers, amp and optimizer on this rank.
struct Setup {
  Mode mode;
  Stack net{nullptr};
  std::unique_ptr<ddp::DistributedDataParallel> ddp_net;
  std::unique_ptr<ddp::FullyShardedDataParallel> fsdp;
  std::unique_ptr<amp::FusedAdamW> inner;
  std::unique_ptr<amp::Initialized<Stack>> replicated;
  std::unique_ptr<amp::Initialized<amp::FullyShardedModule>> fully_sharded;
  amp::Optimizer* optimizer = nullptr;

  torch::Tensor forward(const torch::Tensor& x) {
    if (fully_sharded) return fully_sharded->model.forward(x);
    return replicated->model.call([&](const torch::Tensor& in) { return ddp_net->forward(in); }, x);
  }
};

std::unique_ptr<Setup> make_setup(const ddp::ProcessGroup& pg, Mode mode, int64_t d, int layers) {
  auto s = std::make_unique<Setup>();
  s->mode = mode;
  torch::manual_seed(0);
  s->net = Stack(d, layers, /*sharded_units=*/sharded(mode));
  const auto adam = amp::FusedAdamOptions(1e-4).weight_decay(1e-2);
  if (sharded(mode)) {
    s->fsdp = std::make_unique<ddp::FullyShardedDataParallel>(
        s->net, pg, ddp::FullyShardOptions().param_dtype(torch::kBFloat16).prefetch(mode == Mode::kFsdpAmp));
    s->inner = std::make_unique<amp::FusedAdamW>(s->fsdp->parameters(), adam);
    s->fully_sharded = std::make_unique<amp::Initialized<amp::FullyShardedModule>>(
        amp::initialize(*s->fsdp, *s->inner, amp_options()));
    s->optimizer = &s->fully_sharded->optimizer;
  } else {
    s->inner = std::make_unique<amp::FusedAdamW>(s->net->parameters(), adam);
    s->replicated = std::make_unique<amp::Initialized<Stack>>(amp::initialize(s->net, *s->inner, amp_options()));
    s->ddp_net = std::make_unique<ddp::DistributedDataParallel>(s->net, pg);
    s->optimizer = &s->replicated->optimizer;
    s->optimizer->attach(*s->ddp_net, mode == Mode::kZero2 ? amp::ZeroStage::kTwo : amp::ZeroStage::kNone);
  }
  return s;
}

void iteration(Setup& s, const torch::Tensor& x) {
  s.optimizer->zero_grad();
  const auto y = s.forward(x);
  {
    auto scaled = amp::scale_loss(y.to(torch::kFloat).pow(2).mean(), *s.optimizer);
    scaled.backward();
  }
  s.optimizer->step();
}

struct Bytes {
  int64_t amp_held = 0, model = 0, buckets = 0, gathered = 0, reducing = 0;
  int64_t between_steps() const { return amp_held + model + buckets; }
};

Bytes measure(Setup& s) {
  Bytes b;
  b.amp_held = s.optimizer->held_bytes().total();
  if (s.fsdp) {
    b.gathered = s.fsdp->peak_gathered_bytes();
    b.reducing = s.fsdp->peak_reduction_bytes();
  } else {
    for (const auto& p : s.net->parameters()) b.model += static_cast<int64_t>(p.storage().nbytes());
    for (const auto& info : s.ddp_net->buckets()) b.buckets += info.bytes;
  }
  return b;
}

/// The formula for `mode` at `world` ranks, bytes: what a rank holds between steps, plus (full sharding) two
/// gathered bf16 units.
double formula(Mode mode, double psi, int world, double unit_bytes) {
  if (mode == Mode::kDdpAmp) return 20 * psi;
  if (mode == Mode::kZero2) return 2 * psi + 16 * psi / world;
  return 16 * psi / world + 2 * unit_bytes;
}

void memory(int world, Mode mode, int64_t d, int layers) {
  ddp::spawn(world, [&](int, int) {
    const int64_t start_rss = bench::current_rss();
    bench::TrackAllocations track(torch::kCPU);  // before anything is allocated: every free is of a seen block
    at::set_num_threads(1);
    const ddp::ProcessGroup pg = ddp::init_process_group(ddp::InitOptions().timeout(kTimeout));
    const auto x = torch::randn({2, 8, d});
    auto s = make_setup(pg, mode, d, layers);
    if (s->fsdp) s->fsdp->reset_peak_gathered_bytes();
    iteration(*s, x);
    const Bytes b = measure(*s);
    track.tracker().reset_peak();
    iteration(*s, x);
    const int64_t step_peak = track.tracker().peak();
    int64_t params = 0;
    for (const auto& p : Stack(d, 1)->parameters()) params += p.numel();
    const double unit_bytes = 2.0 * static_cast<double>(params);  // one block in bf16
    params *= layers;
    const int64_t rss = bench::peak_rss();
    auto most =
        torch::tensor({static_cast<double>(rss), static_cast<double>(step_peak), static_cast<double>(rss - start_rss)},
                      torch::kDouble);
    pg.allreduce_max_(most, "peaks");
    if (pg.rank() != 0) return;
    const double psi = static_cast<double>(params);
    const double expected = formula(mode, psi, world, unit_bytes);
    const double counted = static_cast<double>(b.between_steps() + b.gathered);
    const double off = counted / expected - 1.0;
    fmt::print(
        "| {} | {} | {:.1f} | {:.1f} | {:.1f} | {:.1f} | {:.1f} | {:.1f} | {:.1f} ({:+.1f}%: {}) | {:.1f} | {:.0f} "
        "({:.0f} above the rank's start) |\n",
        world, mode_name(mode), mib(b.amp_held), mib(b.model), mib(b.buckets), mib(b.gathered), mib(b.reducing),
        counted / (1024.0 * 1024.0), expected / (1024.0 * 1024.0), 100.0 * off,
        std::abs(off) <= kMemoryGoal ? "within 10%" : "NOT within 10%",
        mib(static_cast<int64_t>(most[1].item<double>())), mib(static_cast<int64_t>(most[0].item<double>())),
        mib(static_cast<int64_t>(most[2].item<double>())));
  });
}

/// `steps` iterations of `mode` on `world` ranks, each rank in a cgroup capped at `cap_mib`; prints what happened.
void capped_run(int world, Mode mode, int64_t cap_mib, int steps) {
  const std::string failed = bench::spawn_capped(world, cap_mib, [&](int, int) {
    at::set_num_threads(1);
    const ddp::ProcessGroup pg = ddp::init_process_group(ddp::InitOptions().timeout(kTimeout));
    const auto x = torch::randn({2, 8, kFullD});
    auto s = make_setup(pg, mode, kFullD, kFullLayers);
    for (int i = 0; i < steps; ++i) iteration(*s, x);
    auto rss = torch::tensor({static_cast<double>(bench::peak_rss())}, torch::kDouble);
    pg.allreduce_max_(rss, "peak RSS");
    if (pg.rank() == 0) {
      fmt::print("| {} | {} MiB | {} | trained {} iterations; peak RSS {:.0f} MiB (the most over the ranks) |\n", world,
                 cap_mib, mode_name(mode), steps, mib(static_cast<int64_t>(rss.item<double>())));
    }
  });
  if (!failed.empty())
    fmt::print("| {} | {} MiB | {} | did not train: {} |\n", world, cap_mib, mode_name(mode), failed);
}

/// Five iterations of `s` recorded on a timeline: rank 0 prints what hid behind compute (every rank's figure).
void overlap(const ddp::ProcessGroup& pg, Setup& s, const torch::Tensor& x) {
  constexpr int64_t kSteps = 5;
  auto timeline = std::make_shared<ddp::Timeline>(ddp::TimelineWindow{1, kSteps});
  if (s.fsdp) {
    s.fsdp->set_timeline(timeline);
  } else {
    s.ddp_net->set_timeline(timeline);
  }
  for (int64_t step = 1; step <= kSteps; ++step) {
    timeline->begin_step(step);
    iteration(s, x);
    timeline->end_step();
  }
  if (s.fsdp) {
    s.fsdp->set_timeline(nullptr);
  } else {
    s.ddp_net->set_timeline(nullptr);
  }
  const auto events = timeline->resolve();
  const auto share = [](const std::optional<double>& v) { return v.value_or(-1.0); };
  // Per rank: [all-gather hidden, reduce-scatter hidden] (full sharding) or [allreduce overlap] (DDP).
  auto figures = torch::zeros({pg.size(), 2}, torch::kDouble);
  figures[pg.rank()][0] =
      s.fsdp ? share(ddp::collective_hidden_share(events, "all-gather")) : share(ddp::allreduce_overlap(events));
  figures[pg.rank()][1] = s.fsdp ? share(ddp::collective_hidden_share(events, "reduce-scatter")) : -1.0;
  pg.allreduce_sum_(figures, "overlap figures");
  if (pg.rank() != 0) return;
  // (A figure the timeline could not give, no collective recorded, prints as "n/a".)
  const auto percent = [](double v) { return v < 0 ? std::string("n/a") : fmt::format("{:.1f}%", 100.0 * v); };
  for (int r = 0; r < pg.size(); ++r) {
    if (s.fsdp) {
      fmt::print("| {} | rank {} | all-gathers: {} hidden | reduce-scatters: {} hidden |\n", mode_name(s.mode), r,
                 percent(figures[r][0].item<double>()), percent(figures[r][1].item<double>()));
    } else {
      fmt::print("| {} | rank {} | allreduces: {} during backward | |\n", mode_name(s.mode), r,
                 percent(figures[r][0].item<double>()));
    }
  }
}

void iteration_time(int64_t d, int layers, int64_t tokens, int rounds, int iterations_per_sample, int threads) {
  ddp::spawn(2, [&](int, int) {
    at::set_num_threads(threads);
    const ddp::ProcessGroup pg = ddp::init_process_group(ddp::InitOptions().timeout(kTimeout));
    std::vector<std::unique_ptr<Setup>> setups;
    for (const Mode mode : {Mode::kDdpAmp, Mode::kFsdpAmp, Mode::kFsdpAmpNoPrefetch}) {
      setups.push_back(make_setup(pg, mode, d, layers));
    }
    torch::manual_seed(1 + static_cast<uint64_t>(pg.rank()));
    const auto x = torch::randn({tokens, d});
    for (auto& s : setups) iteration(*s, x);  // warm-up
    std::vector<std::function<void()>> runs;
    for (auto& s : setups) runs.emplace_back([&s, &x] { iteration(*s, x); });
    const auto seconds = bench::time_rounds_on_ranks(
        runs, [&] { pg.barrier(); }, rounds, iterations_per_sample);
    if (pg.rank() == 0) {
      int64_t params = 0;
      for (const auto& p : setups[0]->net->parameters()) params += p.numel();
      fmt::print(
          "\niteration time (zero_grad + forward + scaled backward + FusedAdamW step), amp O2 bf16, 2 ranks (Gloo), {} "
          "thread(s) each, {:.1f} M parameters in {} units, {} tokens per rank, median of {} rounds of {} iterations "
          "[min, max of the per-round ratios]\n| setup | iteration ms | x DDP + amp |\n|---|---|---|\n",
          threads, static_cast<double>(params) / 1e6, layers, tokens, rounds, iterations_per_sample);
      std::vector<std::string> names;
      for (const auto& s : setups) names.emplace_back(mode_name(s->mode));
      const double ratio = bench::print_ratio_rows(names, seconds)[1];  // full sharding's
      fmt::print("full sharding + amp: {:.3f}x DDP + amp's iteration (goal <= {:.1f}x: {})\n", ratio, kStepGoal,
                 ratio <= kStepGoal ? "met" : "NOT met");
      fmt::print("\ncommunication hidden behind compute, 5 recorded iterations (ddp::Timeline)\n");
    }
    for (auto& s : setups) overlap(pg, *s, x);
  });
}

}  // namespace

int main(int argc, char** argv) {
  bool full = false;
  int threads = 1;
  bool step_only = false;
  int64_t cap_mib = 0;
  int cap_ranks = 4;
  CLI::App app{
      "amp O2 over full sharding vs DDP + amp O2 and ZeRO stage 2 (bf16, FusedAdamW): memory per rank, training "
      "under a memory cap, iteration time and the communication hidden behind compute (Gloo, forked local ranks)"};
  app.add_flag("--full", full, "Memory at 100.8 M parameters on 2 and 4 ranks, and 20 timed rounds");
  app.add_option("--threads", threads, "Intra-op threads per rank for the iteration time")->check(CLI::PositiveNumber);
  app.add_flag("--step-time-only", step_only, "Only the iteration time and the overlap (no memory runs)");
  app.add_option("--cap-mib", cap_mib,
                 "Only this: the three modes train 3 iterations of the --full model with each rank in a memory "
                 "cgroup capped at this many MiB (root, cgroup v1); the OOM killer ends a rank past it")
      ->check(CLI::PositiveNumber);
  app.add_option("--cap-ranks", cap_ranks, "Ranks of the --cap-mib runs")->check(CLI::Range(2, 8));
  if (const auto status = examples::parse_flags(app, argc, argv)) return *status;
  if (cap_mib > 0) {
    fmt::print("| ranks | cap per rank | mode | outcome |\n|---|---|---|---|\n");
    for (const Mode mode : {Mode::kDdpAmp, Mode::kZero2, Mode::kFsdpAmp}) capped_run(cap_ranks, mode, cap_mib, 3);
    return 0;
  }
  const int64_t d = full ? kFullD : 256;
  const int layers = full ? kFullLayers : 2;
  if (!step_only) {
    fmt::print(
        "memory per rank, MiB (rank 0's counts; the two peaks: the most over the ranks)\n"
        "| ranks | mode | amp held (masters, grads, AdamW) | model params | DDP buckets | most gathered at once "
        "| most in reduction at once | held + gathered | formula (off by) | most tensor bytes in a step | peak RSS |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|\n");
    for (const int world : {2, 4}) {
      if (!full && world == 4) break;
      for (const Mode mode : {Mode::kDdpAmp, Mode::kZero2, Mode::kFsdpAmp}) memory(world, mode, d, layers);
    }
  }
  if (full) {
    iteration_time(512, 4, 512, 20, 3, threads);
  } else {
    iteration_time(256, 2, 128, 5, 2, threads);
  }
  return 0;
}
