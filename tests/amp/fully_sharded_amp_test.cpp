// amp over full sharding (docs/fsdp.md, "With amp"): amp::initialize(fsdp, optimizer, options) trains what DDP + amp
// trains, bit for bit at 2 ranks (O1 and O2, a fused and a plain optimizer, gradient accumulation, a step skipped on
// every rank for an inf on one), within the sum-order bound at 4 ranks and with clipping; the model's consolidated
// save loads into an unsharded model; what cannot work is refused in one line. Gloo on CPU, forked ranks.

#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <sstream>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <amp/amp.h>
#include <amp/optim/fused_optimizers.h>
#include <ddp/distributed_data_parallel.h>
#include <ddp/fsdp/fully_sharded.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "amp/fully_sharded_amp_test_util.h"
#include "ddp/ddp_test_util.h"
#include "ddp/fully_sharded_test_util.h"

namespace {

using fsdp_test::Net;
using namespace fsdp_amp_test;

bool bit_identical(const AmpRun& a, const AmpRun& b) {
  if (a.values.size() != b.values.size()) return false;
  for (size_t i = 0; i < a.values.size(); ++i) {
    if (a.values[i].first != b.values[i].first || !torch::equal(a.values[i].second, b.values[i].second)) return false;
  }
  return true;
}

/// The same losses bit for bit (a NaN, from the inf planted on rank 1, equal to a NaN).
bool same_losses(const AmpRun& a, const AmpRun& b) {
  if (a.losses.size() != b.losses.size()) return false;
  for (size_t s = 0; s < a.losses.size(); ++s) {
    if (std::memcmp(&a.losses[s], &b.losses[s], sizeof(float)) != 0) return false;
  }
  return true;
}

std::string losses_of(const AmpRun& a, const AmpRun& b) {
  std::ostringstream out;
  for (size_t s = 0; s < a.losses.size(); ++s) out << a.losses[s] << "/" << b.losses[s] << " ";
  return out.str();
}

using Param = std::tuple<amp::OptLevel, Opt, int /*world*/>;
class FullyShardedAmpTest : public ::testing::TestWithParam<Param> {};

// At 2 ranks the reduction adds the same two values as DDP's allreduce, and every other operation is elementwise on
// the same values (1/world and the loss scale are powers of two, so (sum / 2) * inv_scale is sum * (inv_scale / 2)):
// bit for bit, through a skipped step. At 4 ranks the flat allreduce adds each element's four values in another
// order than DDP's bucketed one: the bound of docs/testing.md (1e-5 relative to each tensor's largest value).
TEST_P(FullyShardedAmpTest, TrainsLikeDdpAmpAndSkipsTheSameStepOnEveryRank) {
  LTA_REQUIRE_GLOO();
  const auto [level, opt, world] = GetParam();
  ddp_test::run_ranks(
      [level = level, opt = opt, world = world](int rank, const ddp::ProcessGroup& pg) {
        AmpSetup setup;
        setup.level = level;
        setup.opt = opt;
        const AmpRun reference = train_ddp(pg, rank, setup);
        const AmpRun sharded = train_fsdp(pg, rank, setup);
        std::vector<int64_t> expected(static_cast<size_t>(setup.steps), 0);
        expected[static_cast<size_t>(setup.inf_step)] = 1;
        TORCH_CHECK(sharded.skipped == expected, "rank ", rank, ": full sharding did not skip exactly step ",
                    setup.inf_step);
        TORCH_CHECK(reference.skipped == expected, "rank ", rank, ": DDP + amp did not skip exactly step ",
                    setup.inf_step);
        const double diff = max_relative_difference(sharded, reference);
        if (world == 2) {
          TORCH_CHECK(bit_identical(sharded, reference), "rank ", rank, ": parameters differ from DDP + amp's (max ",
                      diff, " relative); losses ", losses_of(sharded, reference));
          TORCH_CHECK(same_losses(sharded, reference), "rank ", rank,
                      ": losses differ: ", losses_of(sharded, reference));
        } else {
          TORCH_CHECK(diff <= 1e-5, "rank ", rank, ": parameters differ from DDP + amp's by ", diff,
                      " (relative; bound 1e-5); losses ", losses_of(sharded, reference));
        }
        if (rank == 0) std::printf("max relative difference vs DDP + amp: %.3g\n", diff);
      },
      world);
}

std::string param_name(const ::testing::TestParamInfo<Param>& info) {
  const auto [level, opt, world] = info.param;
  return std::string(amp::opt_level_name(level)) + (opt == Opt::kSgd ? "Sgd" : "FusedAdamW") + std::to_string(world) +
         "Ranks";
}

INSTANTIATE_TEST_SUITE_P(Amp, FullyShardedAmpTest,
                         ::testing::Values(Param{amp::OptLevel::O2, Opt::kFusedAdamW, 2},
                                           Param{amp::OptLevel::O2, Opt::kSgd, 2},
                                           Param{amp::OptLevel::O1, Opt::kFusedAdamW, 2},
                                           Param{amp::OptLevel::O1, Opt::kSgd, 2},
                                           Param{amp::OptLevel::O2, Opt::kFusedAdamW, 4}),
                         param_name);

// The norm is the square root of the sum over ranks of each shard's squares, added in another order than DDP + amp's
// single pass: the clip factor moves by a few fp32 ulps (as under ZeRO, docs/testing.md), bound 1e-5. The step with
// an inf on rank 1 has a non-finite norm: the flag is raised to 1 (not added to) on every rank, as on DDP + amp.
TEST(FullyShardedAmpClipTest, ClipsByTheNormOverEveryRanksShardsAsDdpAmpDoes) {
  LTA_REQUIRE_GLOO();
  ddp_test::run_ranks(
      [](int rank, const ddp::ProcessGroup& pg) {
        AmpSetup setup;
        setup.clip = true;
        const AmpRun reference = train_ddp(pg, rank, setup);
        const AmpRun sharded = train_fsdp(pg, rank, setup);
        TORCH_CHECK(sharded.flag_after_clip == reference.flag_after_clip, "rank ", rank,
                    ": the overflow flags after clipping differ from DDP + amp's");
        TORCH_CHECK(sharded.flag_after_clip[static_cast<size_t>(setup.inf_step)] == 1.0f, "rank ", rank,
                    ": the non-finite norm did not raise the flag to 1");
        const double diff = max_relative_difference(sharded, reference);
        TORCH_CHECK(diff <= 1e-5, "rank ", rank, ": parameters differ from DDP + amp's by ", diff, " (bound 1e-5)");
      },
      2);
}

// Each rank holds the fp32 shards as its masters (no second copy) and their gradients and optimizer state: its
// 1/N share of what DDP + amp holds on every rank, plus the padding.
TEST(FullyShardedAmpHeldTest, EachRankHoldsItsShareOfMastersGradientsAndOptimizerState) {
  LTA_REQUIRE_GLOO();
  ddp_test::run_ranks(
      [](int rank, const ddp::ProcessGroup& pg) {
        AmpSetup setup;
        setup.steps = 2;
        const AmpRun reference = train_ddp(pg, rank, setup);
        const AmpRun sharded = train_fsdp(pg, rank, setup);
        Net net = fsdp_test::make_net(3, rank, /*sharded=*/true);
        ddp::FullyShardedDataParallel fsdp(net, pg, fsdp_options(setup));
        int64_t shard_bytes = 0;
        for (const auto& shard : fsdp.parameters()) shard_bytes += shard.numel() * 4;
        TORCH_CHECK(sharded.held.masters == shard_bytes, "rank ", rank, ": masters ", sharded.held.masters,
                    " bytes, the shards are ", shard_bytes);
        TORCH_CHECK(sharded.held.master_grads == shard_bytes, "rank ", rank, ": gradients ", sharded.held.master_grads);
        // Padding, in fp32 bytes over all ranks: up to 31 elements before each parameter, and up to 32 per rank at
        // the end of each unit.
        const int64_t world = pg.size();
        const int64_t slack = 4 * (31 * static_cast<int64_t>(net->parameters().size()) +
                                   32 * world * static_cast<int64_t>(fsdp.parameters().size()));
        TORCH_CHECK(world * sharded.held.masters <= reference.held.masters + slack, "rank ", rank, ": masters ",
                    sharded.held.masters, " bytes, DDP + amp's ", reference.held.masters);
        // AdamW's two moments per element, and per tensor a step count and a learning rate (a few bytes).
        TORCH_CHECK(world * sharded.held.optimizer_state <= reference.held.optimizer_state + 2 * slack, "rank ", rank,
                    ": optimizer state ", sharded.held.optimizer_state, " bytes, DDP + amp's ",
                    reference.held.optimizer_state);
        TORCH_CHECK(sharded.held.optimizer_state >= 2 * sharded.held.masters, "rank ", rank, ": optimizer state ",
                    sharded.held.optimizer_state, " bytes: not two moments per shard element");
      },
      2);
}

// model.save gathers the full fp32 values (every rank writes the same archive) under the module's names: it loads
// into an unsharded model with amp, and into a fully sharded one whose shards then hold the same values.
TEST(FullyShardedAmpSaveTest, TheConsolidatedModelLoadsIntoAnUnshardedModelAndBack) {
  LTA_REQUIRE_GLOO();
  ddp_test::run_ranks(
      [](int rank, const ddp::ProcessGroup& pg) {
        AmpSetup setup;
        setup.steps = 3;
        std::ostringstream bytes;
        const auto trained = train_fsdp(pg, rank, setup, [&](ShardedModel& model, amp::Optimizer&) {
                               torch::serialize::OutputArchive out;
                               model.save(out);
                               out.save_to(bytes);
                             }).values;

        // Into one process, unsharded, under amp O2: the masters get the saved fp32 values.
        Net plain = fsdp_test::make_net(11, rank, /*sharded=*/false);
        torch::optim::SGD plain_sgd(plain->parameters(), fsdp_test::sgd());
        auto [plain_model, plain_optimizer] = amp::initialize(plain, plain_sgd, setup.options());
        torch::serialize::InputArchive in;
        std::istringstream read(bytes.str());
        in.load_from(read);
        plain_model.load(in);
        const auto& slots = plain_optimizer.state().slots();
        for (size_t i = 0; i < trained.size(); ++i) {
          TORCH_CHECK(torch::equal(slots[i].master, trained[i].second), "rank ", rank, ": ", trained[i].first,
                      " loaded into the unsharded model differs");
        }
        // Into another fully sharded model: the shards take the values.
        Net again = fsdp_test::make_net(17, rank, /*sharded=*/true);
        ddp::FullyShardedDataParallel fsdp_again(again, pg, fsdp_options(setup));
        auto inner_again = make_optimizer(setup.opt, fsdp_again.parameters());
        auto [model_again, optimizer_again] = amp::initialize(fsdp_again, *inner_again, setup.options());
        torch::serialize::InputArchive in_again;
        std::istringstream read_again(bytes.str());
        in_again.load_from(read_again);
        model_again.load(in_again);
        const auto loaded = fsdp_again.full_parameters();
        for (size_t i = 0; i < trained.size(); ++i) {
          TORCH_CHECK(torch::equal(loaded[i].second, trained[i].second), "rank ", rank, ": ", trained[i].first,
                      " loaded into the sharded model differs");
        }
      },
      2);
}

/// The message of what `f` throws, or "" when it returns.
template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "";
}

