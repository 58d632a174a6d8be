#include <kernels/multi_tensor/unscale.h>

#include <limits>
#include <vector>

#include <ATen/ops/_amp_foreach_non_finite_check_and_unscale.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <kernels/pointer_lists.h>

#include "test_util.h"

namespace {

constexpr int64_t kChunk = 65536;
const std::vector<int64_t> kSizes = {0, 1, 7, 1001, kChunk - 1, kChunk, kChunk + 1, 3 * kChunk + 5};
constexpr float kInf = std::numeric_limits<float>::infinity();

struct ScalerState {
  explicit ScalerState(const torch::Device& device, float scale = 65536.0f)
      : inv_scale(torch::full({1}, 1.0f / scale, torch::TensorOptions().device(device))),
        found_inf(torch::zeros({1}, torch::TensorOptions().device(device))),
        first_index(
            torch::full({1}, kernels::kNoNonFiniteIndex, torch::TensorOptions().dtype(torch::kInt).device(device))) {}
  float found() const { return found_inf.item<float>(); }
  int32_t first() const { return first_index.item<int32_t>(); }
  torch::Tensor inv_scale, found_inf, first_index;
};

template <typename T>
class UnscaleTest : public ::testing::Test {
 protected:
  static torch::ScalarType dtype() { return c10::CppTypeToScalarType<T>::value; }
  std::vector<torch::Tensor> random_list(const std::vector<int64_t>& sizes, double magnitude = 1000.0) {
    std::vector<torch::Tensor> list;
    for (int64_t n : sizes) list.push_back((torch::randn({n}, gen_) * magnitude).to(dtype()));
    return list;
  }
  torch::Generator gen_ = at::make_generator<at::CPUGeneratorImpl>(test_util::fresh_seed());
};

using Dtypes = ::testing::Types<float, c10::Half, c10::BFloat16>;
TYPED_TEST_SUITE(UnscaleTest, Dtypes);

TYPED_TEST(UnscaleTest, CpuMatchesFp64ReferenceAndReportsClean) {
  auto grads = this->random_list(kSizes);
  std::vector<torch::Tensor> expected;
  for (const auto& g : grads) expected.push_back((g.to(torch::kFloat64) / 65536.0).to(g.scalar_type()));
  ScalerState state(torch::kCPU);
  kernels::unscale_and_check_(grads, state.inv_scale, state.found_inf, state.first_index);
  for (size_t i = 0; i < grads.size(); ++i) {
    EXPECT_TRUE(torch::allclose(grads[i].to(torch::kFloat64), expected[i].to(torch::kFloat64),
                                test_util::rtol_for(this->dtype()), 0.0))
        << "tensor " << i;
  }
  EXPECT_EQ(state.found(), 0.0f);
  EXPECT_EQ(state.first(), kernels::kNoNonFiniteIndex);
}

TYPED_TEST(UnscaleTest, CpuMatchesAtenUnscaleBitForBit) {
  auto ours = this->random_list(kSizes);
  std::vector<torch::Tensor> aten;
  for (const auto& g : ours) aten.push_back(g.clone());
  ScalerState a(torch::kCPU, 1024.0f), b(torch::kCPU, 1024.0f);
  kernels::unscale_and_check_(ours, a.inv_scale, a.found_inf);
  at::_amp_foreach_non_finite_check_and_unscale_(aten, b.found_inf, b.inv_scale);
  for (size_t i = 0; i < ours.size(); ++i) EXPECT_TRUE(torch::equal(ours[i], aten[i])) << "tensor " << i;
  EXPECT_EQ(a.found(), b.found());
}

// Infs and NaNs at the first and last element of a chunk and of a tensor are all found, and the index of
// the first tensor holding one is recorded.
TYPED_TEST(UnscaleTest, PlantedNonFiniteAtChunkAndTensorEdgesIsFound) {
  const int64_t n = 3 * kChunk + 5;
  for (int64_t position : {int64_t{0}, kChunk - 1, kChunk, 2 * kChunk + 3, n - 1}) {
    for (float bad : {kInf, -kInf, std::numeric_limits<float>::quiet_NaN()}) {
      auto grads = this->random_list({17, n, 5});
      grads[1].view(-1)[position] = bad;
      ScalerState state(torch::kCPU);
      kernels::unscale_and_check_(grads, state.inv_scale, state.found_inf, state.first_index);
      EXPECT_EQ(state.found(), 1.0f) << "value " << bad << " at " << position;
      EXPECT_EQ(state.first(), 1) << "value " << bad << " at " << position;
    }
  }
}

TYPED_TEST(UnscaleTest, ResultOverflowingItsDtypeCountsAsNonFinite) {
  if (this->dtype() == torch::kFloat32) GTEST_SKIP() << "fp32 results cannot overflow a finite fp32 input times 2";
  // fp16 max is 65504; bf16's is ~3.4e38: pick a value that overflows after multiplying by 2^k.
  const double big = this->dtype() == torch::kHalf ? 60000.0 : 3.0e38;
  std::vector<torch::Tensor> grads = {torch::full({9}, big).to(this->dtype())};
  ScalerState state(torch::kCPU, 0.25f);  // inv_scale 4: a scale below 1
  kernels::unscale_and_check_(grads, state.inv_scale, state.found_inf, state.first_index);
  EXPECT_EQ(state.found(), 1.0f);
  EXPECT_EQ(state.first(), 0);
}

TYPED_TEST(UnscaleTest, ThousandsOfTinyTensorsRecordSmallestBadIndex) {
  std::vector<int64_t> sizes;
  for (int i = 0; i < 3000; ++i) sizes.push_back(1 + (i * 37) % 64);
  auto grads = this->random_list(sizes);
  grads[2500].view(-1)[0] = kInf;
  grads[1234].view(-1)[grads[1234].numel() - 1] = kInf;
  ScalerState state(torch::kCPU);
  kernels::unscale_and_check_(grads, state.inv_scale, state.found_inf, state.first_index, /*index_offset=*/10);
  EXPECT_EQ(state.found(), 1.0f);
  EXPECT_EQ(state.first(), 1244);
}

TYPED_TEST(UnscaleTest, CudaMatchesCpuTwin) {
  LTA_REQUIRE_CUDA();
  std::vector<int64_t> sizes = kSizes;
  for (int i = 0; i < 2500; ++i) sizes.push_back(1 + (i * 37) % 64);
  auto cpu = this->random_list(sizes);
  cpu[2000].view(-1)[0] = kInf;
  cpu[5].view(-1)[kChunk] = std::numeric_limits<float>::quiet_NaN();
  std::vector<torch::Tensor> gpu;
  for (const auto& t : cpu) gpu.push_back(t.cuda());
  auto base = this->random_list({1027})[0];
  cpu.push_back(base.slice(0, 3).clone());
  gpu.push_back(base.cuda().slice(0, 3));  // misaligned view
  ScalerState on_cpu(torch::kCPU), on_gpu(torch::kCUDA);
  kernels::unscale_and_check_(cpu, on_cpu.inv_scale, on_cpu.found_inf, on_cpu.first_index);
  kernels::unscale_and_check_(gpu, on_gpu.inv_scale, on_gpu.found_inf, on_gpu.first_index);
  for (size_t i = 0; i < cpu.size(); ++i) {
    ASSERT_TRUE(torch::equal(gpu[i].cpu().nan_to_num(0), cpu[i].nan_to_num(0))) << "tensor " << i;
  }
  EXPECT_EQ(on_gpu.found(), 1.0f);
  EXPECT_EQ(on_gpu.first(), 5);
  EXPECT_EQ(on_cpu.first(), 5);
}

TEST(UnscaleTest, FoundInfIsNeverClearedByACleanCall) {
  ScalerState state(torch::kCPU);
  std::vector<torch::Tensor> bad = {torch::tensor({1.0f, kInf})};
  std::vector<torch::Tensor> clean = {torch::ones({4})};
  kernels::unscale_and_check_(bad, state.inv_scale, state.found_inf, state.first_index);
  kernels::unscale_and_check_(clean, state.inv_scale, state.found_inf, state.first_index, 5);
  EXPECT_EQ(state.found(), 1.0f);
  EXPECT_EQ(state.first(), 0);
}

TEST(UnscaleTest, MixedDtypesAreAllUnscaled) {
  std::vector<torch::Tensor> grads = {torch::full({3}, 8.0f), torch::full({5}, 8.0f, torch::kHalf),
                                      torch::full({7}, 8.0f, torch::kBFloat16)};
  ScalerState state(torch::kCPU, 4.0f);
  kernels::unscale_and_check_(grads, state.inv_scale, state.found_inf);
  for (const auto& g : grads) EXPECT_TRUE(torch::all(g.to(torch::kFloat32) == 2.0f).item<bool>()) << g.scalar_type();
}

using test_util::expect_error;

TEST(UnscaleTest, BadArgumentsAreNamed) {
  std::vector<torch::Tensor> grads = {torch::ones({4})};
  ScalerState s(torch::kCPU);
  expect_error([&] { kernels::unscale_and_check_(grads, torch::ones({2}), s.found_inf); },
               "inv_scale must be a 1-element Float tensor on cpu, got 2 element(s) of Float on cpu");
  expect_error([&] { kernels::unscale_and_check_(grads, s.inv_scale, torch::zeros({1}, torch::kDouble)); },
               "found_inf must be a 1-element Float tensor on cpu, got 1 element(s) of Double");
  expect_error([&] { kernels::unscale_and_check_(grads, s.inv_scale, s.found_inf, torch::zeros({1})); },
               "first_nonfinite_index must be a 1-element Int tensor");
  expect_error([&] { kernels::unscale_and_check_(grads, s.inv_scale, s.found_inf, s.first_index, -1); },
               "index_offset must be >= 0, got -1");
  std::vector<torch::Tensor> ints = {torch::ones({4}), torch::ones({2}, torch::kLong)};
  expect_error([&] { kernels::unscale_and_check_(ints, s.inv_scale, s.found_inf); },
               "grads[1] must be float32, float16 or bfloat16, got Long");
}

TEST(UnscaleTest, FoundInfOnAnotherDeviceIsRejected) {
  LTA_REQUIRE_CUDA();
  std::vector<torch::Tensor> grads = {torch::ones({4}, torch::kCUDA)};
  ScalerState s(torch::kCUDA);
  expect_error([&] { kernels::unscale_and_check_(grads, s.inv_scale, torch::zeros({1})); },
               "found_inf must be a 1-element Float tensor on cuda:0");
}

}  // namespace

namespace {

TEST(UnscaleTest, ExplicitIndicesAreRecordedInsteadOfPositions) {
  ScalerState state(torch::kCPU);
  std::vector<torch::Tensor> grads = {torch::ones({3}), torch::tensor({1.0f, kInf}), torch::tensor({kInf})};
  kernels::unscale_and_check_(grads, state.inv_scale, state.found_inf, state.first_index,
                              std::vector<int64_t>{40, 17, 30});
  EXPECT_EQ(state.first(), 17) << "smallest recorded index among the tensors with a non-finite value";
  try {
    kernels::unscale_and_check_(grads, state.inv_scale, state.found_inf, state.first_index, std::vector<int64_t>{1, 2});
    ADD_FAILURE() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("indices has 2 entries but the list has 3 tensors"), std::string::npos);
  }
}

}  // namespace
