#include "common/small_cnn.h"

#include <memory>
#include <sstream>

#include <ddp/sync_batch_norm.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "test_util.h"

namespace {

// --sync-bn builds the examples' CNN with ddp::SyncBatchNorm: the same parameters and buffers (names, shapes, initial
// values), so checkpoints move between the two, and the same eval outputs (SyncBatchNorm's eval mode is at::batch_norm
// with the running statistics, no process group needed).
TEST(SmallCnnTest, SyncBatchNormOptionKeepsStateNamesInitialWeightsAndEvalOutputs) {
  const uint64_t seed = test_util::fresh_seed();
  torch::manual_seed(seed);
  examples::SmallCnn plain;
  torch::manual_seed(seed);
  examples::SmallCnn sync(examples::SmallCnnOptions().sync_batch_norm(true));
  EXPECT_NE(plain->bn1.ptr()->as<torch::nn::BatchNorm2d>(), nullptr);
  EXPECT_NE(sync->bn1.ptr()->as<ddp::SyncBatchNorm>(), nullptr);
  EXPECT_NE(sync->bn2.ptr()->as<ddp::SyncBatchNorm>(), nullptr);
  EXPECT_EQ(sync->bn2.ptr()->as<ddp::SyncBatchNorm>()->options.dimensionality(), 2);

  const auto plain_params = plain->named_parameters();
  const auto sync_params = sync->named_parameters();
  ASSERT_EQ(plain_params.keys(), sync_params.keys());
  for (const auto& p : plain_params) EXPECT_TRUE(torch::equal(p.value(), sync_params[p.key()])) << p.key();
  const auto plain_buffers = plain->named_buffers();
  const auto sync_buffers = sync->named_buffers();
  ASSERT_EQ(plain_buffers.keys(), sync_buffers.keys());

  // A BatchNorm checkpoint loads into the SyncBatchNorm model (with other running statistics, to see them arrive).
  {
    torch::NoGradGuard no_grad;
    for (auto& b : plain->named_buffers()) {
      if (b.value().is_floating_point()) b.value().copy_(torch::rand_like(b.value()) + 0.5);
    }
  }
  std::stringstream stream;
  torch::save(plain, stream);
  torch::load(sync, stream);
  for (const auto& b : plain->named_buffers()) EXPECT_TRUE(torch::equal(b.value(), sync_buffers[b.key()])) << b.key();

  plain->eval();
  sync->eval();
  const auto images = torch::randn({3, 1, 28, 28});
  EXPECT_TRUE(torch::equal(plain->forward(images), sync->forward(images)));

  // A clone (what data_parallel replicates) keeps SyncBatchNorm.
  const auto copy = std::dynamic_pointer_cast<examples::SmallCnnImpl>(sync->clone());
  ASSERT_NE(copy, nullptr);
  EXPECT_NE(copy->bn1.ptr()->as<ddp::SyncBatchNorm>(), nullptr);
  EXPECT_NE(copy->bn1.ptr().get(), sync->bn1.ptr().get());
  EXPECT_TRUE(torch::equal(copy->forward(images), sync->forward(images)));
}

}  // namespace
