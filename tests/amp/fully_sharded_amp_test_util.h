#pragma once

// What the tests of amp over full sharding share (fully_sharded_amp_test.cpp, fully_sharded_amp_checkpoint_test.cpp):
// the options, the loop, and one run through DDP + amp and through amp over full sharding, on the residual MLP of
// ddp/fully_sharded_test_util.h.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <amp/amp.h>
#include <amp/optim/fused_optimizers.h>
#include <ddp/distributed_data_parallel.h>
#include <ddp/fsdp/fully_sharded.h>
#include <torch/torch.h>

#include "ddp/fully_sharded_test_util.h"

namespace fsdp_amp_test {

using fsdp_test::Net;

enum class Opt { kFusedAdamW, kSgd };

inline std::unique_ptr<torch::optim::Optimizer> make_optimizer(Opt opt, const std::vector<torch::Tensor>& params) {
  if (opt == Opt::kSgd) return std::make_unique<torch::optim::SGD>(params, fsdp_test::sgd());
  return std::make_unique<amp::FusedAdamW>(params, amp::FusedAdamOptions(1e-2).weight_decay(1e-2));
}

struct AmpSetup {
  amp::OptLevel level = amp::OptLevel::O2;
  Opt opt = Opt::kFusedAdamW;
  bool clip = false;
  int first_step = 0;                  // a resumed run starts later
  int steps = 12;                      // the step it stops before
  int inf_step = 7;                    // a step whose input on rank 1 holds an inf: every rank skips it
  torch::Device device = torch::kCPU;  // where the model and the batches live
  amp::Options options() const {
    return amp::Options().opt_level(level).half_dtype(torch::kBFloat16).dynamic_loss_scale();
  }
};

struct AmpRun {
  std::vector<float> losses;
  std::vector<int64_t> skipped;
  std::vector<float> flag_after_clip;
  std::vector<std::pair<std::string, torch::Tensor>> values;  // every parameter's fp32 value (masters under O2)
  amp::HeldBytes held;
};

/// The loop both runs share: gradient accumulation at every fifth step (a no_sync pass with delay_unscale, then a
/// synchronized one), an inf in rank 1's input at setup.inf_step, optional clipping.
template <typename Forward, typename NoSync>
void train_loop(const AmpSetup& setup, int rank, amp::Optimizer& optimizer, Forward&& forward, NoSync&& no_sync,
                AmpRun& run) {
  for (int s = setup.first_step; s < setup.steps; ++s) {
    optimizer.zero_grad();
    auto loss_of = [&](int micro, bool plant_inf) {
      fsdp_test::Batch b = fsdp_test::batch(3, rank, 2 * s + micro, setup.device);
      if (plant_inf) b.x[0][0] = std::numeric_limits<float>::infinity();
      return torch::mse_loss(forward(b.x), b.y);
    };
    if (s % 5 == 3) {
      auto guard = no_sync();
      auto scaled = amp::scale_loss(loss_of(1, false), optimizer, 0, /*delay_unscale=*/true);
      scaled.backward();
    }
    torch::Tensor loss = loss_of(0, s == setup.inf_step && rank == 1);
    {
      auto scaled = amp::scale_loss(loss, optimizer);
      scaled.backward();
    }
    if (setup.clip) {
      amp::clip_grad_norm_(optimizer, 0.05);
      run.flag_after_clip.push_back(optimizer.found_inf().item<float>());
    }
    optimizer.step();
    run.losses.push_back(loss.item<float>());
    run.skipped.push_back(static_cast<int64_t>(optimizer.last_step_now().skipped));
  }
  run.held = optimizer.held_bytes();
}

/// Called with the amp optimizer before the first step (a load) or after the last (a save).
using Hook = std::function<void(amp::Optimizer&)>;

/// DDP + amp over `net` (every rank passes rank 0's model) with `inner` over its parameters and `options`, attached:
/// every bucket reduced in fp32 and unscaled into the optimizer's gradients.
template <typename ModuleHolder>
AmpRun train_ddp_over(ModuleHolder net, torch::optim::Optimizer& inner, const amp::Options& options,
                      const ddp::ProcessGroup& pg, int rank, const AmpSetup& setup, const Hook& before = nullptr) {
  auto [model, optimizer] = amp::initialize(net, inner, options);
  ddp::DistributedDataParallel ddp(net, pg, ddp::DistributedDataParallelOptions().allreduce_dtype(torch::kFloat));
  optimizer.attach(ddp);
  if (before) before(optimizer);
  AmpRun run;
  train_loop(
      setup, rank, optimizer,
      [&](const torch::Tensor& x) { return model.call([&](const torch::Tensor& in) { return ddp.forward(in); }, x); },
      [&] { return ddp.no_sync(); }, run);
  const auto named = net->named_parameters();
  for (size_t i = 0; i < named.size(); ++i) {
    run.values.emplace_back(named[i].key(), optimizer.state().slots()[i].master.detach().cpu().clone());
  }
  return run;
}

/// DDP + amp on the residual MLP. Every rank builds rank 0's model: DDP starts the ranks from rank 0's parameters, but
/// amp::initialize took the fp32 masters before.
inline AmpRun train_ddp(const ddp::ProcessGroup& pg, int rank, const AmpSetup& setup, const Hook& before = nullptr) {
  Net net = fsdp_test::make_net(3, /*rank=*/0, /*sharded=*/false, setup.device);
  auto inner = make_optimizer(setup.opt, net->parameters());
  return train_ddp_over(net, *inner, setup.options(), pg, rank, setup, before);
}

/// Same values and losses, bit for bit (a NaN loss equal to a NaN); throws naming the first difference.
inline void check_same(const AmpRun& a, const AmpRun& b, const std::string& what) {
  TORCH_CHECK(a.losses.size() == b.losses.size(), what, ": ", a.losses.size(), " and ", b.losses.size(), " steps");
  for (size_t s = 0; s < a.losses.size(); ++s) {
    TORCH_CHECK(std::memcmp(&a.losses[s], &b.losses[s], sizeof(float)) == 0, what, ": loss ", s, " is ", a.losses[s],
                " and ", b.losses[s]);
  }
  TORCH_CHECK(a.skipped == b.skipped, what, ": other steps were skipped");
  TORCH_CHECK(a.values.size() == b.values.size(), what, ": parameter counts differ");
  for (size_t i = 0; i < a.values.size(); ++i) {
    TORCH_CHECK(a.values[i].first == b.values[i].first && torch::equal(a.values[i].second, b.values[i].second), what,
                ": ", a.values[i].first, " differs");
  }
}

inline ddp::FullyShardOptions fsdp_options(const AmpSetup& setup) {
  ddp::FullyShardOptions options;
  options.reduce_dtype(torch::kFloat);
  if (setup.level == amp::OptLevel::O2) options.param_dtype(torch::kBFloat16);
  return options;
}

using ShardedModel = amp::Model<amp::FullyShardedModule>;

/// amp over full sharding: the optimizer over the shards, the model called through amp's Model; `before` and `after`
/// (optional) get the model and the optimizer before the first step and after the last. `seed` builds each rank's
/// model (the ranks start from rank 0's).
inline AmpRun train_fsdp(const ddp::ProcessGroup& pg, int rank, const AmpSetup& setup,
                         const std::function<void(ShardedModel&, amp::Optimizer&)>& after = nullptr,
                         const Hook& before = nullptr, uint64_t seed = 3) {
  Net net = fsdp_test::make_net(seed, rank, /*sharded=*/true, setup.device);
  ddp::FullyShardedDataParallel fsdp(net, pg, fsdp_options(setup));
  auto inner = make_optimizer(setup.opt, fsdp.parameters());
  auto [model, optimizer] = amp::initialize(fsdp, *inner, setup.options());
  if (before) before(optimizer);
  AmpRun run;
  train_loop(
      setup, rank, optimizer, [&](const torch::Tensor& x) { return model.forward(x); }, [&] { return fsdp.no_sync(); },
      run);
  run.values = fsdp.full_parameters();
  for (auto& [name, value] : run.values) value = value.cpu();
  if (after) after(model, optimizer);
  return run;
}

/// Largest |a - b| / max|b| per tensor, over the parameters (throws when the names differ).
inline double max_relative_difference(const AmpRun& a, const AmpRun& b) {
  TORCH_CHECK(a.values.size() == b.values.size(), "different parameter counts");
  double worst = 0;
  for (size_t i = 0; i < a.values.size(); ++i) {
    TORCH_CHECK(a.values[i].first == b.values[i].first, "parameter ", i, " is ", a.values[i].first, " and ",
                b.values[i].first);
    const auto x = a.values[i].second.to(torch::kDouble), y = b.values[i].second.to(torch::kDouble);
    worst = std::max(worst, (x - y).abs().max().item<double>() / y.abs().max().item<double>());
  }
  return worst;
}

}  // namespace fsdp_amp_test
