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

// reduce_dtype kBFloat16 against DDP's allreduce_dtype kBFloat16: both round each gradient to bf16, add the two
// ranks' values in bf16 (one rounding, either order), halve (exact) and widen: bit for bit. Reducing in fp32 instead
// (the option ignored) differs.
TEST(FullyShardedTest, ABf16ReductionTrainsLikeDdpsBf16AllreduceBitForBit) {
  LTA_REQUIRE_GLOO();
  const uint64_t seed = test_util::fresh_seed();
  run_ranks(
      [seed](int rank, const ddp::ProcessGroup& pg) {
        const Trained ddp = train_ddp(seed, rank, pg, 4, 1, torch::kCPU,
                                      ddp::DistributedDataParallelOptions().allreduce_dtype(torch::kBFloat16));
        check_same(train_fsdp(seed, rank, pg, 4, 1, ddp::FullyShardOptions().reduce_dtype(torch::kBFloat16)), ddp, 0.0,
                   "reduce_dtype bf16");
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
          TORCH_CHECK(u.shard_numel * pg.size() >= u.numel && (u.shard_numel - 32) * pg.size() < u.numel, "unit '",
                      u.name, "': ", u.shard_numel, " per rank for ", u.numel);
          shards += u.shard_numel;
        }
        for (const auto& p : model->parameters()) TORCH_CHECK(p.numel() == 0, "a model parameter is not sharded");
        TORCH_CHECK(fsdp.held_bytes() == shards * 4, "held ", fsdp.held_bytes(), " bytes, shards ", shards * 4);
        // Padding: each parameter starts at a multiple of 32 elements, each shard is a multiple of 32 long.
        const int64_t params = static_cast<int64_t>(model->parameters().size());
        TORCH_CHECK(shards * pg.size() < total + 31 * params + 32 * pg.size() * static_cast<int64_t>(units.size()),
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
          // The reductions' full-size gradient buffers: at most two units' at once, never the whole model's.
          TORCH_CHECK(fsdp.peak_reduction_bytes() > 0 && fsdp.peak_reduction_bytes() <= 2 * unit_bytes, "step ", step,
                      ": ", fsdp.peak_reduction_bytes(),
                      " bytes of gradient buffers in reduction at once, more than two "
                      "units' (",
                      2 * unit_bytes, ")");
          opt.step();
          TORCH_CHECK(fsdp.held_bytes() == 2 * shards * 4, "after the step: ", fsdp.held_bytes(), " bytes held");
        }
      },
      2);
}

/// Rank 0's Net sharded over `pg` and one step's shard gradients from `backwards` backward passes of one forward.
std::vector<torch::Tensor> shard_grads_after(uint64_t seed, int rank, const ddp::ProcessGroup& pg, int backwards) {
  Net model = make_net(seed, rank, /*sharded=*/true);
  ddp::FullyShardedDataParallel fsdp(model, pg);
  const Batch b = batch(seed, rank, 0);
  const torch::Tensor loss = torch::mse_loss(fsdp.forward(b.x), b.y);
  for (int i = 0; i < backwards; ++i) loss.backward({}, /*retain_graph=*/i + 1 < backwards);
  std::vector<torch::Tensor> grads;
  for (const auto& shard : fsdp.parameters()) grads.push_back(shard.grad().clone());
  return grads;
}

// The first backward frees the root's parameters at its end; the second, through the retained graph, gathers them
// again when it reaches the model's output (before the fix it read the freed storage's views: a torch error).
TEST(FullyShardedTest, ASecondBackwardThroughARetainedGraphGathersTheRootAgain) {
  LTA_REQUIRE_GLOO();
  const uint64_t seed = test_util::fresh_seed();
  run_ranks(
      [seed](int rank, const ddp::ProcessGroup& pg) {
        const auto once = shard_grads_after(seed, rank, pg, 1);
        const auto twice = shard_grads_after(seed, rank, pg, 2);
        for (size_t i = 0; i < once.size(); ++i) {
          TORCH_CHECK(torch::equal(twice[i], once[i] * 2), "shard ", i, ": two backward passes are not twice one");
        }
      },
      2);
}

/// embed -> unit -> ReLU in place -> unit -> head (`sharded`), or the same without units.
torch::nn::Sequential relu_in_place_net(uint64_t seed, int rank, bool sharded) {
  torch::manual_seed(seed + 1 + static_cast<uint64_t>(rank));
  torch::nn::Sequential net(torch::nn::Linear(kIn, kWidth));
  for (int b = 0; b < 2; ++b) {
    if (sharded) {
      net->push_back(ddp::ShardedUnit(Block()));
    } else {
      net->push_back(Block());
    }
    net->push_back(torch::nn::ReLU(torch::nn::ReLUOptions().inplace(true)));
  }
  net->push_back(torch::nn::Linear(kWidth, kOut));
  return net;
}

// A unit's output modified in place (a ReLU(inplace) after the block), which DDP trains: before the fix the unit's
// output was an identity function's, and autograd refused the in-place op on it.
TEST(FullyShardedTest, AnInPlaceOpOnAUnitsOutputTrainsLikeDdp) {
  LTA_REQUIRE_GLOO();
  const uint64_t seed = test_util::fresh_seed();
  run_ranks(
      [seed](int rank, const ddp::ProcessGroup& pg) {
        torch::nn::Sequential plain = relu_in_place_net(seed, rank, false);
        ddp::DistributedDataParallel ddp(plain, pg);
        torch::optim::SGD ddp_opt(plain->parameters(), sgd());
        Trained expected = train(ddp, ddp_opt, seed, rank, 4, 1, torch::kCPU);
        for (const auto& p : plain->named_parameters()) expected.params.emplace_back(p.key(), p.value().detach());
        torch::nn::Sequential sharded = relu_in_place_net(seed, rank, true);
        ddp::FullyShardedDataParallel fsdp(sharded, pg);
        torch::optim::SGD fsdp_opt(fsdp.parameters(), sgd());
        Trained got = train(fsdp, fsdp_opt, seed, rank, 4, 1, torch::kCPU);
        got.params = fsdp.full_parameters();
        check_same(got, expected, 0.0, "ReLU(inplace) after each unit");
      },
      2);
}

