// Full sharding over NCCL (in the GPU check's never-run group; compiled here, skipped without a GPU): ranks are
// threads of the test process, rank r on GPU r (NCCL takes one rank per device), so one GPU gives a world of 1, where
// the collectives are copies but every step of the sharded path runs (the flat buffer's storage freed and refilled
// on the GPU through the caching allocator, the reduce-scatter into the shard's .grad). Each run trains the residual
// MLP as DDP does, bit for bit: with 1 or 2 ranks a reduced element is the sum of at most two values. The harness
// runs here over Gloo with thread ranks on the CPU.
#include <ddp/fsdp/fully_sharded.h>

#include <string>

#include <ddp/launch/worker_group.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "ddp/ddp_test_util.h"
#include "ddp/fully_sharded_test_util.h"
#include "test_util.h"

namespace {

using namespace fsdp_test;  // NOLINT(google-build-using-namespace): the shared test model

/// On `world` thread ranks over `backend` (with `cuda`, rank r on GPU r): full sharding, with and without
/// reshard_after_forward and prefetch, ends with DDP's losses and parameters.
void expect_fsdp_trains_like_ddp(const std::string& backend, int world, bool cuda) {
  const uint64_t seed = test_util::fresh_seed();
  const int port = ddp::detail::find_free_port();
  const auto errors = ddp_test::run_thread_ranks(world, [&](int rank) {
    const ddp::ProcessGroup pg = ddp_test::thread_rank_group(backend, rank, world, port, cuda);
    const torch::Device device =
        cuda ? torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(rank)) : torch::Device(torch::kCPU);
    const Trained ddp = train_ddp(seed, rank, pg, 4, 1, device);
    const std::string what = c10::str("rank ", rank, " of ", world, " (", backend, ")");
    check_same(train_fsdp(seed, rank, pg, 4, 1, {}, device), ddp, 0.0, what);
    check_same(
        train_fsdp(seed, rank, pg, 4, 2, ddp::FullyShardOptions().reshard_after_forward(false).prefetch(false), device),
        train_ddp(seed, rank, pg, 4, 2, device), 0.0, what + ", no_sync, no resharding, no prefetch");
  });
  for (int rank = 0; rank < world; ++rank) EXPECT_EQ(errors[static_cast<size_t>(rank)], "") << "rank " << rank;
}

TEST(FullyShardedNcclTest, OneRankOnTheGpuTrainsLikeDdpBitForBit) {
  LTA_REQUIRE_NCCL_GPUS(1);
  expect_fsdp_trains_like_ddp("nccl", 1, /*cuda=*/true);
}

TEST(FullyShardedNcclTest, TwoRanksOnTwoGpusTrainLikeDdpBitForBit) {
  LTA_REQUIRE_NCCL_GPUS(2);
  expect_fsdp_trains_like_ddp("nccl", 2, /*cuda=*/true);
}

TEST(FullyShardedThreadRanksTest, TheDeviceCheckPassesOverGlooOnTheCpuWithOneAndTwoRanks) {
  LTA_REQUIRE_GLOO();
  expect_fsdp_trains_like_ddp("gloo", 1, /*cuda=*/false);
  expect_fsdp_trains_like_ddp("gloo", 2, /*cuda=*/false);
}

}  // namespace
