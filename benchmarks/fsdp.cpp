// Question: what does full sharding (ddp::FullyShardedDataParallel, ZeRO stage 3) hold per rank, and what does a
// training iteration cost, against DDP on the same model? FP32 with torch::optim::AdamW (with amp: bench_fsdp_amp),
// Gloo on the CPU, forked local ranks.
//
// Memory: the transformer-shaped stack of bench_zero (~100 M parameters at --full), each block one unit. After one
// iteration each rank counts tensor storage: DDP's parameters, gradients, buckets kept between steps and AdamW's two
// moments; full sharding's shards, their gradients and the moments of the shards, and the most bytes of full
// parameters gathered at once and of full-size gradient buffers in reduction at once during the iteration. Each
// mode runs in processes of its own, so the peak resident size (getrusage, the most over the ranks) is that mode's;
// it includes building the full model before it is sharded (also given above what the rank held when it started, to
// compare with benchmarks/peers/torch_fsdp_peer.py --memory, a Python process). The formula: (4 + 4 + 8) Ψ / N for full
// sharding plus the gathered units and the gradient buffers in reduction, against (4 + 4 + 4 + 8) Ψ.
//
// Iteration time: a smaller stack, 2 ranks, DDP and full sharding (default options, then without prefetch)
// interleaved round by round on the same data, medians. An iteration is zero_grad, forward, backward and step.
#include <algorithm>
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <torch/torch.h>
#include <CLI/CLI.hpp>

#include <ddp/distributed_data_parallel.h>
#include <ddp/fsdp/fully_sharded.h>
#include <ddp/launch/spawn.h>
#include <ddp/process_group.h>

#include "common/block_stack.h"
#include "common/command_line.h"
#include "common/memory_cap.h"
#include "common/timing.h"

