// ddp::DataParallel: single-process replication. On the CPU the replicas run on {cpu, cpu} (two replicas on one
// device, on two threads): the same code path as over GPUs, minus the device copies, which the GPU check covers.
#include <ddp/data_parallel.h>

#include <atomic>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <ATen/autocast_mode.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "ddp/ddp_test_util.h"
#include "test_util.h"

namespace {

using ddp_test::contains_all;
using ddp_test::error_of;
using ddp_test::grads_of;

/// What each replica saw when it ran: its thread, autocast state, grad mode.
struct Observations {
  std::mutex mutex;
  std::vector<std::thread::id> threads;
  std::vector<bool> autocast_enabled;
  std::vector<bool> grad_enabled;
  void record() {
    std::lock_guard<std::mutex> lock(mutex);
    threads.push_back(std::this_thread::get_id());
    autocast_enabled.push_back(at::autocast::is_autocast_enabled(at::kCPU));
    grad_enabled.push_back(at::GradMode::is_enabled());
  }
};

struct NetImpl : torch::nn::Cloneable<NetImpl> {
  explicit NetImpl(std::shared_ptr<Observations> seen = nullptr) : seen(std::move(seen)) { reset(); }
  void reset() override {
    fc1 = register_module("fc1", torch::nn::Linear(6, 16));
    bn = register_module("bn", torch::nn::BatchNorm1d(16));
    fc2 = register_module("fc2", torch::nn::Linear(16, 3));
  }
  torch::Tensor forward(torch::Tensor x) {
    if (seen) seen->record();
    return fc2(torch::relu(bn(fc1(x))));
  }
  std::shared_ptr<Observations> seen;  // shared by the replicas (copied with the module)
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  torch::nn::BatchNorm1d bn{nullptr};
};
TORCH_MODULE(Net);

const std::vector<torch::Device> kTwoCpuReplicas = {torch::kCPU, torch::kCPU};

TEST(DataParallelTest, TwoReplicasGiveTheModulesOutputAndFullBatchGradients) {
  const uint64_t seed = test_util::fresh_seed();
  for (const int64_t batch : {8, 7}) {  // an even and an uneven split
    torch::manual_seed(seed);
    Net reference;
    reference->eval();  // BatchNorm statistics per chunk would differ from full-batch ones in training mode
    Net net = std::dynamic_pointer_cast<NetImpl>(reference->clone());
    const torch::Tensor x = torch::randn({batch, 6}), y = torch::randn({batch, 3});

    torch::mse_loss(reference->forward(x), y).backward();
    ddp::DataParallel<NetImpl> dp(net, ddp::DataParallelOptions().devices(kTwoCpuReplicas));
    const torch::Tensor out = dp.forward(x);
    // fp32: each output row is the same GEMM row on a chunk or the whole batch (a few 2^-24 at most, whatever the
    // kernel path); the gradients are fp32 sums over the batch in another order: 1e-5.
    EXPECT_TRUE(torch::allclose(out, reference->forward(x), 1e-6, 1e-6)) << "batch " << batch;
    torch::mse_loss(out, y).backward();
    const auto expected = grads_of(*reference), actual = grads_of(*net);
    ASSERT_EQ(actual.size(), expected.size());
    for (size_t i = 0; i < actual.size(); ++i) {
      EXPECT_TRUE(torch::allclose(actual[i], expected[i], 1e-5, 1e-6))
          << "batch " << batch << ", parameter " << i << ": max abs diff "
          << (actual[i] - expected[i]).abs().max().item<double>();
    }
  }
}

TEST(DataParallelTest, ReplicasRunOnTheirOwnThreadsWithTheCallersAutocastAndGradMode) {
  auto seen = std::make_shared<Observations>();
  Net net(seen);
  ddp::DataParallel<NetImpl> dp(net, ddp::DataParallelOptions().devices(kTwoCpuReplicas));
  const torch::Tensor x = torch::randn({4, 6});
  {
    at::autocast::set_autocast_enabled(at::kCPU, true);
    at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
    const torch::Tensor out = dp.forward(x);
    at::autocast::set_autocast_enabled(at::kCPU, false);
    at::autocast::clear_cache();
    // Every replica's last Linear ran under bf16 autocast; an fp32 replica would have made cat promote or fail.
    EXPECT_EQ(out.scalar_type(), torch::kBFloat16);
  }
  {
    torch::NoGradGuard no_grad;
    EXPECT_FALSE(dp.forward(x).requires_grad());
  }
  ASSERT_EQ(seen->threads.size(), 4u);
  EXPECT_NE(seen->threads[0], seen->threads[1]) << "the two replicas ran on one thread";
  EXPECT_TRUE(seen->autocast_enabled[0] && seen->autocast_enabled[1]) << "autocast did not reach every replica";
  EXPECT_FALSE(seen->grad_enabled[2] || seen->grad_enabled[3]) << "NoGradGuard did not reach every replica";
}

TEST(DataParallelTest, TheFirstReplicasBatchNormStatisticsAreWrittenBackToTheModule) {
  torch::manual_seed(test_util::fresh_seed());
  Net net;
  Net first_chunk_only = std::dynamic_pointer_cast<NetImpl>(net->clone());
  const torch::Tensor x = torch::randn({8, 6}) * 3 + 1;
  ddp::DataParallel<NetImpl> dp(net, ddp::DataParallelOptions().devices(kTwoCpuReplicas));
  dp.forward(x);
  first_chunk_only->forward(x.narrow(0, 0, 4));
  EXPECT_TRUE(torch::allclose(net->bn->running_mean, first_chunk_only->bn->running_mean));
  EXPECT_TRUE(torch::allclose(net->bn->running_var, first_chunk_only->bn->running_var));
  EXPECT_EQ(net->bn->num_batches_tracked.item<int64_t>(), 1);
}

TEST(DataParallelTest, ABatchSmallerThanTheReplicasUsesFewerReplicas) {
  torch::manual_seed(test_util::fresh_seed());
  auto seen = std::make_shared<Observations>();
  Net net(seen);
  net->eval();
  ddp::DataParallel<NetImpl> dp(net, ddp::DataParallelOptions().devices({torch::kCPU, torch::kCPU, torch::kCPU}));
  const torch::Tensor x = torch::randn({1, 6});
  const torch::Tensor out = dp.forward(x);
  EXPECT_EQ(seen->threads.size(), 1u) << "one sample runs one replica";
  EXPECT_TRUE(torch::allclose(out, net->forward(x)));
}

TEST(DataParallelTest, BadInputIsAnErrorNamingIt) {
  Net net;
  ddp::DataParallel<NetImpl> dp(net, ddp::DataParallelOptions().devices(kTwoCpuReplicas));
  EXPECT_TRUE(contains_all(error_of([&] { dp.forward(torch::Tensor()); }), {"undefined"}));
  EXPECT_TRUE(contains_all(error_of([&] { dp.forward(torch::randn({})); }), {"0-dimensional"}));
  EXPECT_TRUE(contains_all(error_of([&] { dp.forward(torch::randn({0, 6})); }), {"[0, 6]", "empty"}));
  ddp::DataParallel<NetImpl> bad_dim(net, ddp::DataParallelOptions().devices(kTwoCpuReplicas).dim(2));
  EXPECT_TRUE(contains_all(error_of([&] { bad_dim.forward(torch::randn({4, 6})); }), {"dim 2", "[4, 6]"}));
  // A replica that fails is named, with its device.
  EXPECT_TRUE(contains_all(error_of([&] { dp.forward(torch::randn({4, 5})); }), {"replica", "on cpu", "6x16"}));
  if (!test_util::cuda_available()) {
    EXPECT_TRUE(contains_all(error_of([&] { ddp::DataParallel<NetImpl> none(net); }), {"no CUDA device", "devices"}));
  }
}

TEST(DataParallelTest, OnTheGpuOutputsGoToTheChosenDeviceAndGradientsToTheModule) {
  LTA_REQUIRE_CUDA();
  torch::manual_seed(test_util::fresh_seed());
  Net reference;
  reference->eval();
  Net net = std::dynamic_pointer_cast<NetImpl>(reference->clone());
  net->to(torch::kCUDA);
  const torch::Tensor x = torch::randn({9, 6}), y = torch::randn({9, 3});
  torch::mse_loss(reference->forward(x), y).backward();
  // Two replicas on the one GPU of the check machine (or on two GPUs where there are), outputs on the CPU.
  const std::vector<torch::Device> gpus = {torch::Device(torch::kCUDA, 0),
                                           torch::Device(torch::kCUDA, torch::cuda::device_count() > 1 ? 1 : 0)};
  ddp::DataParallel<NetImpl> dp(net, ddp::DataParallelOptions().devices(gpus).output_device(torch::kCPU));
  const torch::Tensor out = dp.forward(x.cuda());
  EXPECT_EQ(out.device(), torch::Device(torch::kCPU));
  torch::mse_loss(out, y).backward();
  const auto expected = grads_of(*reference), actual = grads_of(*net);
  for (size_t i = 0; i < actual.size(); ++i) {
    EXPECT_EQ(actual[i].device(), torch::Device(torch::kCUDA, 0));
    EXPECT_TRUE(torch::allclose(actual[i].cpu(), expected[i], 1e-4, 1e-5)) << "parameter " << i;
  }
  EXPECT_TRUE(contains_all(
      error_of([&] { ddp::DataParallel<NetImpl> wrong(reference, ddp::DataParallelOptions().devices(gpus)); }),
      {"is on cpu", "first replica device is cuda:0"}));
}

}  // namespace
