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

TEST(DistributedDataParallelTest, GradientsEqualSingleProcessFullBatchGradientsWithTwoAndFourRanks) {
  LTA_REQUIRE_GLOO();
  const uint64_t seed = test_util::fresh_seed();
  for (const int world : {2, 4}) {
    run_ranks(
        [seed](int rank, const ddp::ProcessGroup& pg) {
          const Data data = make_data(seed + 100);
          const auto expected = reference_grads(seed, data);
          const Data mine = shard(data, rank, pg.size());
          for (const auto& options : bucket_variants()) {
            Mlp model = make_model(seed, rank);
            ddp::DistributedDataParallel ddp(model, pg, options);
            torch::mse_loss(ddp.forward(mine.x), mine.y).backward();
            check_close(grads_of(*model), expected, 1e-5, 1e-6,
                        c10::str("rank ", rank, " of ", pg.size(), ", ", ddp.buckets().size(), " buckets"));
          }
        },
        world);
  }
}

TEST(DistributedDataParallelTest, AfterTrainingStepsAllRanksAreBitIdenticalWithTwoAndFourRanks) {
  LTA_REQUIRE_GLOO();
  const uint64_t seed = test_util::fresh_seed();
  constexpr int kSteps = 5;
  for (const int world : {2, 4}) {
    ddp_test::ScratchDir dir;
    run_ranks(
        [&](int rank, const ddp::ProcessGroup& pg) {
          Mlp model = make_model(seed, rank);
          ddp::DistributedDataParallel ddp(model, pg, ddp::DistributedDataParallelOptions().bucket_cap_mb(0.002));
          torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
          for (int step = 0; step < kSteps; ++step) {
            const Data d = make_data(seed + 1000 * static_cast<uint64_t>(rank + 1) + static_cast<uint64_t>(step), 8);
            opt.zero_grad();
            torch::mse_loss(ddp.forward(d.x), d.y).backward();
            opt.step();
          }
          save(model->parameters(), dir.file("rank" + std::to_string(rank) + ".pt"));
        },
        world);
    const auto r0 = load(dir.file("rank0.pt"));
    const Mlp initial = make_model(seed, 0);
    for (int r = 1; r < world; ++r) {
      const auto rn = load(dir.file("rank" + std::to_string(r) + ".pt"));
      ASSERT_EQ(r0.size(), rn.size());
      for (size_t i = 0; i < r0.size(); ++i) {
        EXPECT_TRUE(torch::equal(r0[i], rn[i])) << "parameter " << i << " differs between rank 0 and " << r;
      }
    }
    for (size_t i = 0; i < r0.size(); ++i) {
      EXPECT_FALSE(torch::equal(r0[i], initial->parameters()[i])) << "parameter " << i << " did not train";
    }
  }
}

TEST(DistributedDataParallelTest, NoSyncAccumulatesLocallyAndTheNextBackwardAveragesABigBatch) {
  LTA_REQUIRE_GLOO();
  const uint64_t seed = test_util::fresh_seed();
  run_ranks([seed](int rank, const ddp::ProcessGroup& pg) {
    const Data data = make_data(seed + 7);
    const auto expected = reference_grads(seed, data);
    const Data mine = shard(data, rank, pg.size());
    const int64_t half = mine.x.size(0) / 2;
    const Data micro[2] = {{mine.x.narrow(0, 0, half), mine.y.narrow(0, 0, half)},
                           {mine.x.narrow(0, half, half), mine.y.narrow(0, half, half)}};
    Mlp model = make_model(seed, rank);
    ddp::DistributedDataParallel ddp(model, pg, ddp::DistributedDataParallelOptions().bucket_cap_mb(0.002));
    {
      auto no_sync = ddp.no_sync();
      (torch::mse_loss(ddp.forward(micro[0].x), micro[0].y) / 2).backward();
    }
    // Inside no_sync the gradient is this rank's own: compare with a local computation.
    Mlp local = make_model(seed, 0);
    (torch::mse_loss(local->forward(micro[0].x), micro[0].y) / 2).backward();
    check_close(grads_of(*model), grads_of(*local), 1e-6, 1e-7, c10::str("rank ", rank, " inside no_sync"));

    (torch::mse_loss(ddp.forward(micro[1].x), micro[1].y) / 2).backward();
    check_close(grads_of(*model), expected, 1e-5, 1e-6, c10::str("rank ", rank, " after accumulation"));
  });
}

TEST(DistributedDataParallelTest, ARankExitingMidTrainingFailsTheOthersQuicklyWithAClearError) {
  LTA_REQUIRE_GLOO();
  const uint64_t seed = test_util::fresh_seed();
  const std::chrono::milliseconds timeout(8000);
  const auto start = Clock::now();
  const std::string message = error_of([&] {
    run_ranks(
        [seed](int rank, const ddp::ProcessGroup& pg) {
          Mlp model = make_model(seed, rank);
          ddp::DistributedDataParallel ddp(model, pg);
          const Data d = shard(make_data(seed), rank, pg.size());
          for (int step = 0; step < 100; ++step) {
            if (rank == 1 && step == 2) ::_exit(0);  // leaves quietly: only the survivor can report the failure
            model->zero_grad();
            torch::mse_loss(ddp.forward(d.x), d.y).backward();
          }
        },
        kWorld, timeout);
  });
  // The survivor names itself and the backend; which collective notices the lost peer first depends on timing
  // under load, so the collective's name is not required.
  EXPECT_TRUE(contains_all(message, {"ddp::spawn: rank 0 of 2", "failed on rank 0 of 2 (backend gloo)"})) << message;
  EXPECT_LT(Clock::now() - start, timeout);
}