namespace {

using bench::mib;
using bench::peak_rss;
using bench::Stack;
constexpr std::chrono::milliseconds kTimeout{600000};
constexpr double kStepGoal = 1.3;

enum class Mode { kDdp, kFsdp, kFsdpNoPrefetch };

const char* mode_name(Mode m) {
  return m == Mode::kDdp ? "DDP" : m == Mode::kFsdp ? "full sharding" : "full sharding, no prefetch";
}

/// One mode's model, wrapper and optimizer on this rank.
struct Setup {
  Mode mode;
  Stack net{nullptr};
  std::unique_ptr<ddp::DistributedDataParallel> ddp_net;
  std::unique_ptr<ddp::FullyShardedDataParallel> fsdp;
  std::unique_ptr<torch::optim::AdamW> adam;
};

std::unique_ptr<Setup> make_setup(const ddp::ProcessGroup& pg, Mode mode, int64_t d, int layers) {
  auto s = std::make_unique<Setup>();
  s->mode = mode;
  torch::manual_seed(0);
  s->net = Stack(d, layers, /*sharded_units=*/mode != Mode::kDdp);
  const auto options = torch::optim::AdamWOptions(1e-4).weight_decay(1e-2);
  if (mode == Mode::kDdp) {
    s->ddp_net = std::make_unique<ddp::DistributedDataParallel>(s->net, pg);
    s->adam = std::make_unique<torch::optim::AdamW>(s->net->parameters(), options);
  } else {
    s->fsdp = std::make_unique<ddp::FullyShardedDataParallel>(s->net, pg,
                                                              ddp::FullyShardOptions().prefetch(mode == Mode::kFsdp));
    s->adam = std::make_unique<torch::optim::AdamW>(s->fsdp->parameters(), options);
  }
  return s;
}

void iteration(Setup& s, const torch::Tensor& x) {
  s.adam->zero_grad();
  const auto y = s.ddp_net ? s.ddp_net->forward(x) : s.fsdp->forward(x);
  y.pow(2).mean().backward();
  s.adam->step();
}

int64_t storage_bytes(const torch::Tensor& t) { return t.defined() ? static_cast<int64_t>(t.storage().nbytes()) : 0; }

struct Bytes {
  int64_t params = 0, grads = 0, buckets = 0, adam = 0, gathered = 0, reducing = 0;
  int64_t total() const { return params + grads + buckets + adam + gathered + reducing; }
};

Bytes measure(Setup& s) {
  Bytes b;
  for (const auto& [key, state] : s.adam->state()) {
    const auto& adam = static_cast<const torch::optim::AdamWParamState&>(*state);
    b.adam += storage_bytes(adam.exp_avg()) + storage_bytes(adam.exp_avg_sq()) + storage_bytes(adam.max_exp_avg_sq());
  }
  if (s.ddp_net) {
    for (const auto& p : s.net->parameters()) {
      b.params += storage_bytes(p);
      b.grads += storage_bytes(p.grad());
    }
    for (const auto& info : s.ddp_net->buckets()) b.buckets += info.bytes;
  } else {
    for (const auto& shard : s.fsdp->parameters()) {
      b.params += storage_bytes(shard);
      b.grads += storage_bytes(shard.grad());
    }
    b.gathered = s.fsdp->peak_gathered_bytes();
    b.reducing = s.fsdp->peak_reduction_bytes();
  }
  return b;
}

void memory(int world, Mode mode, int64_t d, int layers) {
  ddp::spawn(world, [&](int, int) {
    const int64_t start_rss = bench::current_rss();
    at::set_num_threads(1);
    const ddp::ProcessGroup pg = ddp::init_process_group(ddp::InitOptions().timeout(kTimeout));
    const auto x = torch::randn({2, 8, d});
    auto s = make_setup(pg, mode, d, layers);
    if (s->fsdp) s->fsdp->reset_peak_gathered_bytes();
    iteration(*s, x);
    const Bytes b = measure(*s);
    int64_t params = 0;
    for (const auto& p : bench::Stack(d, 1)->parameters()) params += p.numel();
    params *= layers;
    auto rss =
        torch::tensor({static_cast<double>(peak_rss()), static_cast<double>(peak_rss() - start_rss)}, torch::kDouble);
    pg.allreduce_max_(rss, "peak RSS");
    if (pg.rank() != 0) return;
    const double psi = static_cast<double>(params);
    const double formula = mode == Mode::kDdp ? 20 * psi : 16 * psi / world;
    fmt::print(
        "| {} | {} | {:.1f} | {:.1f} | {:.1f} | {:.1f} | {:.1f} | {:.1f} | {:.1f} | {:.1f} | {:.3f} | {:.0f} ({:.0f} "
        "above the rank's start) |\n",
        world, mode_name(mode), psi / 1e6, mib(b.params), mib(b.grads), mib(b.buckets), mib(b.adam), mib(b.gathered),
        mib(b.reducing), mib(b.total()), static_cast<double>(b.total() - b.gathered - b.reducing) / formula,
        mib(static_cast<int64_t>(rss[0].item<double>())), mib(static_cast<int64_t>(rss[1].item<double>())));
  });
}

/// `steps` iterations of `mode` on `world` ranks, each rank in a cgroup capped at `cap_mib`; prints what happened.
void capped_run(int world, Mode mode, int64_t d, int layers, int64_t cap_mib, int steps) {
  const std::string failed = bench::spawn_capped(world, cap_mib, [&](int, int) {
    at::set_num_threads(1);
    const ddp::ProcessGroup pg = ddp::init_process_group(ddp::InitOptions().timeout(kTimeout));
    const auto x = torch::randn({2, 8, d});
    auto s = make_setup(pg, mode, d, layers);
    for (int i = 0; i < steps; ++i) iteration(*s, x);
    auto rss = torch::tensor({static_cast<double>(peak_rss())}, torch::kDouble);
    pg.allreduce_max_(rss, "peak RSS");
    if (pg.rank() == 0) {
      fmt::print("{}: trained {} iterations under the cap; peak RSS {:.0f} MiB (the most over the ranks)\n",
                 mode_name(mode), steps, mib(static_cast<int64_t>(rss.item<double>())));
    }
  });
  if (!failed.empty()) fmt::print("{}: did not train under the cap: {}\n", mode_name(mode), failed);
}

void iteration_time(int64_t d, int layers, int64_t tokens, int rounds, int iterations_per_sample, int threads) {
  ddp::spawn(2, [&](int, int) {
    at::set_num_threads(threads);
    const ddp::ProcessGroup pg = ddp::init_process_group(ddp::InitOptions().timeout(kTimeout));
    std::vector<std::unique_ptr<Setup>> setups;
    for (const Mode mode : {Mode::kDdp, Mode::kFsdp, Mode::kFsdpNoPrefetch}) {
      setups.push_back(make_setup(pg, mode, d, layers));
    }
    torch::manual_seed(1 + static_cast<uint64_t>(pg.rank()));
    const auto x = torch::randn({tokens, d});
    for (auto& s : setups) iteration(*s, x);  // warm-up
    std::vector<std::function<void()>> runs;
    for (auto& s : setups) runs.emplace_back([&s, &x] { iteration(*s, x); });
    const auto seconds = bench::time_rounds_on_ranks(
        runs, [&] { pg.barrier(); }, rounds, iterations_per_sample);
    if (pg.rank() != 0) return;
    int64_t params = 0;
    for (const auto& p : setups[0]->net->parameters()) params += p.numel();
    fmt::print(
        "\niteration time (zero_grad + forward + backward + AdamW step), FP32, 2 ranks (Gloo), {} thread(s) each, "
        "{:.1f} M parameters in {} units, {} tokens per rank, median of {} rounds of {} iterations [min, max of the "
        "per-round ratios]\n| setup | iteration ms | x DDP |\n|---|---|---|\n",
        threads, static_cast<double>(params) / 1e6, layers, tokens, rounds, iterations_per_sample);
    std::vector<std::string> names;
    for (const auto& s : setups) names.emplace_back(mode_name(s->mode));
    const double ratio = bench::print_ratio_rows(names, seconds)[1];  // full sharding's
    fmt::print("full sharding: {:.3f}x DDP's iteration (goal <= {:.1f}x: {})\n", ratio, kStepGoal,
               ratio <= kStepGoal ? "met" : "NOT met");
  });
}

}  // namespace

