#include <kernels/multi_tensor/multi_tensor_scale.h>

#include <limits>
#include <vector>

#include <ATen/Version.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <kernels/cpu/capability.h>

#include "test_util.h"

namespace {

// Sizes that exercise the chunking: empty, single element, odd, and one chunk (65536) plus or minus one.
const std::vector<int64_t> kSizes = {0, 1, 7, 1001, 65535, 65536, 65537, 3 * 65536 + 5};

template <typename T>
class MultiTensorScaleTest : public ::testing::Test {
 protected:
  static torch::ScalarType dtype() { return c10::CppTypeToScalarType<T>::value; }

  std::vector<torch::Tensor> random_list(const std::vector<int64_t>& sizes, const torch::Device& device) {
    std::vector<torch::Tensor> list;
    for (int64_t n : sizes) list.push_back(torch::randn({n}, gen_).to(dtype()).to(device));
    return list;
  }
  torch::Generator gen_ = at::make_generator<at::CPUGeneratorImpl>(test_util::fresh_seed());
};

using Dtypes = ::testing::Types<float, c10::Half, c10::BFloat16>;
TYPED_TEST_SUITE(MultiTensorScaleTest, Dtypes);

// The fp64 reference: the scaling done in double, then rounded once to the storage dtype.
std::vector<torch::Tensor> reference(const std::vector<torch::Tensor>& inputs, double scale) {
  std::vector<torch::Tensor> out;
  for (const auto& t : inputs) out.push_back((t.cpu().to(torch::kFloat64) * scale).to(t.scalar_type()));
  return out;
}

void expect_close(const std::vector<torch::Tensor>& actual, const std::vector<torch::Tensor>& expected) {
  ASSERT_EQ(actual.size(), expected.size());
  for (size_t i = 0; i < actual.size(); ++i) {
    const double rtol = test_util::rtol_for(actual[i].scalar_type());
    EXPECT_TRUE(torch::allclose(actual[i].cpu().to(torch::kFloat64), expected[i].to(torch::kFloat64), rtol, 0.0))
        << "tensor " << i << " of " << actual[i].numel() << " elements, dtype " << actual[i].scalar_type();
  }
}

TYPED_TEST(MultiTensorScaleTest, CpuMatchesFp64ReferenceAcrossChunkBoundaries) {
  auto list = this->random_list(kSizes, torch::kCPU);
  const auto expected = reference(list, 0.37);
  kernels::multi_tensor_scale_(list, 0.37);
  expect_close(list, expected);
}

TYPED_TEST(MultiTensorScaleTest, CpuHandlesMisalignedViews) {
  // A view one element into its storage is contiguous but not 16-byte aligned.
  auto base = torch::randn({65536 + 9}, this->gen_).to(this->dtype());
  std::vector<torch::Tensor> list = {base.slice(0, 1, 65536 + 2), base.slice(0, 65536 + 3, 65536 + 8)};
  ASSERT_NE(reinterpret_cast<uintptr_t>(list[0].data_ptr()) % 16, 0u);
  const auto expected = reference(list, -3.0);
  const auto untouched = base.slice(0, 0, 1).clone();
  kernels::multi_tensor_scale_(list, -3.0);
  expect_close(list, expected);
  EXPECT_TRUE(torch::equal(base.slice(0, 0, 1), untouched)) << "an element outside the views was written";
}

TYPED_TEST(MultiTensorScaleTest, CpuHandlesThousandsOfTinyTensors) {
  std::vector<int64_t> sizes;
  for (int i = 0; i < 3000; ++i) sizes.push_back(1 + (i * 37) % 64);
  auto list = this->random_list(sizes, torch::kCPU);
  const auto expected = reference(list, 1.0 / 1024);
  kernels::multi_tensor_scale_(list, 1.0 / 1024);
  expect_close(list, expected);
}

TYPED_TEST(MultiTensorScaleTest, CudaMatchesCpuTwin) {
  LTA_REQUIRE_CUDA();
  std::vector<int64_t> sizes = kSizes;
  for (int i = 0; i < 2500; ++i) sizes.push_back(1 + (i * 37) % 64);  // more tensors than one launch holds
  auto cpu = this->random_list(sizes, torch::kCPU);
  std::vector<torch::Tensor> gpu;
  for (const auto& t : cpu) gpu.push_back(t.cuda());
  // A misaligned view on the GPU too.
  auto base = torch::randn({1027}, this->gen_).to(this->dtype());
  cpu.push_back(base.slice(0, 3).clone());
  gpu.push_back(base.cuda().slice(0, 3));
  kernels::multi_tensor_scale_(cpu, 65536.0);
  kernels::multi_tensor_scale_(gpu, 65536.0);
  for (size_t i = 0; i < cpu.size(); ++i) {
    ASSERT_TRUE(torch::equal(gpu[i].cpu(), cpu[i])) << "tensor " << i << " differs between CUDA and CPU";
  }
}

TEST(MultiTensorScaleTest, MixedDtypesAreGroupedAndAllScaled) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(test_util::fresh_seed());
  std::vector<torch::Tensor> list = {torch::randn({100}, gen), torch::randn({33}, gen).to(torch::kHalf),
                                     torch::randn({5}, gen).to(torch::kBFloat16), torch::randn({7}, gen)};
  const auto expected = reference(list, 2.5);
  kernels::multi_tensor_scale_(list, 2.5);
  expect_close(list, expected);
}

