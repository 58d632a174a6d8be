// amp with the tutorial's first way (ddp::DataParallel): replicas of an amp-initialized model train it exactly as
// the unreplicated model does, under every opt level. On the CPU the two replicas share the CPU (two threads).
#include <algorithm>
#include <string>
#include <vector>

#include <amp/amp.h>
#include <ddp/data_parallel.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "test_util.h"

namespace {

struct NetImpl : torch::nn::Cloneable<NetImpl> {
  NetImpl() { reset(); }
  void reset() override {
    fc1 = register_module("fc1", torch::nn::Linear(12, 32));
    fc2 = register_module("fc2", torch::nn::Linear(32, 4));
  }
  torch::Tensor forward(torch::Tensor x) { return fc2(torch::gelu(fc1(x))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(Net);

class AmpDataParallelTest : public ::testing::TestWithParam<amp::OptLevel> {};

TEST_P(AmpDataParallelTest, ReplicatedStepsTrainLikeTheUnreplicatedModel) {
  const uint64_t seed = test_util::fresh_seed();
  torch::manual_seed(seed);
  Net plain;
  Net replicated = std::dynamic_pointer_cast<NetImpl>(plain->clone());
  const auto options = amp::Options().opt_level(GetParam()).half_dtype(torch::kBFloat16);
  torch::optim::SGD sgd_plain(plain->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  torch::optim::SGD sgd_replicated(replicated->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  auto [model_plain, opt_plain] = amp::initialize(plain, sgd_plain, options);
  auto [model_replicated, opt_replicated] = amp::initialize(replicated, sgd_replicated, options);
  ddp::DataParallel<NetImpl> dp(replicated, ddp::DataParallelOptions().devices({torch::kCPU, torch::kCPU}));
  std::vector<torch::Tensor> initial;
  for (const auto& p : sgd_plain.param_groups()[0].params()) initial.push_back(p.detach().to(torch::kFloat).clone());

  for (int step = 0; step < 3; ++step) {
    const torch::Tensor x = torch::randn({10, 12}), y = torch::randn({10, 4});
    for (const bool use_dp : {false, true}) {
      auto& optimizer = use_dp ? opt_replicated : opt_plain;
      optimizer.zero_grad();
      const torch::Tensor out =
          use_dp ? model_replicated.call([&](const torch::Tensor& in) { return dp.forward(in); }, x) : model_plain(x);
      EXPECT_EQ(out.scalar_type(), torch::kFloat) << "amp returns fp32 outputs";
      {
        auto scaled = amp::scale_loss(torch::mse_loss(out, y), optimizer);
        scaled.backward();
      }
      optimizer.step();
    }
  }
  // The same parameters up to the rounding of split half matmuls and of the replicas' summed gradients. (That
  // the replicas really ran under O1's autocast is checked directly below.) The bound follows the precision the
  // gradients are summed in: fp32 under O0; bf16 gradients (8 significant bits) under O1-O2; and under O3 the
  // parameters themselves are bf16, each step rounds them again, and momentum carries the difference on. Measured
  // over 250 random seeds, the worst difference was 0.0% (O0), 42% (O1), 72% (O2) and 110% (O3) of a (1e-2, 1e-3)
  // bound, so O1-O2 get twice and O3 four times that bound. Real faults are far larger: a replica's gradient lost or
  // counted twice moves a parameter by about as much as training did (>= 0.04 here). Both sides run the same kernels
  // in one process, so the machine's kernel path only redraws these roundings (Note [bounds on every CPU kernel
  // path], tests/test_util.h); CI reruns it under ATen's default vectors with oneDNN capped at AVX2.
  const double widen = GetParam() == amp::OptLevel::O0 ? 0.1 : GetParam() == amp::OptLevel::O3 ? 4.0 : 2.0;
  const double rtol = 1e-2 * widen, atol = 1e-3 * widen;
  const auto a = sgd_plain.param_groups()[0].params(), b = sgd_replicated.param_groups()[0].params();
  ASSERT_EQ(a.size(), b.size());
  double moved = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const torch::Tensor pa = a[i].to(torch::kFloat), pb = b[i].to(torch::kFloat);  // O3 steps bf16 parameters
    EXPECT_TRUE(torch::allclose(pa, pb, rtol, atol))
        << "parameter " << i << " differs by " << (pa - pb).abs().max().item<double>();
    moved = std::max(moved, (pa - initial[i]).abs().max().item<double>());
  }
  EXPECT_GT(moved, 5 * atol) << "training must move the parameters well past the bound for the comparison to mean "
                                "anything";
}

TEST(AmpDataParallelTest, UnderO1EveryReplicaComputesInTheHalfDtype) {
  Net net;
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1));
  auto [model, optimizer] =
      amp::initialize(net, sgd, amp::Options().opt_level(amp::OptLevel::O1).half_dtype(torch::kBFloat16));
  ddp::DataParallel<NetImpl> dp(net, ddp::DataParallelOptions().devices({torch::kCPU, torch::kCPU}));
  torch::Tensor inner;
  model.call(
      [&](const torch::Tensor& in) {
        inner = dp.forward(in);  // the gathered output before amp's fp32 cast
        return inner;
      },
      torch::randn({6, 12}));
  EXPECT_EQ(inner.scalar_type(), torch::kBFloat16);
  const torch::Tensor fp32_reference = net->forward(torch::randn({6, 12}));
  EXPECT_EQ(fp32_reference.scalar_type(), torch::kFloat) << "outside the policy the model computes in fp32";
}

INSTANTIATE_TEST_SUITE_P(OptLevels, AmpDataParallelTest,
                         ::testing::Values(amp::OptLevel::O0, amp::OptLevel::O1, amp::OptLevel::O2, amp::OptLevel::O3),
                         [](const auto& info) { return "O" + std::to_string(static_cast<int>(info.param)); });

}  // namespace