/// Passes its input through; its hook throws in backward while `armed` (a backward that fails midway).
struct ThrowInBackwardImpl : torch::nn::Module {
  torch::Tensor forward(const torch::Tensor& x) {
    torch::Tensor y = x * 1.0;
    y.register_hook([this](const torch::Tensor& grad) {
      if (armed) throw std::runtime_error("a failure in the middle of backward");
      return grad;
    });
    return y;
  }
  bool armed = false;
};
TORCH_MODULE(ThrowInBackward);

// A backward that throws midway leaves full gradients on parameters whose unit was not reduced yet (the head's: the
// root reduces last). The next forward drops them: the steps after it equal a run that never failed (before the fix
// the head's gradient of the failed pass was added into the next step's).
TEST(FullyShardedTest, ABackwardThatThrowsLeavesNothingForTheNextStep) {
  LTA_REQUIRE_GLOO();
  const uint64_t seed = test_util::fresh_seed();
  run_ranks(
      [seed](int rank, const ddp::ProcessGroup& pg) {
        std::vector<std::vector<std::pair<std::string, torch::Tensor>>> runs;
        for (const bool fail_first : {false, true}) {
          torch::manual_seed(seed + 1 + static_cast<uint64_t>(rank));
          ThrowInBackward thrower;
          torch::nn::Sequential net(torch::nn::Linear(kIn, kWidth), ddp::ShardedUnit(Block()), thrower,
                                    ddp::ShardedUnit(Block()), torch::nn::Linear(kWidth, kOut));
          ddp::FullyShardedDataParallel fsdp(net, pg);
          torch::optim::SGD opt(fsdp.parameters(), sgd());
          if (fail_first) {
            thrower->armed = true;
            const Batch b = batch(seed, rank, 99);
            bool threw = false;
            try {
              torch::mse_loss(fsdp.forward(b.x), b.y).backward();
            } catch (const std::exception&) {
              threw = true;
            }
            TORCH_CHECK(threw, "the armed backward did not throw");
            thrower->armed = false;
          }
          for (int step = 0; step < 3; ++step) {
            opt.zero_grad();
            const Batch b = batch(seed, rank, step);
            torch::mse_loss(fsdp.forward(b.x), b.y).backward();
            opt.step();
          }
          runs.push_back(fsdp.full_parameters());
        }
        for (size_t i = 0; i < runs[0].size(); ++i) {
          TORCH_CHECK(torch::equal(runs[0][i].second, runs[1][i].second), runs[0][i].first,
                      " differs after a failed backward");
        }
      },
      2);
}

/// Three units of which forward runs the first and the last: the middle one gets no gradients.
struct SkipsAUnitImpl : torch::nn::Module {
  SkipsAUnitImpl() {
    for (int u = 0; u < 3; ++u) units.push_back(register_module("unit" + std::to_string(u), ddp::ShardedUnit(Block())));
  }
  torch::Tensor forward(const torch::Tensor& x) { return units[2](units[0](x)).sum(-1); }
  std::vector<ddp::ShardedUnit> units;
};
TORCH_MODULE(SkipsAUnit);

// A unit that did not run is neither gathered nor prefetched (a prefetch in the first forward's order would gather it
// in every backward for nothing), and it holds up no reduction: each step's gathers are those of the two units run,
// once in forward and once in backward.
TEST(FullyShardedTest, AUnitThatDoesNotRunIsNeverGathered) {
  LTA_REQUIRE_GLOO();
  const uint64_t seed = test_util::fresh_seed();
  run_ranks(
      [seed](int rank, const ddp::ProcessGroup& pg) {
        torch::manual_seed(seed);
        SkipsAUnit model;
        ddp::FullyShardedDataParallel fsdp(model, pg);
        torch::optim::SGD opt(fsdp.parameters(), sgd());
        for (int step = 0; step < 3; ++step) {
          opt.zero_grad();
          const torch::Tensor x = torch::randn({4, kWidth});
          fsdp.forward(x).pow(2).mean().backward();
          opt.step();
        }
        const auto units = fsdp.units();  // the root (no parameters), unit0, unit1, unit2
        TORCH_CHECK(units[2].name == "unit1", units[2].name);
        TORCH_CHECK(units[2].gathers == 0, "the unit that never ran was gathered ", units[2].gathers, " times");
        TORCH_CHECK(units[1].gathers == 6 && units[3].gathers == 6, "3 steps gathered the units run ", units[1].gathers,
                    " and ", units[3].gathers, " times, not twice a step");
        (void)rank;
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

// After an evaluation forward, which leaves the root gathered: full_parameters() must read what was loaded, not the
// gathered old values.
TEST(FullyShardedTest, LoadFullParametersPutsEachRanksSliceInItsShard) {
  LTA_REQUIRE_GLOO();
  const uint64_t seed = test_util::fresh_seed();
  run_ranks(
      [seed](int rank, const ddp::ProcessGroup& pg) {
        Net model = make_net(seed, rank, /*sharded=*/true);
        ddp::FullyShardedDataParallel fsdp(model, pg);
        {
          torch::NoGradGuard no_grad;
          fsdp.forward(batch(seed, rank, 0).x);
        }
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