TEST(MultiTensorScaleTest, NonFiniteValuesPropagate) {
  std::vector<torch::Tensor> list = {torch::tensor({1.0f, std::numeric_limits<float>::infinity(), NAN})};
  kernels::multi_tensor_scale_(list, -2.0);
  EXPECT_EQ(list[0][0].item<float>(), -2.0f);
  EXPECT_TRUE(std::isinf(list[0][1].item<float>()) && list[0][1].item<float>() < 0);
  EXPECT_TRUE(std::isnan(list[0][2].item<float>()));
}

TEST(MultiTensorScaleTest, EmptyListIsANoOp) {
  std::vector<torch::Tensor> list;
  EXPECT_NO_THROW(kernels::multi_tensor_scale_(list, 2.0));
}

// Bad input: each error names the argument, the index and the offending value.
void expect_error(std::vector<torch::Tensor> list, const std::string& fragment) {
  try {
    kernels::multi_tensor_scale_(list, 2.0);
    ADD_FAILURE() << "expected an error containing: " << fragment;
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
  }
}

TEST(MultiTensorScaleTest, RejectsIntegerDtypeNamingIndexAndDtype) {
  expect_error({torch::ones({3}), torch::ones({3}, torch::kInt32)},
               "tensors[1] must be float32, float16 or bfloat16, got Int");
}

TEST(MultiTensorScaleTest, RejectsNonContiguousNamingIndexAndStrides) {
  auto t = torch::ones({4, 4}).t();
  expect_error({torch::ones({2}), torch::ones({2}), t},
               "tensors[2] must be contiguous, got sizes [4, 4] strides [1, 4]");
}

TEST(MultiTensorScaleTest, RejectsUndefinedTensor) {
  expect_error({torch::ones({2}), torch::Tensor()}, "tensors[1] is an undefined tensor");
}

TEST(MultiTensorScaleTest, RejectsMixedDevices) {
  LTA_REQUIRE_CUDA();
  expect_error({torch::ones({2}), torch::ones({2}, torch::kCUDA)}, "tensors[1] is on cuda:0 but the call runs on cpu");
}

}  // namespace

namespace {

// The CPU twins run the instruction set ATen itself chose (ATEN_CPU_CAPABILITY overrides both alike);
// ctest runs this binary once more under each capability, so every variant is checked on machines that have it.
TEST(CpuCapabilityTest, FollowsAtensChoice) {
  const std::string aten = at::get_cpu_capability();
  const std::string ours = kernels::cpu::capability_name(kernels::cpu::capability());
  if (aten == "AVX512" || aten == "AVX2") {
    EXPECT_EQ(ours, aten);
  } else {
    EXPECT_EQ(ours, "DEFAULT") << "ATen capability " << aten;
  }
}

}  // namespace
