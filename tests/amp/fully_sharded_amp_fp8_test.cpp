// FP8 layers inside units of full sharding (docs/fsdp.md, "With amp"): amp::Float8Linear layers in
// ddp::ShardedUnits, amp O1 and O2 with FP8 (delayed and current scaling), train bit for bit what DDP + amp with the
// same FP8 recipe trains, at 2 ranks, over 12 steps with gradient accumulation and a step every rank skips for an inf
// in one rank's input. Each layer reads its weight gathered (the same values on every rank) and casts it to FP8 per
// forward as unsharded; the amaxes of inputs and output gradients are max-reduced over the ranks in both. Gloo on CPU.

#include <memory>
#include <mutex>
#include <string>

#include <amp/amp.h>
#include <amp/nn/float8_linear.h>
#include <amp/optim/fused_optimizers.h>
#include <ddp/distributed_data_parallel.h>
#include <ddp/fsdp/fully_sharded.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "amp/fully_sharded_amp_test_util.h"
#include "ddp/ddp_test_util.h"

namespace {

using namespace fsdp_amp_test;  // NOLINT(google-build-using-namespace): the shared loop and setup

constexpr int64_t kWidth = 32;  // FP8 GEMMs take dimensions that are multiples of 16

/// A residual block of two FP8 layers: the unit.
struct Fp8BlockImpl : torch::nn::Module {
  Fp8BlockImpl() {
    fc1 = register_module("fc1", amp::Float8Linear(kWidth, 2 * kWidth));
    fc2 = register_module("fc2", amp::Float8Linear(2 * kWidth, kWidth));
  }
  torch::Tensor forward(const torch::Tensor& x) { return x + fc2(torch::tanh(fc1(x))); }
  amp::Float8Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(Fp8Block);

/// fsdp_test's batches (12 features in, 5 out) through torch::nn::Linear ends (they stay in amp's precision) and two
/// FP8 blocks, each a unit when `sharded`.
struct Fp8NetImpl : torch::nn::Module {
  explicit Fp8NetImpl(bool sharded) {
    embed = register_module("embed", torch::nn::Linear(fsdp_test::kIn, kWidth));
    for (int b = 0; b < 2; ++b) {
      if (sharded) {
        blocks->push_back(ddp::ShardedUnit(Fp8Block()));
      } else {
        blocks->push_back(Fp8Block());
      }
    }
    register_module("blocks", blocks);
    head = register_module("head", torch::nn::Linear(kWidth, fsdp_test::kOut));
  }
  torch::Tensor forward(const torch::Tensor& x) { return head(blocks->forward(embed(x))); }
  torch::nn::Linear embed{nullptr}, head{nullptr};
  torch::nn::Sequential blocks;
};
TORCH_MODULE(Fp8Net);

/// Rank 0's model on every rank (the global generator is shared by thread ranks: under a lock).
Fp8Net make_fp8_net(bool sharded) {
  static std::mutex generator;
  std::lock_guard<std::mutex> lock(generator);
  torch::manual_seed(11);
  return Fp8Net(sharded);
}

amp::Options fp8_options(const AmpSetup& setup, amp::Fp8Scaling scaling) {
  return setup.options().fp8(amp::Fp8Recipe().scaling(scaling).amax_history_len(4));
}

AmpRun train_ddp_fp8(const ddp::ProcessGroup& pg, int rank, const AmpSetup& setup, amp::Fp8Scaling scaling) {
  Fp8Net net = make_fp8_net(/*sharded=*/false);
  amp::FusedAdamW inner(net->parameters(), amp::FusedAdamOptions(1e-2).weight_decay(1e-2));
  return train_ddp_over(net, inner, fp8_options(setup, scaling), pg, rank, setup);
}

AmpRun train_fsdp_fp8(const ddp::ProcessGroup& pg, int rank, const AmpSetup& setup, amp::Fp8Scaling scaling) {
  Fp8Net net = make_fp8_net(/*sharded=*/true);
  ddp::FullyShardedDataParallel fsdp(net, pg, fsdp_options(setup));
  amp::FusedAdamW inner(fsdp.parameters(), amp::FusedAdamOptions(1e-2).weight_decay(1e-2));
  auto [model, optimizer] = amp::initialize(fsdp, inner, fp8_options(setup, scaling));
  std::string report;
  for (const auto& line : optimizer.fp8_report()) report += line + "\n";
  TORCH_CHECK(report.find("4 of 4 Float8Linear layers run in FP8") != std::string::npos, "rank ", rank,
              ": the units' layers do not run in FP8: ", report);
  AmpRun run;
  train_loop(
      setup, rank, optimizer, [&](const torch::Tensor& x) { return model.forward(x); }, [&] { return fsdp.no_sync(); },
      run);
  run.values = fsdp.full_parameters();
  return run;
}

TEST(FullyShardedAmpFp8Test, Fp8LayersInsideUnitsTrainLikeDdpAmpBitForBit) {
  LTA_REQUIRE_GLOO();
  ddp_test::run_ranks(
      [](int rank, const ddp::ProcessGroup& pg) {
        for (const amp::OptLevel level : {amp::OptLevel::O2, amp::OptLevel::O1}) {
          for (const amp::Fp8Scaling scaling : {amp::Fp8Scaling::kDelayed, amp::Fp8Scaling::kCurrent}) {
            AmpSetup setup;
            setup.level = level;
            const std::string what = std::string("rank ") + std::to_string(rank) +
                                     (level == amp::OptLevel::O2 ? ", O2" : ", O1") +
                                     (scaling == amp::Fp8Scaling::kDelayed ? ", delayed" : ", current");
            const AmpRun ddp = train_ddp_fp8(pg, rank, setup, scaling);
            TORCH_CHECK(ddp.skipped[static_cast<size_t>(setup.inf_step)] == 1, what, ": step ", setup.inf_step,
                        " was not skipped");
            check_same(train_fsdp_fp8(pg, rank, setup, scaling), ddp, what);
          }
        }
      },
      2);
}

}  // namespace
