// amp over full sharding on the GPU, over NCCL (in the GPU check's never-run group, `FullySharded.*Nccl`; compiled
// here, skipped without a GPU): ranks are threads of the test process, rank r on GPU r, so one GPU gives a world of 1
// where the collectives are copies but every step of the path runs on the device: units gathered in bf16 from fp32
// shards through the caching allocator, the scaled gradients reduced in fp32 into the shards' .grad, unscaled and
// checked by the fused kernels, the overflow flag allreduced, the fused AdamW step on the shards. Each run is compared
// with DDP + amp O2 on the same GPU(s): with torch::optim::SGD bit for bit (the same ATen kernels on the same values,
// as on the CPU); with amp's FusedAdamW within 1e-5 of each tensor's largest value (the CUDA kernels are compiled with
// nvcc's default FMA contraction, so the fp32-shard and the master instantiation may round an update differently; on
// the CPU, compiled with -ffp-contract=off, they agree bit for bit). The harness runs here over Gloo with thread ranks.
#include <string>

#include <ddp/launch/worker_group.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "amp/fully_sharded_amp_test_util.h"
#include "ddp/ddp_test_util.h"

namespace {

using namespace fsdp_amp_test;  // NOLINT(google-build-using-namespace): the shared runs

/// On `world` thread ranks over `backend` (with `cuda`, rank r on GPU r): amp O2 over full sharding against DDP + amp
/// O2, with SGD and with FusedAdamW, through a skipped step.
void expect_amp_fsdp_trains_like_ddp_amp(const std::string& backend, int world, bool cuda) {
  const int port = ddp::detail::find_free_port();
  const auto errors = ddp_test::run_thread_ranks(world, [&](int rank) {
    const ddp::ProcessGroup pg = ddp_test::thread_rank_group(backend, rank, world, port, cuda);
    for (const Opt opt : {Opt::kSgd, Opt::kFusedAdamW}) {
      AmpSetup setup;
      setup.opt = opt;
      setup.steps = 9;
      setup.device = cuda ? torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(rank)) : torch::kCPU;
      const AmpRun reference = train_ddp(pg, rank, setup);
      const AmpRun sharded = train_fsdp(pg, rank, setup);
      const std::string what =
          c10::str("rank ", rank, " of ", world, " (", backend, ", ", opt == Opt::kSgd ? "SGD" : "FusedAdamW", ")");
      TORCH_CHECK(sharded.skipped == reference.skipped, what, ": other steps were skipped than under DDP + amp");
      TORCH_CHECK(world == 1 || sharded.skipped[static_cast<size_t>(setup.inf_step)] == 1, what,
                  ": the step with an inf on rank 1 was not skipped");
      const double diff = max_relative_difference(sharded, reference);
      const double bound = opt == Opt::kSgd ? 0.0 : 1e-5;
      TORCH_CHECK(diff <= bound, what, ": parameters differ from DDP + amp's by ", diff, " (bound ", bound, ")");
    }
  });
  for (int rank = 0; rank < world; ++rank) EXPECT_EQ(errors[static_cast<size_t>(rank)], "") << "rank " << rank;
}

TEST(FullyShardedAmpNcclTest, OneRankOnTheGpuTrainsLikeDdpAmp) {
  LTA_REQUIRE_NCCL_GPUS(1);
  expect_amp_fsdp_trains_like_ddp_amp("nccl", 1, /*cuda=*/true);
}

TEST(FullyShardedAmpNcclTest, TwoRanksOnTwoGpusTrainLikeDdpAmp) {
  LTA_REQUIRE_NCCL_GPUS(2);
  expect_amp_fsdp_trains_like_ddp_amp("nccl", 2, /*cuda=*/true);
}

TEST(FullyShardedAmpThreadRanksTest, TheDeviceCheckPassesOverGlooOnTheCpuWithOneAndTwoRanks) {
  LTA_REQUIRE_GLOO();
  expect_amp_fsdp_trains_like_ddp_amp("gloo", 1, /*cuda=*/false);
  expect_amp_fsdp_trains_like_ddp_amp("gloo", 2, /*cuda=*/false);
}

}  // namespace
