#include <kernels/multi_tensor/loss_scale.h>

#include <limits>
#include <random>
#include <vector>

#include <ATen/ops/_amp_update_scale.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "test_util.h"

namespace {

constexpr double kNoCeiling = std::numeric_limits<double>::infinity();
constexpr double kTinyFloor = 1e-30;

struct ScaleState {
  ScaleState(const torch::Device& device, float init_scale, int32_t hysteresis)
      : scale(torch::full({1}, init_scale, torch::TensorOptions().device(device))),
        growth_tracker(torch::zeros({1}, torch::TensorOptions().dtype(torch::kInt).device(device))),
        hysteresis_tracker(torch::full({1}, hysteresis, torch::TensorOptions().dtype(torch::kInt).device(device))),
        found_inf(torch::zeros({1}, torch::TensorOptions().device(device))) {}
  void step(bool overflow, double growth, double backoff, int64_t interval, int64_t hysteresis, double min_scale,
            double max_scale) {
    found_inf.fill_(overflow ? 1.0f : 0.0f);
    kernels::update_scale_(scale, growth_tracker, hysteresis_tracker, found_inf, growth, backoff, interval, hysteresis,
                           min_scale, max_scale);
  }
  float value() const { return scale.item<float>(); }
  torch::Tensor scale, growth_tracker, hysteresis_tracker, found_inf;
};

std::vector<bool> random_overflows(int n, double p) {
  std::mt19937 rng(static_cast<uint32_t>(test_util::fresh_seed()));
  std::bernoulli_distribution overflow(p);
  std::vector<bool> flags;
  for (int i = 0; i < n; ++i) flags.push_back(overflow(rng));
  return flags;
}

// Hysteresis 1, no floor in reach, no ceiling: the trajectory is ATen's _amp_update_scale_, bit for bit.
TEST(UpdateScaleTest, HysteresisOneReproducesAtenUpdateScale) {
  ScaleState ours(torch::kCPU, 65536.0f, 1);
  auto aten_scale = torch::full({1}, 65536.0f);
  auto aten_tracker = torch::zeros({1}, torch::kInt);
  for (bool overflow : random_overflows(400, 0.2)) {
    ours.step(overflow, 2.0, 0.5, 3, 1, kTinyFloor, kNoCeiling);
    at::_amp_update_scale_(aten_scale, aten_tracker, torch::full({1}, overflow ? 1.0f : 0.0f), 2.0, 0.5, 3);
    ASSERT_EQ(ours.value(), aten_scale.item<float>());
    ASSERT_EQ(ours.growth_tracker.item<int32_t>(), aten_tracker.item<int32_t>());
  }
}

TEST(UpdateScaleTest, HysteresisTwoToleratesOneOverflowThenBacksOff) {
  ScaleState s(torch::kCPU, 1024.0f, 2);
  s.step(true, 2.0, 0.5, 100, 2, 1.0, kNoCeiling);
  EXPECT_EQ(s.value(), 1024.0f) << "the first overflow is tolerated";
  s.step(false, 2.0, 0.5, 100, 2, 1.0, kNoCeiling);
  s.step(true, 2.0, 0.5, 100, 2, 1.0, kNoCeiling);
  EXPECT_EQ(s.value(), 512.0f) << "the second overflow backs off (a clean step does not refill hysteresis)";
  s.step(true, 2.0, 0.5, 100, 2, 1.0, kNoCeiling);
  EXPECT_EQ(s.value(), 256.0f) << "and so does every further one until the scale grows";
  s.step(false, 2.0, 0.5, 1, 2, 1.0, kNoCeiling);  // interval 1: grows now and refills hysteresis
  EXPECT_EQ(s.value(), 512.0f);
  s.step(true, 2.0, 0.5, 100, 2, 1.0, kNoCeiling);
  EXPECT_EQ(s.value(), 512.0f) << "hysteresis was refilled by the growth";
}

TEST(UpdateScaleTest, NeverBelowFloorNorAboveCeiling) {
  ScaleState s(torch::kCPU, 8.0f, 1);
  for (int i = 0; i < 200; ++i) s.step(true, 2.0, 0.5, 1, 1, 1.0, 64.0);
  EXPECT_EQ(s.value(), 1.0f);
  for (int i = 0; i < 200; ++i) s.step(false, 2.0, 0.5, 1, 1, 1.0, 64.0);
  EXPECT_EQ(s.value(), 64.0f);
}

TEST(UpdateScaleTest, NonFiniteGrowthIsRefused) {
  ScaleState s(torch::kCPU, 3.0e38f, 1);
  s.step(false, 2.0, 0.5, 1, 1, 1.0, kNoCeiling);
  EXPECT_EQ(s.value(), 3.0e38f);
  EXPECT_EQ(s.growth_tracker.item<int32_t>(), 0);
}

TEST(UpdateScaleTest, CorruptScaleIsResetToFloor) {
  ScaleState s(torch::kCPU, std::numeric_limits<float>::quiet_NaN(), 1);
  s.step(false, 2.0, 0.5, 100, 1, 4.0, kNoCeiling);
  EXPECT_EQ(s.value(), 4.0f);
}

TEST(UpdateScaleTest, CudaTrajectoryMatchesCpu) {
  LTA_REQUIRE_CUDA();
  ScaleState cpu(torch::kCPU, 65536.0f, 2), gpu(torch::kCUDA, 65536.0f, 2);
  for (bool overflow : random_overflows(300, 0.3)) {
    cpu.step(overflow, 2.0, 0.5, 4, 2, 1.0, 1e9);
    gpu.step(overflow, 2.0, 0.5, 4, 2, 1.0, 1e9);
    ASSERT_EQ(cpu.value(), gpu.value());
    ASSERT_EQ(cpu.hysteresis_tracker.item<int32_t>(), gpu.hysteresis_tracker.item<int32_t>());
  }
}

using test_util::expect_error;

TEST(UpdateScaleTest, BadOptionsAreNamed) {
  ScaleState s(torch::kCPU, 1.0f, 1);
  auto call = [&](double growth, double backoff, int64_t interval, int64_t hysteresis, double lo, double hi) {
    return [=, &s] {
      kernels::update_scale_(s.scale, s.growth_tracker, s.hysteresis_tracker, s.found_inf, growth, backoff, interval,
                             hysteresis, lo, hi);
    };
  };
  expect_error(call(1.0, 0.5, 10, 1, 1, 2), "growth_factor must be finite and > 1, got 1");
  expect_error(call(2.0, 1.5, 10, 1, 1, 2), "backoff_factor must be in (0, 1), got 1.5");
  expect_error(call(2.0, 0.5, 0, 1, 1, 2), "growth_interval must be in [1, 2147483647] steps, got 0");
  expect_error(call(2.0, 0.5, 10, 0, 1, 2), "hysteresis must be in [1, 2147483647], got 0");
  expect_error(call(2.0, 0.5, 10, 1, -1, 2), "min_scale must be finite and >= 0, got -1");
  expect_error(call(2.0, 0.5, 10, 1, 4, 2), "max_scale must be >= min_scale, got max_scale 2 and min_scale 4");
  expect_error(
      [&] {
        kernels::update_scale_(s.scale, torch::zeros({1}), s.hysteresis_tracker, s.found_inf, 2.0, 0.5, 10, 1, 1, 2);
      },
      "growth_tracker must be a 1-element Int tensor on cpu, got 1 element(s) of Float");
}

}  // namespace
