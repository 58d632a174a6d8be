// Activation checkpointing inside a unit of full sharding, ddp::ShardedUnit(amp::Checkpointed(block)): the block's
// forward runs again in backward with the unit's parameters gathered again, and training equals DDP's over the same
// blocks bit for bit (2 ranks); the checkpoint around the unit, which hides it, is refused in one line.
#include <cstdint>
#include <string>
#include <vector>

#include <amp/recompute/checkpointed.h>
#include <ddp/distributed_data_parallel.h>
#include <ddp/fsdp/fully_sharded.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "ddp/ddp_test_util.h"
#include "test_util.h"

namespace {

struct BlockImpl : torch::nn::Module {
  BlockImpl()
      : fc1(register_module("fc1", torch::nn::Linear(16, 32))),
        fc2(register_module("fc2", torch::nn::Linear(32, 16))) {}
  torch::Tensor forward(const torch::Tensor& x) { return fc2(torch::tanh(fc1(x))); }
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(Block);

/// Linear(8, 16), three blocks, Linear(16, 3); each block as `wrap` makes it. Rank 0's initialization for `seed`.
template <typename Wrap>
torch::nn::Sequential make_net(uint64_t seed, Wrap wrap) {
  torch::manual_seed(seed);
  torch::nn::Sequential net(torch::nn::Linear(8, 16));
  for (int b = 0; b < 3; ++b) net->push_back(wrap(Block()));
  net->push_back(torch::nn::Linear(16, 3));
  return net;
}

/// Four SGD steps through `wrapper`; each rank its own batch.
template <typename Wrapper>
void train(Wrapper& wrapper, torch::optim::Optimizer& opt, uint64_t seed, int rank) {
  for (int step = 0; step < 4; ++step) {
    torch::manual_seed(seed + 100 * static_cast<uint64_t>(step) + static_cast<uint64_t>(rank) + 1);
    const torch::Tensor x = torch::randn({6, 8});
    const torch::Tensor y = torch::randn({6, 3});
    opt.zero_grad();
    torch::mse_loss(wrapper.forward(x), y).backward();
    opt.step();
  }
}

TEST(ShardedCheckpointingTest, ACheckpointInsideAUnitTrainsLikeDdpBitForBit) {
  LTA_REQUIRE_GLOO();
  const uint64_t seed = test_util::fresh_seed();
  ddp_test::run_ranks(
      [seed](int rank, const ddp::ProcessGroup& pg) {
        torch::nn::Sequential plain = make_net(seed, [](Block b) { return b; });
        ddp::DistributedDataParallel ddp(plain, pg);
        torch::optim::SGD ddp_opt(plain->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
        train(ddp, ddp_opt, seed, rank);

        torch::nn::Sequential sharded = make_net(seed, [](Block b) { return ddp::ShardedUnit(amp::Checkpointed(b)); });
        ddp::FullyShardedDataParallel fsdp(sharded, pg);
        torch::optim::SGD fsdp_opt(fsdp.parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
        train(fsdp, fsdp_opt, seed, rank);

        const auto full = fsdp.full_parameters();
        const auto expected = plain->named_parameters();
        TORCH_CHECK(full.size() == expected.size(), full.size(), " parameters, DDP's model has ", expected.size());
        for (size_t i = 0; i < full.size(); ++i) {
          TORCH_CHECK(full[i].first == expected[i].key(), full[i].first, " vs ", expected[i].key());
          TORCH_CHECK(torch::equal(full[i].second, expected[i].value()), full[i].first, " differs from DDP's");
        }
      },
      2);
}

TEST(ShardedCheckpointingTest, ACheckpointAroundAUnitIsRefusedInOneLine) {
  LTA_REQUIRE_GLOO();
  ddp_test::run_ranks(
      [](int, const ddp::ProcessGroup& pg) {
        torch::nn::Sequential net = make_net(1, [](Block b) { return amp::Checkpointed(ddp::ShardedUnit(b)); });
        ddp::FullyShardedDataParallel fsdp(net, pg);
        try {
          fsdp.forward(torch::randn({2, 8}));
        } catch (const c10::Error& e) {
          const std::string text = e.what_without_backtrace();
          TORCH_CHECK(text.find("ddp::ShardedUnit: a unit ran in FullyShardedDataParallel::forward, but the "
                                "FullyShardedDataParallel did not find it in the model") != std::string::npos &&
                          text.find('\n') == std::string::npos,
                      text);
          return;
        }
        TORCH_CHECK(false, "a checkpoint around a unit was accepted");
      },
      1);
}

}  // namespace