/// Throws from the rank unless `message` is one line containing `expected`.
void expect_refusal(const std::string& message, const std::string& expected, const std::string& what) {
  TORCH_CHECK(message.find(expected) != std::string::npos, what, ": expected a refusal containing '", expected,
              "', got '", message, "'");
  TORCH_CHECK(message.find('\n') == std::string::npos, what, ": the refusal is not one line: ", message);
}

struct NormedImpl : torch::nn::Module {
  NormedImpl() {
    unit = register_module("unit",
                           ddp::ShardedUnit(torch::nn::Sequential(torch::nn::Linear(4, 4), torch::nn::BatchNorm1d(4))));
  }
  torch::Tensor forward(const torch::Tensor& x) { return unit->forward(x); }
  ddp::ShardedUnit unit{nullptr};
};
TORCH_MODULE(Normed);

TEST(FullyShardedAmpRefusalTest, WhatCannotWorkIsRefusedInOneLine) {
  LTA_REQUIRE_GLOO();
  ddp_test::run_ranks(
      [](int rank, const ddp::ProcessGroup& pg) {
        Net net = fsdp_test::make_net(3, rank, /*sharded=*/true);
        ddp::FullyShardedDataParallel plain(net, pg);  // param_dtype unset
        torch::optim::SGD sgd(plain.parameters(), fsdp_test::sgd());
        auto o2 = amp::Options().opt_level(amp::OptLevel::O2).half_dtype(torch::kBFloat16);
        expect_refusal(error_of([&] { amp::initialize(plain, sgd, o2); }),
                       "construct the FullyShardedDataParallel with FullyShardOptions().param_dtype(BFloat16)",
                       "O2 without param_dtype");
        expect_refusal(error_of([&] { amp::initialize(plain, sgd, amp::Options().opt_level(amp::OptLevel::O3)); }),
                       "O3 keeps no fp32 weights", "O3");
        torch::optim::SGD model_sgd(net->parameters(), fsdp_test::sgd());
        expect_refusal(error_of([&] { amp::initialize(plain, model_sgd, amp::Options()); }),
                       "is not a shard of the FullyShardedDataParallel: build the optimizer over fsdp.parameters()",
                       "an optimizer over the model's parameters");
        torch::optim::LBFGS lbfgs(plain.parameters());
        expect_refusal(error_of([&] { amp::initialize(plain, lbfgs, amp::Options()); }), "LBFGS reduces", "LBFGS");

        Net half_net = fsdp_test::make_net(3, rank, /*sharded=*/true);
        ddp::FullyShardedDataParallel half(half_net, pg, ddp::FullyShardOptions().param_dtype(torch::kBFloat16));
        torch::optim::SGD half_sgd(half.parameters(), fsdp_test::sgd());
        expect_refusal(error_of([&] { amp::initialize(half, half_sgd, amp::Options()); }),
                       "O1 keeps the parameters fp32", "O1 with a half param_dtype");
        expect_refusal(error_of([&] { amp::initialize(half, half_sgd, amp::Options(o2).keep_layernorm_fp32(true)); }),
                       "keep_layernorm_fp32 is not supported", "keep_layernorm_fp32");

        Normed normed;
        ddp::FullyShardedDataParallel normed_fsdp(normed, pg, ddp::FullyShardOptions().param_dtype(torch::kBFloat16));
        torch::optim::SGD normed_sgd(normed_fsdp.parameters(), fsdp_test::sgd());
        expect_refusal(error_of([&] { amp::initialize(normed_fsdp, normed_sgd, o2); }),
                       "keeps BatchNorm 'unit.1' in fp32", "BatchNorm kept fp32");

        // Accepted once; then what is refused on an initialized one.
        auto [model, optimizer] = amp::initialize(half, half_sgd, o2);
        expect_refusal(error_of([&] { amp::initialize(half, half_sgd, o2); }), "already called with this optimizer",
                       "a second initialize");
        Net other = fsdp_test::make_net(3, rank, /*sharded=*/false);
        ddp::DistributedDataParallel ddp(other, pg);
        expect_refusal(error_of([&] { optimizer.attach(ddp); }), "attach() over a fully sharded model", "attach");
      },
      2);
}

}  // namespace