int main(int argc, char** argv) {
  bool full = false;
  int threads = 1;
  bool step_only = false;
  CLI::App app{
      "Full sharding (ddp::FullyShardedDataParallel) vs DDP, FP32 with AdamW: memory per rank and iteration time "
      "(Gloo, forked local ranks)"};
  app.add_flag("--full", full, "Memory at ~100 M parameters on 2 and 4 ranks, and 20 timed rounds");
  app.add_option("--threads", threads, "Intra-op threads per rank for the iteration time")->check(CLI::PositiveNumber);
  app.add_flag("--step-time-only", step_only, "Only the iteration-time table (no memory runs)");
  int64_t cap_mib = 0;
  int cap_ranks = 2;
  app.add_option("--cap-mib", cap_mib,
                 "Only this: DDP and full sharding train 3 iterations of the --full model with each rank in a memory "
                 "cgroup capped at this many MiB (root, cgroup v1); the OOM killer ends a rank past it")
      ->check(CLI::PositiveNumber);
  app.add_option("--cap-ranks", cap_ranks, "Ranks of the --cap-mib runs")->check(CLI::Range(2, 8));
  if (const auto status = examples::parse_flags(app, argc, argv)) return *status;
  if (cap_mib > 0) {
    fmt::print("each rank capped at {} MiB, {} ranks, 100.8 M parameters, FP32 AdamW:\n", cap_mib, cap_ranks);
    for (const Mode mode : {Mode::kDdp, Mode::kFsdp}) capped_run(cap_ranks, mode, 1024, 8, cap_mib, 3);
    return 0;
  }
  const int64_t d = full ? 1024 : 256;
  const int layers = full ? 8 : 2;
  if (!step_only) {
    fmt::print(
        "memory per rank (rank 0; peak RSS: the most over the ranks), after one iteration, MiB\n"
        "| ranks | mode | M params | params / shards | grads | DDP buckets | AdamW moments | most gathered at once "
        "| most in reduction at once | total | (total - the two) / formula | peak RSS |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    for (const int world : {2, 4}) {
      if (!full && world == 4) break;
      for (const Mode mode : {Mode::kDdp, Mode::kFsdp}) memory(world, mode, d, layers);
    }
  }
  if (full) {
    iteration_time(512, 4, 512, 20, 3, threads);
  } else {
    iteration_time(256, 2, 128, 5, 2, threads);
  }
  return 0;
}