// GPU itself and, finding none, leaves a marker that makes the test skip.

/// Runs fn(rank, pg) on `world` forked ranks over `backend` with the model on cuda:0; returns false when the
/// children found no GPU.
bool run_ranks_on_gpu(const std::string& backend, int world,
                      const std::function<void(int, const ddp::ProcessGroup&)>& fn) {
  ddp_test::ScratchDir dir;
  ddp::spawn(world, [&](int rank, int) {
    if (!torch::cuda::is_available()) {
      std::ofstream(dir.file("no_gpu" + std::to_string(rank))) << "none";
      return;
    }
    at::set_num_threads(1);
    const ddp::ProcessGroup pg =
        ddp::init_process_group(ddp::InitOptions().backend(backend).cuda_device(0).timeout(kTestTimeout));
    fn(rank, pg);
  });
  return !std::ifstream(dir.file("no_gpu0")).good();
}

TEST(DistributedDataParallelTest, NcclWithWorldSizeOneOnTheGpuKeepsTheGradients) {
  if (!ddp::backend_available("nccl")) GTEST_SKIP() << "needs the NCCL backend (a CUDA build)";
  const uint64_t seed = test_util::fresh_seed();
  const bool ran = run_ranks_on_gpu("nccl", 1, [seed](int, const ddp::ProcessGroup& pg) {
    TORCH_CHECK(pg.device().is_cuda(), "an NCCL group works on CUDA tensors, got ", pg.device());
    const Data d = make_data(seed);
    const auto x = d.x.cuda(), y = d.y.cuda();
    Mlp model = make_model(seed, 0);
    model->to(torch::kCUDA);
    Mlp local = make_model(seed, 0);
    local->to(torch::kCUDA);
    ddp::DistributedDataParallel ddp(model, pg, ddp::DistributedDataParallelOptions().bucket_cap_mb(0.002));
    for (int step = 0; step < 2; ++step) {  // the second step reuses the buckets
      model->zero_grad();
      local->zero_grad();
      torch::mse_loss(ddp.forward(x), y).backward();
      torch::mse_loss(local->forward(x), y).backward();
      check_close(grads_of(*model), grads_of(*local), 0, 0, c10::str("NCCL world size 1, step ", step));
    }
  });
  if (!ran) GTEST_SKIP() << "needs a CUDA GPU; none is present";
}

TEST(DistributedDataParallelTest, GlooWithCudaTensorsMatchesFullBatchGradients) {
  LTA_REQUIRE_GLOO();
  const uint64_t seed = test_util::fresh_seed();
  const bool ran = run_ranks_on_gpu("gloo", kWorld, [seed](int rank, const ddp::ProcessGroup& pg) {
    const Data data = make_data(seed + 100);
    Mlp ref = make_model(seed, 0);
    ref->to(torch::kCUDA);
    torch::mse_loss(ref->forward(data.x.cuda()), data.y.cuda()).backward();
    const Data mine = shard(data, rank, pg.size());
    for (const auto& options : bucket_variants()) {
      Mlp model = make_model(seed, rank);
      model->to(torch::kCUDA);
      ddp::DistributedDataParallel ddp(model, pg, options);
      torch::mse_loss(ddp.forward(mine.x.cuda()), mine.y.cuda()).backward();
      check_close(grads_of(*model), grads_of(*ref), 1e-4, 1e-5, c10::str("rank ", rank, " (Gloo, CUDA tensors)"));
    }
  });
  if (!ran) GTEST_SKIP() << "needs a CUDA GPU; none is present";
}

// Forward and backward on a non-default stream: DDP writes the averaged gradients on its communication stream into
// tensors allocated on that stream (record_stream keeps the allocator from reusing them early). Step after step, with
// the freed gradients' memory churned by new allocations, the gradients are those of full-batch training.
TEST(DistributedDataParallelTest, GlooWithCudaTensorsOnASideStreamMatchesFullBatchGradients) {
  LTA_REQUIRE_GLOO();
#ifdef LIBTORCH_AMP_WITH_CUDA
  const uint64_t seed = test_util::fresh_seed();
  const bool ran = run_ranks_on_gpu("gloo", kWorld, [seed](int rank, const ddp::ProcessGroup& pg) {
    const Data data = make_data(seed + 200);
    Mlp ref = make_model(seed, 0);
    ref->to(torch::kCUDA);
    torch::mse_loss(ref->forward(data.x.cuda()), data.y.cuda()).backward();
    const Data mine = shard(data, rank, pg.size());
    Mlp model = make_model(seed, rank);
    model->to(torch::kCUDA);
    ddp::DistributedDataParallel ddp(model, pg, ddp::DistributedDataParallelOptions().bucket_cap_mb(0.002));
    const c10::cuda::CUDAStreamGuard on_side_stream(c10::cuda::getStreamFromPool());
    for (int step = 0; step < 3; ++step) {
      model->zero_grad();
      torch::mse_loss(ddp.forward(mine.x.cuda()), mine.y.cuda()).backward();
      std::vector<torch::Tensor> churn;
      for (int i = 0; i < 8; ++i) churn.push_back(torch::full({4096}, 7.0f, torch::kCUDA));
      check_close(grads_of(*model), grads_of(*ref), 1e-4, 1e-5,
                  c10::str("rank ", rank, " step ", step, " (side stream)"));
    }
  });
  if (!ran) GTEST_SKIP() << "needs a CUDA GPU; none is present";
#else
  GTEST_SKIP() << "libtorch_amp was built without CUDA (LIBTORCH_AMP_CUDA=OFF)";
#endif
}

}  // namespace
