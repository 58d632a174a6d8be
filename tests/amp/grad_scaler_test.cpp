#include <amp/grad_scaler.h>

#include <algorithm>
#include <fstream>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "test_util.h"

namespace {

struct GoldenRow {
  bool overflow;
  double grad;
  double scale_after;
  int growth_tracker_after;
  double weight_after;
};

std::vector<GoldenRow> read_golden(const std::string& path) {
  std::ifstream in(path);
  EXPECT_TRUE(in.good()) << "cannot open " << path;
  std::vector<GoldenRow> rows;
  std::string line;
  std::getline(in, line);  // header: step,overflow,grad,scale_after,growth_tracker_after,weight_after
  while (std::getline(in, line)) {
    std::stringstream fields(line);
    std::string step, overflow, grad, scale, tracker, weight;
    std::getline(fields, step, ',');
    std::getline(fields, overflow, ',');
    std::getline(fields, grad, ',');
    std::getline(fields, scale, ',');
    std::getline(fields, tracker, ',');
    std::getline(fields, weight, ',');
    rows.push_back({overflow == "1", std::stod(grad), std::stod(scale), std::stoi(tracker), std::stod(weight)});
  }
  return rows;
}

/// Replays a golden trajectory of torch.amp.GradScaler (tests/golden/generate_grad_scaler_golden.py, PyTorch 2.11)
/// through `scaler`: the same scripted finite and non-finite gradients, step for step; the scale, the growth tracker,
/// and the weight after each (possibly skipped) SGD step must be identical. Returns the number of skipped steps.
int replay(const std::vector<GoldenRow>& rows, amp::GradScaler& scaler) {
  auto weight = torch::ones({1}).requires_grad_(true);
  torch::optim::SGD optimizer({weight}, torch::optim::SGDOptions(0.125));
  int skipped = 0;
  for (size_t i = 0; i < rows.size(); ++i) {
    const auto& row = rows[i];
    scaler.scale(torch::zeros({}));
    const double scale_before = scaler.get_scale();
    const float g = row.overflow ? std::numeric_limits<float>::infinity() : static_cast<float>(row.grad);
    weight.mutable_grad() = torch::tensor({g}) * scale_before;
    skipped += scaler.step(optimizer) ? 0 : 1;
    scaler.update();
    EXPECT_EQ(scaler.get_scale(), row.scale_after) << "step " << i;
    const amp::ScalerDiagnostics d = scaler.loss_scaler()->diagnostics_now();
    EXPECT_EQ(d.scale, row.scale_after) << "step " << i;
    EXPECT_EQ(scaler.loss_scaler()->growth_tracker().item<int>(), row.growth_tracker_after) << "step " << i;
    EXPECT_EQ(d.growth_tracker, row.growth_tracker_after) << "step " << i;
    EXPECT_EQ(weight.item<float>(), static_cast<float>(row.weight_after)) << "step " << i;
    if (::testing::Test::HasFailure()) break;  // one step's report is enough
  }
  EXPECT_EQ(scaler.loss_scaler()->diagnostics_now().skipped_steps, skipped);
  return skipped;
}

// Default options (no floor, no ceiling, as torch.amp) over 300 steps with random overflows.
TEST(GradScalerTest, TrajectoryEqualsPyTorchGradScalerStepForStep) {
  const auto rows = read_golden(std::string(LTA_GOLDEN_DIR) + "/grad_scaler_trajectory.csv");
  ASSERT_EQ(rows.size(), 300u);
  amp::GradScaler scaler(amp::GradScalerOptions().init_scale(1024.0).growth_interval(5));
  EXPECT_GT(replay(rows, scaler), 20) << "the script should exercise skipping";
}

// With its default options the scale follows torch.amp below 1 (down to 2^-37) and above 2^24 (up to 2^127, where
// the growth to inf is refused): a floor of 1 or a ceiling of 2^24 would leave the trajectory.
TEST(GradScalerTest, DefaultsFollowPyTorchBelowOneAndAboveTwoToThe24) {
  const auto rows = read_golden(std::string(LTA_GOLDEN_DIR) + "/grad_scaler_unbounded_trajectory.csv");
  ASSERT_EQ(rows.size(), 275u);
  double lowest = rows[0].scale_after, highest = rows[0].scale_after;
  for (const auto& row : rows) {
    lowest = std::min(lowest, row.scale_after);
    highest = std::max(highest, row.scale_after);
  }
  ASSERT_LT(lowest, 1.0) << "the golden trajectory must go below the old floor";
  ASSERT_GT(highest, 16777216.0) << "the golden trajectory must go above the old ceiling";
  amp::GradScaler scaler(amp::GradScalerOptions().init_scale(8.0).growth_interval(1));
  replay(rows, scaler);
}

// The floor and the ceiling stay available as options.
TEST(GradScalerTest, FloorAndCeilingAreOptions) {
  amp::GradScaler scaler(amp::GradScalerOptions().init_scale(2.0).growth_interval(1).min_scale(1.0).max_scale(8.0));
  auto w = torch::ones({1}).requires_grad_(true);
  torch::optim::SGD optimizer({w}, 0.1);
  auto run = [&](bool overflow, int steps) {
    for (int i = 0; i < steps; ++i) {
      scaler.scale(torch::zeros({}));
      w.mutable_grad() = torch::full({1}, overflow ? std::numeric_limits<float>::infinity() : 1.0f);
      scaler.step(optimizer);
      scaler.update();
    }
  };
  run(true, 5);
  EXPECT_EQ(scaler.get_scale(), 1.0) << "held at the floor";
  run(false, 10);
  EXPECT_EQ(scaler.get_scale(), 8.0) << "held at the ceiling";
}

TEST(GradScalerTest, SkippedStepLeavesParamsAndOptimizerStateBitIdentical) {
  torch::manual_seed(static_cast<uint64_t>(test_util::fresh_seed()));
  auto w = torch::randn({16}).requires_grad_(true);
  torch::optim::Adam optimizer({w}, torch::optim::AdamOptions(1e-2));
  amp::GradScaler scaler;
  scaler.scale(torch::zeros({}));
  w.mutable_grad() = torch::randn({16}) * scaler.get_scale();
  ASSERT_TRUE(scaler.step(optimizer));
  scaler.update();
  const auto w_before = w.detach().clone();
  auto& state = static_cast<torch::optim::AdamParamState&>(*optimizer.state().begin()->second);
  const auto exp_avg_before = state.exp_avg().clone();
  const auto step_before = state.step();
  auto grad = torch::randn({16}) * scaler.get_scale();
  grad[3] = std::numeric_limits<float>::quiet_NaN();
  w.mutable_grad() = grad;
  EXPECT_FALSE(scaler.step(optimizer));
  scaler.update();
  EXPECT_TRUE(torch::equal(w.detach(), w_before));
  EXPECT_TRUE(torch::equal(state.exp_avg(), exp_avg_before));
  EXPECT_EQ(state.step(), step_before);
  EXPECT_EQ(scaler.get_scale(), 32768.0);
}

TEST(GradScalerTest, UnscaleTwiceOrStepTwiceIsAnError) {
  auto w = torch::ones({2}).requires_grad_(true);
  torch::optim::SGD optimizer({w}, 0.1);
  amp::GradScaler scaler;
  scaler.scale(torch::zeros({}));
  w.mutable_grad() = torch::ones({2});
  scaler.unscale_(optimizer);
  EXPECT_THROW(scaler.unscale_(optimizer), c10::Error);
  scaler.step(optimizer);
  EXPECT_THROW(scaler.step(optimizer), c10::Error);
  scaler.update();
  EXPECT_NO_THROW(scaler.unscale_(optimizer));
}

TEST(GradScalerTest, DisabledScalerIsTransparent) {
  auto w = torch::ones({2}).requires_grad_(true);
  torch::optim::SGD optimizer({w}, 1.0);
  amp::GradScaler scaler(amp::GradScalerOptions().enabled(false));
  auto loss = (w * 3).sum();
  EXPECT_TRUE(torch::equal(scaler.scale(loss), loss));
  scaler.scale(loss).backward();
  EXPECT_TRUE(scaler.step(optimizer));
  scaler.update();
  EXPECT_TRUE(torch::allclose(w, torch::full({2}, -2.0)));
  EXPECT_EQ(scaler.get_scale(), 1.0);
}

TEST(GradScalerTest, SaveLoadResumesTheSameScale) {
  amp::GradScaler a(amp::GradScalerOptions().init_scale(256.0).growth_interval(2), torch::kCPU);
  auto w = torch::ones({1}).requires_grad_(true);
  torch::optim::SGD optimizer({w}, 0.1);
  for (int i = 0; i < 3; ++i) {
    a.scale(torch::zeros({}));
    w.mutable_grad() = torch::ones({1});
    a.step(optimizer);
    a.update();
  }
  torch::serialize::OutputArchive out;
  a.save(out);
  std::stringstream buffer;
  out.save_to(buffer);
  amp::GradScaler b(amp::GradScalerOptions().init_scale(256.0).growth_interval(2), torch::kCPU);
  torch::serialize::InputArchive in;
  in.load_from(buffer);
  b.load(in);
  EXPECT_EQ(b.get_scale(), a.get_scale());
  EXPECT_EQ(b.get_scale(), 512.0);
  amp::GradScaler other(amp::GradScalerOptions().init_scale(256.0).growth_interval(3), torch::kCPU);
  torch::serialize::InputArchive in2;
  buffer.seekg(0);
  in2.load_from(buffer);
  EXPECT_THROW(other.load(in2), c10::Error);
  EXPECT_EQ(other.get_scale(), 256.0) << "a refused checkpoint changes nothing";
}

TEST(GradScalerTest, BadOptionsAreNamed) {
  try {
    amp::GradScaler scaler(amp::GradScalerOptions().backoff_factor(2.0));
    ADD_FAILURE() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("backoff_factor must be in (0, 1), got 2"), std::string::npos) << e.what();
  }
  EXPECT_THROW(amp::GradScaler(amp::GradScalerOptions().min_scale(1.0).init_scale(0.5)), c10::Error);
  EXPECT_THROW(amp::GradScaler(amp::GradScalerOptions().min_scale(-1.0)), c10::Error);
  EXPECT_NO_THROW(amp::GradScaler(amp::GradScalerOptions().init_scale(0.5))) << "no floor by default";
}

}  // namespace
