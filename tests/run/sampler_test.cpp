// run::DistributedSampler: each rank's batches, the same shuffle on every rank, a step's samples independent of the
// number of ranks with a global batch, and a resume mid-epoch that takes the very batches the unbroken run took.
#include <algorithm>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <torch/data/samplers/distributed.h>
#include <torch/torch.h>

#include <run/sampler.h>

namespace {

using run::DistributedSampler;
using Order = DistributedSampler::Order;

std::vector<int64_t> values(const torch::Tensor& t) {
  const auto c = t.contiguous();
  return {c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel()};
}

/// Every batch of one epoch, in order.
std::vector<std::vector<int64_t>> epoch_batches(DistributedSampler& sampler, int64_t epoch, int64_t first = 0) {
  sampler.set_epoch(epoch, first);
  std::vector<std::vector<int64_t>> batches;
  while (const auto indices = sampler.next()) batches.push_back(values(*indices));
  return batches;
}

TEST(DistributedSamplerTest, PerRankShardsAreTorchsShardsCutIntoBatches) {
  constexpr int64_t kSamples = 103, kBatch = 8;
  constexpr int kRanks = 3;
  std::set<int64_t> seen;
  for (int rank = 0; rank < kRanks; ++rank) {
    DistributedSampler sampler(kSamples, kBatch, rank, kRanks);
    const auto batches = epoch_batches(sampler, 4);
    torch::data::samplers::DistributedRandomSampler reference(kSamples, kRanks, rank);
    reference.set_epoch(4);
    reference.reset();
    const auto shard = reference.next(kSamples).value();
    std::vector<int64_t> joined;
    for (const auto& batch : batches) joined.insert(joined.end(), batch.begin(), batch.end());
    EXPECT_EQ(joined, std::vector<int64_t>(shard.begin(), shard.end())) << "rank " << rank;
    ASSERT_EQ(static_cast<int64_t>(batches.size()), sampler.batches_per_epoch());
    EXPECT_EQ(sampler.batches_per_epoch(), 5);  // 35 samples per rank (103 padded to 105): 4 x 8 + 3
    EXPECT_EQ(batches.back().size(), 3u);
    EXPECT_EQ(sampler.batches_done(), 5);
    seen.insert(joined.begin(), joined.end());
  }
  EXPECT_EQ(seen.size(), static_cast<size_t>(kSamples)) << "the shards cover every sample";
}

TEST(DistributedSamplerTest, EachEpochIsItsOwnShuffleAndTheSameOnEveryCall) {
  DistributedSampler sampler(64, 16);
  const auto first = epoch_batches(sampler, 1);
  const auto second = epoch_batches(sampler, 2);
  EXPECT_NE(first, second);
  EXPECT_EQ(epoch_batches(sampler, 1), first) << "an epoch's order depends on its number only";
  DistributedSampler other(64, 16);
  EXPECT_EQ(epoch_batches(other, 2), second);
}

TEST(DistributedSamplerTest, AGlobalBatchTakesTheSameSamplesPerStepOnAnyNumberOfRanks) {
  constexpr int64_t kSamples = 100, kJobBatch = 12;
  // On 1 process: step s's samples.
  DistributedSampler alone(kSamples, kJobBatch, 0, 1, Order::kGlobal);
  const auto steps = epoch_batches(alone, 3);
  ASSERT_EQ(steps.size(), 8u) << "100 / 12: a last part-batch of the job is left out";
  for (const int ranks : {2, 3, 4}) {
    std::vector<std::vector<int64_t>> parts(steps.size());
    for (int rank = 0; rank < ranks; ++rank) {
      DistributedSampler sampler(kSamples, kJobBatch / ranks, rank, ranks, Order::kGlobal);
      EXPECT_EQ(sampler.job_batch_size(), kJobBatch);
      const auto batches = epoch_batches(sampler, 3);
      ASSERT_EQ(batches.size(), steps.size());
      for (size_t s = 0; s < batches.size(); ++s) parts[s].insert(parts[s].end(), batches[s].begin(), batches[s].end());
    }
    EXPECT_EQ(parts, steps) << ranks << " ranks: step s is the same samples, rank r its r-th part";
  }
}

TEST(DistributedSamplerTest, AResumedEpochContinuesWithTheBatchesTheUnbrokenRunTook) {
  for (const Order order : {Order::kPerRank, Order::kGlobal}) {
    DistributedSampler unbroken(90, 7, 1, 2, order);
    const auto all = epoch_batches(unbroken, 5);
    DistributedSampler resumed(90, 7, 1, 2, order);
    const auto rest = epoch_batches(resumed, 5, 4);
    EXPECT_EQ(rest, std::vector<std::vector<int64_t>>(all.begin() + 4, all.end()));
    EXPECT_EQ(resumed.epoch(), 5);
    EXPECT_EQ(resumed.batches_done(), unbroken.batches_done());
    resumed.set_epoch(5, resumed.batches_per_epoch());
    EXPECT_FALSE(resumed.next().has_value()) << "an epoch resumed at its end has no batch left";
  }
}

TEST(DistributedSamplerTest, BadSizesAreOneLineNamingTheValue) {
  const auto message = [](const std::function<void()>& call) {
    try {
      call();
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_EQ(message([] { DistributedSampler(0, 4); }), "DistributedSampler: dataset size must be positive, got 0");
  EXPECT_EQ(message([] { DistributedSampler(10, -1); }), "DistributedSampler: batch size must be positive, got -1");
  EXPECT_EQ(message([] { DistributedSampler(10, 2, 2, 2); }),
            "DistributedSampler: rank 2 is not one of world size 2's ranks");
  EXPECT_EQ(message([] { DistributedSampler(10, 2).set_epoch(1, 6); }),
            "DistributedSampler: batch 6 of epoch 1 asked for, but an epoch has 5");
  EXPECT_EQ(message([] { DistributedSampler(2, 1, 0, 3); }),
            "DistributedSampler: 2 samples cannot be shared among 3 ranks");
  EXPECT_EQ(message([] { DistributedSampler(10, 4, 0, 3, Order::kGlobal); }),
            "DistributedSampler: a job batch of 12 (4 per rank x 3) is more than the 10 samples");
  EXPECT_FALSE(DistributedSampler(10, 2).next().has_value()) << "no batch before set_epoch";
}

}  // namespace
