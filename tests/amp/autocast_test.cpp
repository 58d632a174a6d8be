#include <amp/autocast.h>

#include <ATen/autocast_mode.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "test_util.h"

namespace {

TEST(AutocastScopeTest, CpuMatmulRunsInBf16InsideAndFp32Outside) {
  auto a = torch::randn({8, 8});
  auto b = torch::randn({8, 8});
  {
    amp::AutocastScope scope(torch::kCPU, torch::kBFloat16);
    EXPECT_EQ(torch::mm(a, b).scalar_type(), torch::kBFloat16);
  }
  EXPECT_EQ(torch::mm(a, b).scalar_type(), torch::kFloat32);
}

TEST(AutocastScopeTest, RestoresEnabledDtypeAndCacheFlagWhenNested) {
  ASSERT_FALSE(at::autocast::is_autocast_enabled(torch::kCPU));
  const auto dtype_before = at::autocast::get_autocast_dtype(torch::kCPU);
  {
    amp::AutocastScope outer(torch::kCPU, torch::kBFloat16, /*enabled=*/true, /*cache_enabled=*/true);
    {
      amp::AutocastScope inner(torch::kCPU, torch::kHalf, /*enabled=*/false, /*cache_enabled=*/false);
      EXPECT_FALSE(at::autocast::is_autocast_enabled(torch::kCPU));
      EXPECT_EQ(at::autocast::get_autocast_dtype(torch::kCPU), torch::kHalf);
      EXPECT_FALSE(at::autocast::is_autocast_cache_enabled());
      EXPECT_EQ(torch::mm(torch::ones({2, 2}), torch::ones({2, 2})).scalar_type(), torch::kFloat32);
    }
    EXPECT_TRUE(at::autocast::is_autocast_enabled(torch::kCPU));
    EXPECT_EQ(at::autocast::get_autocast_dtype(torch::kCPU), torch::kBFloat16);
    EXPECT_TRUE(at::autocast::is_autocast_cache_enabled());
  }
  EXPECT_FALSE(at::autocast::is_autocast_enabled(torch::kCPU));
  EXPECT_EQ(at::autocast::get_autocast_dtype(torch::kCPU), dtype_before);
}

// Without clearing the cast cache when the outermost scope closes, the bf16 copy of a weight cached in one
// iteration would be reused after the weight changed (see Note [autocast cache]).
TEST(AutocastScopeTest, OutermostExitClearsCastCacheSoUpdatedWeightsAreSeen) {
  auto weight = torch::ones({4, 4}).requires_grad_(true);
  auto x = torch::ones({1, 4});
  torch::Tensor first, second;
  {
    amp::AutocastScope scope(torch::kCPU, torch::kBFloat16);
    first = torch::mm(x, weight);
  }
  {
    torch::NoGradGuard no_grad;
    weight.mul_(2.0);  // what optimizer.step() does
  }
  {
    amp::AutocastScope scope(torch::kCPU, torch::kBFloat16);
    second = torch::mm(x, weight);
  }
  EXPECT_TRUE(torch::equal(second.to(torch::kFloat32), 2 * first.to(torch::kFloat32)));
}

TEST(AutocastScopeTest, CudaMatmulRunsInFp16) {
  LTA_REQUIRE_CUDA();
  auto a = torch::randn({8, 8}, torch::kCUDA);
  amp::AutocastScope scope(torch::kCUDA, amp::default_autocast_dtype(torch::kCUDA));
  EXPECT_EQ(torch::mm(a, a).scalar_type(), torch::kHalf);
}

TEST(AutocastScopeTest, RejectsNonHalfDtypeNamingIt) {
  try {
    amp::AutocastScope scope(torch::kCPU, torch::kFloat64);
    ADD_FAILURE() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("dtype must be Half or BFloat16, got Double"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(at::autocast::is_autocast_enabled(torch::kCPU)) << "a failed scope must leave the state untouched";
}

TEST(AutocastScopeTest, RejectsUnsupportedDeviceType) {
  EXPECT_THROW(amp::AutocastScope(torch::kMeta, torch::kHalf), c10::Error);
}

TEST(AutocastScopeTest, DefaultDtypesFollowPyTorch) {
  EXPECT_EQ(amp::default_autocast_dtype(torch::kCUDA), torch::kHalf);
  EXPECT_EQ(amp::default_autocast_dtype(torch::kCPU), torch::kBFloat16);
}

}  // namespace
