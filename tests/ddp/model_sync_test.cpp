#include <ddp/distributed_data_parallel.h>

#include <unistd.h>

#include <chrono>
#include <fstream>
#include <string>
#include <vector>

#include <ddp/launch/spawn.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#ifdef LIBTORCH_AMP_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include "ddp/ddp_mlp_test_util.h"
#include "ddp/ddp_test_util.h"
#include "test_util.h"

namespace {

using namespace ddp_mlp;  // NOLINT(google-build-using-namespace): the shared test model

TEST(ModelSyncTest, ConstructionBroadcastsRankZerosParameters) {
  LTA_REQUIRE_GLOO();
  const uint64_t seed = test_util::fresh_seed();
  run_ranks([seed](int rank, const ddp::ProcessGroup& pg) {
    Mlp model = make_model(seed, rank);
    ddp::DistributedDataParallel ddp(model, pg);
    const Mlp rank0 = make_model(seed, 0);
    check_close(model->parameters(), rank0->parameters(), 0, 0, c10::str("rank ", rank, " parameters"));
  });
}

struct WithBufferImpl : torch::nn::Module {
  WithBufferImpl() {
    fc = register_module("fc", torch::nn::Linear(kIn, kOut));
    counter = register_buffer("counter", torch::zeros({3}));
  }
  torch::Tensor forward(torch::Tensor x) { return fc->forward(x) + counter.sum(); }
  torch::nn::Linear fc{nullptr};
  torch::Tensor counter;
};
TORCH_MODULE(WithBuffer);

TEST(ModelSyncTest, BroadcastBuffersBeforeForwardIsAnOption) {
  LTA_REQUIRE_GLOO();
  run_ranks([](int rank, const ddp::ProcessGroup& pg) {
    for (const bool broadcast : {true, false}) {
      WithBuffer model;
      ddp::DistributedDataParallel ddp(model, pg, ddp::DistributedDataParallelOptions().broadcast_buffers(broadcast));
      {
        torch::NoGradGuard no_grad;
        model->counter.fill_(static_cast<float>(rank + 1));
      }
      ddp.forward(torch::zeros({2, kIn}));
      const float expected = broadcast ? 1.0f : static_cast<float>(rank + 1);
      TORCH_CHECK(model->counter.eq(expected).all().item<bool>(), "rank ", rank, " broadcast_buffers=", broadcast,
                  ": counter is ", model->counter);
    }
  });
}

TEST(ModelSyncTest, MismatchedModelsFailOnEveryRankNamingTheParameter) {
  LTA_REQUIRE_GLOO();
  const uint64_t seed = test_util::fresh_seed();
  ddp_test::ScratchDir dir;
  run_ranks([&](int rank, const ddp::ProcessGroup& pg) {
    Mlp model = make_model(seed, rank, rank == 0 ? kWidths : std::vector<int64_t>{kIn, 32, 24, 32, kOut});
    const std::string message = error_of([&] { ddp::DistributedDataParallel ddp(model, pg); });
    std::ofstream(dir.file("rank" + std::to_string(rank))) << message;
  });
  for (int rank = 0; rank < kWorld; ++rank) {
    std::ifstream in(dir.file("rank" + std::to_string(rank)));
    const std::string message((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    EXPECT_TRUE(
        contains_all(message, {"the module or the options differ across ranks (checked on rank " + std::to_string(rank),
                               "entry #2 is 'parameter layers.1.weight [32, 32] Float' on rank 0 but "
                               "'parameter layers.1.weight [24, 32] Float' on rank 1"}));
  }
}

TEST(ModelSyncTest, DifferentBucketOptionsFailOnEveryRankInsteadOfPairingUnrelatedBuckets) {
  LTA_REQUIRE_GLOO();
  const uint64_t seed = test_util::fresh_seed();
  const std::string message = error_of([&] {
    run_ranks([&](int rank, const ddp::ProcessGroup& pg) {
      Mlp model = make_model(seed, rank);
      ddp::DistributedDataParallel ddp(model, pg, ddp::DistributedDataParallelOptions().bucket_cap_mb(rank + 1));
    });
  });
  EXPECT_TRUE(contains_all(message, {"'option bucket_cap_mb=1 ", "' on rank 0 but 'option bucket_cap_mb=2 "}));
}

/// Uses its second layer only when told to.

}  // namespace
