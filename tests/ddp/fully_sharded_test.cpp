// ddp::FullyShardedDataParallel (ZeRO-3): trains what DDP trains, bit for bit at 2 ranks (every reduced element is
// the sum of two values, the same in either order) and within a derived bound at 4; holds 1/N of the parameters
// between steps and at most two units gathered at once; gradient accumulation; what it refuses.
#include <ddp/fsdp/fully_sharded.h>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ddp/distributed_data_parallel.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "ddp/ddp_test_util.h"
#include "ddp/fully_sharded_test_util.h"
#include "test_util.h"

namespace {

using ddp_test::run_ranks;

using namespace fsdp_test;  // NOLINT(google-build-using-namespace): the shared test model

TEST(FullyShardedTest, TrainsLikeDdpBitForBitAtTwoRanks) {
  LTA_REQUIRE_GLOO();
  const uint64_t seed = test_util::fresh_seed();
  run_ranks(
      [seed](int rank, const ddp::ProcessGroup& pg) {
        const Trained ddp = train_ddp(seed, rank, pg, 6);
        check_same(train_fsdp(seed, rank, pg, 6), ddp, 0.0, "default options");
        check_same(train_fsdp(seed, rank, pg, 6, 1, ddp::FullyShardOptions().reshard_after_forward(false)), ddp, 0.0,
                   "reshard_after_forward off");
        check_same(train_fsdp(seed, rank, pg, 6, 1, ddp::FullyShardOptions().prefetch(false)), ddp, 0.0,
                   "prefetch off");
      },
      2);
}

TEST(FullyShardedTest, GradientAccumulationUnderNoSyncTrainsLikeDdpBitForBit) {
  LTA_REQUIRE_GLOO();
  const uint64_t seed = test_util::fresh_seed();
  run_ranks(
      [seed](int rank, const ddp::ProcessGroup& pg) {
        check_same(train_fsdp(seed, rank, pg, 4, /*micro=*/3), train_ddp(seed, rank, pg, 4, /*micro=*/3), 0.0,
                   "3 micro-batches per step");
      },
      2);
}

// At 4 ranks a reduced element is a sum of 4 values, which Gloo's ring adds in an order that depends on where the
// element lies in the buffer: DDP's buckets and the units lay the gradients out differently. Each sum then differs
// by at most 3 roundings, 3 * 2^-24 * sum |g_r| (docs/testing.md, "Full sharding at 4 ranks"); over 6 steps the
// parameters, of order 0.3, move by lr * sum of momentum-weighted gradients, so they differ by far less than 1e-5
// of their largest value; a gradient lost or counted twice is off by O(lr * g), orders of magnitude more.
TEST(FullyShardedTest, TrainsLikeDdpWithinTheSumOrderBoundAtFourRanks) {
  LTA_REQUIRE_GLOO();
  const uint64_t seed = test_util::fresh_seed();
  run_ranks(
      [seed](int rank, const ddp::ProcessGroup& pg) {
        check_same(train_fsdp(seed, rank, pg, 6), train_ddp(seed, rank, pg, 6), 1e-5, "4 ranks");
      },
      4);
}

TEST(FullyShardedTest, HoldsItsShareBetweenStepsAndAtMostTwoUnitsGathered) {
  LTA_REQUIRE_GLOO();
  const uint64_t seed = test_util::fresh_seed();
  run_ranks(
      [seed](int rank, const ddp::ProcessGroup& pg) {
        Net model = make_net(seed, rank, /*sharded=*/true);
        int64_t total = 0;
        for (const auto& p : model->parameters()) total += p.numel();
        ddp::FullyShardedDataParallel fsdp(model, pg);
        const auto units = fsdp.units();
        TORCH_CHECK(units.size() == kBlocks + 1, units.size(), " units");
        TORCH_CHECK(units[0].name.empty() && units[0].parameter_names.front() == "embed.weight",
                    "the root's own parameters come first");
        TORCH_CHECK(units[1].name == "blocks.0" && units[1].parameter_names.front() == "blocks.0.fc1.weight",
                    units[1].name);
        int64_t shards = 0;
        for (const auto& u : units) {
          TORCH_CHECK(!u.gathered, "unit '", u.name, "' is gathered after construction");
          TORCH_CHECK(u.shard_numel * pg.size() >= u.numel && (u.shard_numel - 1) * pg.size() < u.numel + 16 * 2,
                      "unit '", u.name, "': ", u.shard_numel, " per rank for ", u.numel);
          shards += u.shard_numel;
        }
        for (const auto& p : model->parameters()) TORCH_CHECK(p.numel() == 0, "a model parameter is not sharded");
        TORCH_CHECK(fsdp.held_bytes() == shards * 4, "held ", fsdp.held_bytes(), " bytes, shards ", shards * 4);
        TORCH_CHECK(shards * pg.size() < total + 16 * pg.size() * static_cast<int64_t>(units.size()),
                    "the shards are more than 1/", pg.size(), " of ", total, " elements");

        torch::optim::SGD opt(fsdp.parameters(), sgd());
        const int64_t unit_bytes = units[1].shard_numel * pg.size() * 4;
        const int64_t root_bytes = units[0].shard_numel * pg.size() * 4;
        for (int step = 0; step < 3; ++step) {
          fsdp.reset_peak_gathered_bytes();
          opt.zero_grad();
          const Batch b = batch(seed, rank, step);
          torch::mse_loss(fsdp.forward(b.x), b.y).backward();
          for (const auto& u : fsdp.units()) TORCH_CHECK(!u.gathered, "unit '", u.name, "' is gathered after backward");
          // The root stays from forward to the end of backward; of the blocks, the one running and the one prefetched.
          TORCH_CHECK(fsdp.peak_gathered_bytes() <= root_bytes + 2 * unit_bytes, "step ", step, ": ",
                      fsdp.peak_gathered_bytes(), " bytes gathered at once, more than the root and two units (",
                      root_bytes + 2 * unit_bytes, ")");
          TORCH_CHECK(fsdp.peak_gathered_bytes() > root_bytes + unit_bytes || step == 0, "step ", step,
                      ": no unit was prefetched");
          opt.step();
          TORCH_CHECK(fsdp.held_bytes() == 2 * shards * 4, "after the step: ", fsdp.held_bytes(), " bytes held");
        }
      },
      2);
}

TEST(FullyShardedTest, RefusesWhatCannotWorkInOneLine) {
  LTA_REQUIRE_GLOO();
  run_ranks(
      [](int, const ddp::ProcessGroup& pg) {
        auto message = [](const std::function<void()>& fn) -> std::string {
          try {
            fn();
          } catch (const c10::Error& e) {
            return e.what_without_backtrace();
          }
          return "(no error)";
        };
        auto expect = [&](const std::string& text, const std::string& fragment) {
          TORCH_CHECK(text.find(fragment) != std::string::npos && text.find('\n') == std::string::npos,
                      "expected one line with '", fragment, "', got: ", text);
        };
        {  // a parameter in two units
          Block shared;
          auto seq = torch::nn::Sequential(ddp::ShardedUnit(shared), ddp::ShardedUnit(shared));
          expect(message([&] { ddp::FullyShardedDataParallel fsdp(seq, pg); }),
                 "parameter '1.fc1.weight' is in unit '0' and in unit '1': a parameter shared across units cannot be "
                 "sharded");
        }
        {  // a unit inside a unit
          auto inner = torch::nn::Sequential(ddp::ShardedUnit(Block()));
          auto seq = torch::nn::Sequential(ddp::ShardedUnit(inner));
          expect(message([&] { ddp::FullyShardedDataParallel fsdp(seq, pg); }),
                 "ddp::ShardedUnit '0.0' is inside ddp::ShardedUnit '0': units do not nest");
        }
        {  // mixed requires_grad
          Block block;
          block->fc1->bias.set_requires_grad(false);
          auto seq = torch::nn::Sequential(ddp::ShardedUnit(block));
          expect(message([&] { ddp::FullyShardedDataParallel fsdp(seq, pg); }),
                 "unit '0' mixes parameters: '0.fc1.weight' is Float on cpu requiring grad, '0.fc1.bias' Float on "
                 "cpu frozen");
        }
        {  // a unit run outside the root's forward, and after the root is gone
          Net net(/*sharded=*/true);
          {
            ddp::FullyShardedDataParallel fsdp(net, pg);
            expect(message([&] {
                     net->blocks->forward(torch::randn({2, kWidth}));
                   }),
                   "ddp::ShardedUnit: unit 'blocks.0' ran outside FullyShardedDataParallel::forward");
            expect(message([&] { ddp::FullyShardedDataParallel again(net, pg); }),
                   "ddp::ShardedUnit 'blocks.0' is sharded already");
          }
          expect(message([&] {
                   net->blocks[0]->as<ddp::ShardedUnit>()->forward(torch::randn({2, kWidth}));
                 }),
                 "its FullyShardedDataParallel was destroyed");
        }
        {  // a wrong value to load
          Net net(/*sharded=*/true);
          ddp::FullyShardedDataParallel fsdp(net, pg);
          auto values = fsdp.full_parameters();
          values[1].second = torch::zeros({3});
          expect(message([&] { fsdp.load_full_parameters(values); }),
                 "load_full_parameters: 'embed.bias' has shape [3], the model's is [24]");
        }
      },
      1);
}

TEST(FullyShardedTest, ADifferentModelOnOneRankIsRefusedOnEveryRank) {
  LTA_REQUIRE_GLOO();
  run_ranks(
      [](int rank, const ddp::ProcessGroup& pg) {
        auto seq = torch::nn::Sequential(ddp::ShardedUnit(torch::nn::Linear(4, rank == 0 ? 4 : 5)));
        try {
          ddp::FullyShardedDataParallel fsdp(seq, pg);
        } catch (const c10::Error& e) {
          const std::string text = e.what_without_backtrace();
          TORCH_CHECK(text.find("0.weight") != std::string::npos, "the error names the parameter: ", text);
          return;
        }
        TORCH_CHECK(false, "rank ", rank, " accepted a different model");
      },
      2);
}

TEST(FullyShardedTest, LoadFullParametersPutsEachRanksSliceInItsShard) {
  LTA_REQUIRE_GLOO();
  const uint64_t seed = test_util::fresh_seed();
  run_ranks(
      [seed](int rank, const ddp::ProcessGroup& pg) {
        Net model = make_net(seed, rank, /*sharded=*/true);
        ddp::FullyShardedDataParallel fsdp(model, pg);
        auto values = fsdp.full_parameters();
        torch::manual_seed(seed + 99);  // the same new values on every rank
        for (auto& [name, value] : values) value = torch::randn_like(value);
        fsdp.load_full_parameters(values);
        const auto back = fsdp.full_parameters();
        for (size_t i = 0; i < values.size(); ++i) {
          TORCH_CHECK(torch::equal(back[i].second, values[i].second), values[i].first, " did not load");
        }
      },
      2);
}

}  // namespace
