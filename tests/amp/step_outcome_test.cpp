// amp::Optimizer::step(): what it returns, and whether the last step was skipped (device tensor and lazily read
// host value), with a plain torch::optim optimizer and with amp's fused optimizers; the scaler's growth tracker.
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include <amp/amp.h>
#include <amp/optim/fused_optimizers.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "test_util.h"

namespace {

struct NetImpl : torch::nn::Module {
  NetImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(8, 16));
    fc2 = register_module("fc2", torch::nn::Linear(16, 4));
  }
  torch::Tensor forward(torch::Tensor x) { return fc2(torch::relu(fc1(x))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(Net);

torch::Tensor batch(uint64_t seed, bool inf = false) {
  auto x = torch::randn({8, 8}, at::make_generator<at::CPUGeneratorImpl>(seed));
  if (inf) x[0][0] = std::numeric_limits<float>::infinity();
  return x;
}

std::vector<torch::Tensor> snapshot(Net& net) {
  std::vector<torch::Tensor> out;
  for (const auto& p : net->parameters()) out.push_back(p.detach().clone());
  return out;
}

bool unchanged(Net& net, const std::vector<torch::Tensor>& before) {
  const auto now = net->parameters();
  for (size_t i = 0; i < now.size(); ++i) {
    if (!torch::equal(now[i], before[i])) return false;
  }
  return true;
}

enum class Kind { kSgd, kFusedSgd, kFusedAdamW };

std::string name_of(Kind kind) {
  switch (kind) {
    case Kind::kSgd:
      return "Sgd";
    case Kind::kFusedSgd:
      return "FusedSgd";
    case Kind::kFusedAdamW:
      return "FusedAdamW";
  }
  return "?";
}

class StepOutcomeTest : public ::testing::TestWithParam<std::tuple<Kind, amp::OptLevel>> {};

// Clean, overflowing and clean steps again: last_step_skipped() (device) and last_step_now() (host) say which was
// skipped and survive step(), which clears found_inf() for the next step; the parameters move exactly when not
// skipped; step() returns the closure's loss, skipped or not, and an undefined tensor without a closure.
TEST_P(StepOutcomeTest, SaysWhetherTheLastStepWasSkippedAndReturnsTheClosureLoss) {
  const auto [kind, level] = GetParam();
  torch::manual_seed(11);
  Net net;
  std::unique_ptr<torch::optim::Optimizer> inner;
  if (kind == Kind::kSgd) inner = std::make_unique<torch::optim::SGD>(net->parameters(), 0.05);
  if (kind == Kind::kFusedSgd) inner = std::make_unique<amp::FusedSGD>(net->parameters(), amp::FusedSgdOptions(0.05));
  if (kind == Kind::kFusedAdamW) inner = std::make_unique<amp::FusedAdamW>(net->parameters());
  auto initialized =
      amp::initialize(net, *inner, amp::Options().opt_level(level).half_dtype(torch::kBFloat16).dynamic_loss_scale());
  auto& model = initialized.model;  // references, not structured bindings: the closure below captures them
  auto& optimizer = initialized.optimizer;
  EXPECT_EQ(optimizer.last_step().step, -1);
  EXPECT_EQ(optimizer.last_step_skipped().item<float>(), 0.0f);

  const std::vector<bool> overflows = {false, true, false, true, true, false};
  for (size_t step = 0; step < overflows.size(); ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    const auto before = snapshot(net);
    optimizer.zero_grad();
    torch::Tensor closure_loss;
    const torch::Tensor returned = optimizer.step([&] {
      closure_loss = model(batch(step, overflows[step])).pow(2).mean();
      auto scaled = amp::scale_loss(closure_loss, optimizer);
      scaled.backward();
      return closure_loss;
    });
    ASSERT_TRUE(returned.defined()) << "step() returns the closure's loss";
    EXPECT_TRUE(returned.is_same(closure_loss));
    EXPECT_EQ(optimizer.last_step_skipped().item<float>(), overflows[step] ? 1.0f : 0.0f);
    EXPECT_EQ(optimizer.found_inf().item<float>(), 0.0f) << "found_inf() belongs to the next step";
    const amp::StepReport report = optimizer.last_step_now();
    EXPECT_EQ(report.step, static_cast<int64_t>(step));
    EXPECT_EQ(report.skipped, overflows[step]);
    EXPECT_EQ(unchanged(net, before), overflows[step]) << "parameters move exactly on the steps not skipped";
    EXPECT_EQ(optimizer.last_step().step, static_cast<int64_t>(step)) << "lazily read, completed on the CPU";
  }
  // Without a closure: an undefined tensor, skipped or not.
  optimizer.zero_grad();
  {
    auto scaled = amp::scale_loss(model(batch(99, true)).pow(2).mean(), optimizer);
    scaled.backward();
  }
  EXPECT_FALSE(optimizer.step().defined());
  EXPECT_TRUE(optimizer.last_step_now().skipped);
}

INSTANTIATE_TEST_SUITE_P(PlainAndFused, StepOutcomeTest,
                         ::testing::Combine(::testing::Values(Kind::kSgd, Kind::kFusedSgd, Kind::kFusedAdamW),
                                            ::testing::Values(amp::OptLevel::O1, amp::OptLevel::O2)),
                         [](const auto& info) {
                           return name_of(std::get<0>(info.param)) +
                                  (std::get<1>(info.param) == amp::OptLevel::O1 ? "O1" : "O2");
                         });

// A non-finite clipped norm marks the step skipped as well (clip_grad_norm_ writes found_inf()).
TEST(StepOutcomeClipTest, ANonFiniteClippedNormIsASkippedStep) {
  torch::manual_seed(12);
  Net net;
  amp::FusedSGD sgd(net->parameters(), amp::FusedSgdOptions(0.05));
  auto [model, optimizer] = amp::initialize(net, sgd, amp::Options().opt_level(amp::OptLevel::O1));
  optimizer.zero_grad();
  {
    auto scaled = amp::scale_loss(model(batch(1)).pow(2).mean(), optimizer);
    scaled.backward();
  }
  optimizer.gradients()[0][0][0] = std::numeric_limits<float>::quiet_NaN();
  amp::clip_grad_norm_(optimizer, 1.0);
  optimizer.step();
  EXPECT_EQ(optimizer.last_step_skipped().item<float>(), 1.0f);
  EXPECT_TRUE(optimizer.last_step_now().skipped);
}

// The growth tracker (torch.amp's _growth_tracker) as a device tensor and in the diagnostics.
TEST(StepOutcomeClipTest, GrowthTrackerCountsCleanStepsSinceTheScaleMoved) {
  torch::manual_seed(13);
  Net net;
  torch::optim::SGD sgd(net->parameters(), 0.01);
  auto [model, optimizer] =
      amp::initialize(net, sgd, amp::Options().opt_level(amp::OptLevel::O1).dynamic_loss_scale().growth_interval(3));
  const std::vector<bool> overflows = {false, false, true, false, false, false, false};
  const std::vector<int> expected = {1, 2, 0, 1, 2, 0, 1};  // the third clean step in a row grows the scale
  for (size_t step = 0; step < overflows.size(); ++step) {
    optimizer.zero_grad();
    {
      auto scaled = amp::scale_loss(model(batch(step, overflows[step])).pow(2).mean(), optimizer);
      scaled.backward();
    }
    optimizer.step();
    EXPECT_EQ(optimizer.scaler().growth_tracker().item<int>(), expected[step]) << "step " << step;
    EXPECT_EQ(optimizer.scaler().diagnostics_now().growth_tracker, expected[step]) << "step " << step;
  }
}

}  // namespace
