#include <amp/options.h>

#include <string>

#include <gtest/gtest.h>
#include <torch/torch.h>

namespace {

using amp::Options;
using amp::OptLevel;

// Each level resolves to Apex's table (REFERENCE.md §2).
TEST(OptionsTest, LevelsFollowApexTable) {
  const auto o0 = Options().opt_level(OptLevel::O0).resolve();
  EXPECT_EQ(o0.cast_model_type, torch::kFloat);
  EXPECT_FALSE(o0.autocast);
  EXPECT_FALSE(o0.master_weights);
  EXPECT_FALSE(o0.dynamic_loss_scale);
  EXPECT_EQ(o0.static_loss_scale, 1.0);

  const auto o1 = Options().opt_level(OptLevel::O1).resolve();
  EXPECT_EQ(o1.cast_model_type, torch::kFloat);
  EXPECT_TRUE(o1.autocast);
  EXPECT_FALSE(o1.master_weights);
  EXPECT_TRUE(o1.dynamic_loss_scale);

  const auto o2 = Options().opt_level(OptLevel::O2).resolve();
  EXPECT_EQ(o2.cast_model_type, torch::kHalf);
  EXPECT_FALSE(o2.autocast);
  EXPECT_TRUE(o2.keep_batchnorm_fp32);
  EXPECT_TRUE(o2.master_weights);
  EXPECT_TRUE(o2.dynamic_loss_scale);
  EXPECT_EQ(o2.init_scale, 65536.0);
  EXPECT_EQ(o2.growth_interval, 2000);
  EXPECT_EQ(o2.min_loss_scale, 1.0);

  const auto o3 = Options().opt_level(OptLevel::O3).resolve();
  EXPECT_EQ(o3.cast_model_type, torch::kHalf);
  EXPECT_FALSE(o3.keep_batchnorm_fp32);
  EXPECT_FALSE(o3.master_weights);
  EXPECT_FALSE(o3.dynamic_loss_scale);
}

TEST(OptionsTest, Bf16DefaultsToNoScalingButCanAskForIt) {
  const auto r = Options().opt_level(OptLevel::O2).half_dtype(torch::kBFloat16).resolve();
  EXPECT_EQ(r.cast_model_type, torch::kBFloat16);
  EXPECT_FALSE(r.dynamic_loss_scale);
  EXPECT_EQ(r.static_loss_scale, 1.0);
  EXPECT_TRUE(
      Options().opt_level(OptLevel::O2).half_dtype(torch::kBFloat16).dynamic_loss_scale().resolve().dynamic_loss_scale);
}

TEST(OptionsTest, OverridesWin) {
  const auto r = Options()
                     .opt_level(OptLevel::O2)
                     .keep_batchnorm_fp32(false)
                     .master_weights(false)
                     .loss_scale(128.0)
                     .num_losses(3)
                     .resolve();
  EXPECT_FALSE(r.keep_batchnorm_fp32);
  EXPECT_FALSE(r.master_weights);
  EXPECT_FALSE(r.dynamic_loss_scale);
  EXPECT_EQ(r.static_loss_scale, 128.0);
  EXPECT_EQ(r.num_losses, 3);
  const auto d = Options().opt_level(OptLevel::O1).hysteresis(2).min_loss_scale(4).max_loss_scale(1 << 20).resolve();
  EXPECT_EQ(d.hysteresis, 2);
  EXPECT_EQ(d.min_loss_scale, 4.0);
}

void expect_error(const Options& options, const std::string& fragment) {
  try {
    options.resolve();
    ADD_FAILURE() << "expected an error containing: " << fragment;
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
  }
}

TEST(OptionsTest, ContradictionsNameBothSettings) {
  expect_error(Options().opt_level(OptLevel::O1).master_weights(true),
               "master_weights=true disagrees with cast_model_type Float");
  expect_error(Options().opt_level(OptLevel::O1).keep_batchnorm_fp32(true),
               "keep_batchnorm_fp32=true disagrees with cast_model_type Float");
  expect_error(Options().opt_level(OptLevel::O2).half_dtype(torch::kBFloat16).cast_model_type(torch::kHalf),
               "cast_model_type Half disagrees with half_dtype BFloat16");
  expect_error(Options().opt_level(OptLevel::O1).min_loss_scale(8).max_loss_scale(4),
               "max_loss_scale 4 disagrees with min_loss_scale 8");
  expect_error(Options().opt_level(OptLevel::O3).growth_interval(10),
               "growth_interval applies to dynamic loss scaling, but the loss scale is static (1) for O3");
  expect_error(Options().opt_level(OptLevel::O1).loss_scale(-1), "loss_scale must be finite and > 0, got -1");
  expect_error(Options().half_dtype(torch::kFloat), "half_dtype must be Half or BFloat16, got Float");
  expect_error(Options().num_losses(0), "num_losses must be >= 1, got 0");
}

TEST(OptionsTest, ParsesLevelNames) {
  EXPECT_EQ(amp::parse_opt_level("O2"), OptLevel::O2);
  EXPECT_EQ(amp::parse_opt_level("o3"), OptLevel::O3);
  try {
    amp::parse_opt_level("O5");
    ADD_FAILURE();
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("unknown opt level 'O5'"), std::string::npos);
  }
}

TEST(OptionsTest, EqualityComparesResolvedPolicies) {
  EXPECT_TRUE(Options().opt_level(OptLevel::O2) == Options().opt_level(OptLevel::O2).master_weights(true));
  EXPECT_FALSE(Options().opt_level(OptLevel::O2) == Options().opt_level(OptLevel::O2).hysteresis(2));
}

}  // namespace
