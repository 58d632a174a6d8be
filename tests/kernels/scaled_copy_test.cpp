#include <kernels/multi_tensor/scaled_copy.h>

#include <cmath>
#include <limits>
#include <utility>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "kernels/copy_test_util.h"
#include "test_util.h"

namespace {

using copy_test::dtype_of;
using copy_test::expect_error;
using copy_test::no_index;
using copy_test::zero_flag;

template <typename S, typename D>
struct DtypePair {
  using Src = S;
  using Dst = D;
};

template <typename P>
class ScaledCopyTest : public ::testing::Test {
 protected:
  static torch::ScalarType src_dtype() { return dtype_of<typename P::Src>(); }
  static torch::ScalarType dst_dtype() { return dtype_of<typename P::Dst>(); }

  std::vector<torch::Tensor> random_src(const std::vector<int64_t>& sizes, const torch::Device& device = torch::kCPU) {
    return copy_test::random_list(sizes, src_dtype(), gen_, device);
  }
  // Destinations start with random values too, so an element the kernel forgot to write is caught.
  std::vector<torch::Tensor> random_dst(const std::vector<int64_t>& sizes, const torch::Device& device = torch::kCPU) {
    return copy_test::random_list(sizes, dst_dtype(), gen_, device);
  }

  torch::Generator gen_ = at::make_generator<at::CPUGeneratorImpl>(test_util::fresh_seed());
};

// The conversions master weights and grads need: fp16/bf16 grads into fp32 masters, fp32 masters into
// fp16/bf16 model params, and fp32 to fp32.
using Pairs = ::testing::Types<DtypePair<c10::Half, float>, DtypePair<c10::BFloat16, float>,
                               DtypePair<float, c10::Half>, DtypePair<float, c10::BFloat16>, DtypePair<float, float>>;
TYPED_TEST_SUITE(ScaledCopyTest, Pairs);

// The fp64 reference: src * scale in double, rounded once to the destination dtype.
torch::Tensor reference(const torch::Tensor& src, double scale, torch::ScalarType dst_dtype) {
  return (src.cpu().to(torch::kFloat64) * scale).to(dst_dtype);
}

void expect_matches_reference(const std::vector<torch::Tensor>& src, const std::vector<torch::Tensor>& dst,
                              double scale) {
  ASSERT_EQ(src.size(), dst.size());
  for (size_t i = 0; i < src.size(); ++i) {
    copy_test::expect_close(dst[i], reference(src[i], scale, dst[i].scalar_type()),
                            test_util::rtol_for(dst[i].scalar_type()), "dst[" + std::to_string(i) + "]");
  }
}

TYPED_TEST(ScaledCopyTest, MatchesFp64ReferenceAcrossChunkBoundaries) {
  const auto src = this->random_src(copy_test::kSizes);
  const auto src_before = copy_test::clones(src);
  auto dst = this->random_dst(copy_test::kSizes);
  auto found_inf = zero_flag();
  auto index = no_index();
  kernels::scaled_copy_(src, dst, 0.37, found_inf, index);
  expect_matches_reference(src, dst, 0.37);
  for (size_t i = 0; i < src.size(); ++i) EXPECT_TRUE(torch::equal(src[i], src_before[i])) << "src[" << i << "]";
  EXPECT_EQ(found_inf.item<float>(), 0.0f) << "finite data must not set found_inf";
  EXPECT_EQ(index.item<int32_t>(), kernels::kNoNonFiniteIndex);
}

TYPED_TEST(ScaledCopyTest, RoundsTheFp32ProductOnce) {
  // What the CUDA kernel computes too: the fp32 product, rounded to nearest-even into dst's dtype. Bit-exact,
  // under every CPU capability, so the twins can be compared with torch::equal.
  const auto src = this->random_src({65536 + 77, 13});
  auto dst = this->random_dst({65536 + 77, 13});
  const float scale = 0.3f;
  kernels::scaled_copy_(src, dst, scale);
  for (size_t i = 0; i < src.size(); ++i) {
    EXPECT_TRUE(torch::equal(dst[i], (src[i].to(torch::kFloat) * scale).to(this->dst_dtype()))) << "dst[" << i << "]";
  }
}

TYPED_TEST(ScaledCopyTest, ReadsTheScaleFromATensor) {
  const auto src = this->random_src({1001, 65537});
  auto dst = this->random_dst({1001, 65537});
  kernels::scaled_copy_(src, dst, torch::full({1}, 1.0f / 1024));
  expect_matches_reference(src, dst, 1.0 / 1024);
  // The same tensor, changed in place, is read again by the next call (what a loss scaler relies on).
  auto scale = torch::full({1}, 3.0f);
  kernels::scaled_copy_(src, dst, scale);
  expect_matches_reference(src, dst, 3.0);
  scale.fill_(-0.5f);
  kernels::scaled_copy_(src, dst, scale);
  expect_matches_reference(src, dst, -0.5);
}

TYPED_TEST(ScaledCopyTest, HandlesMisalignedViews) {
  // A view one element into its storage is contiguous but not 16-byte aligned. Entry 0 has a misaligned
  // source, entry 1 a misaligned destination, entry 2 both.
  const int64_t n = 65536 + 9;
  auto src_base = copy_test::random_tensor(n + 1, this->src_dtype(), this->gen_);
  auto dst_base = copy_test::random_tensor(n + 1, this->dst_dtype(), this->gen_);
  auto src_small = copy_test::random_tensor(100, this->src_dtype(), this->gen_);
  auto dst_small = copy_test::random_tensor(100, this->dst_dtype(), this->gen_);
  const auto dst_first_before = dst_base.slice(0, 0, 1).clone();
  const auto dst_small_first_before = dst_small.slice(0, 0, 1).clone();
  std::vector<torch::Tensor> src = {src_base.slice(0, 1), copy_test::random_tensor(n, this->src_dtype(), this->gen_),
                                    src_small.slice(0, 1)};
  std::vector<torch::Tensor> dst = {copy_test::random_tensor(n, this->dst_dtype(), this->gen_), dst_base.slice(0, 1),
                                    dst_small.slice(0, 1)};
  ASSERT_NE(reinterpret_cast<uintptr_t>(src[0].data_ptr()) % 16, 0u);
  ASSERT_NE(reinterpret_cast<uintptr_t>(dst[1].data_ptr()) % 16, 0u);
  kernels::scaled_copy_(src, dst, -3.0);
  expect_matches_reference(src, dst, -3.0);
  EXPECT_TRUE(torch::equal(dst_base.slice(0, 0, 1), dst_first_before)) << "an element outside a view was written";
  EXPECT_TRUE(torch::equal(dst_small.slice(0, 0, 1), dst_small_first_before))
      << "an element outside a view was written";
}

TYPED_TEST(ScaledCopyTest, HandlesThousandsOfTinyTensors) {
  const auto sizes = copy_test::tiny_sizes(3000);
  const auto src = this->random_src(sizes);
  auto dst = this->random_dst(sizes);
  kernels::scaled_copy_(src, dst, 1.0 / 65536);
  expect_matches_reference(src, dst, 1.0 / 65536);
}

// Where a planted value sits: the tensor (its list position) and the element.
struct Site {
  size_t tensor;
  int64_t element;
};

// Tensor 1 spans four chunks (the last one 5 elements long); tensor 3 ends one element into its second chunk.
const std::vector<int64_t> kPlantSizes = {5, 3 * 65536 + 5, 17, 65537, 9};
const std::vector<Site> kPlantSites = {{0, 0},      {0, 4},  // first and last element of a tiny tensor
                                       {1, 0},      {1, 65535},
                                       {1, 65536},  // first element of a tensor, last and first of a chunk
                                       {1, 131071}, {1, 3 * 65536 + 4},  // last of a middle chunk, last of the tensor
                                       {3, 65535},  {3, 65536},
                                       {4, 8}};  // last of a full chunk, a 1-element chunk, the list's last element

TYPED_TEST(ScaledCopyTest, FlagsNonFiniteAtChunkAndTensorEdgesAndRecordsTheTensor) {
  const auto clean = this->random_src(kPlantSizes);
  for (const float planted : {std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                              std::numeric_limits<float>::quiet_NaN()}) {
    for (const Site& site : kPlantSites) {
      auto src = copy_test::clones(clean);
      src[site.tensor][site.element] = planted;
      auto dst = this->random_dst(kPlantSizes);
      auto found_inf = zero_flag();
      auto index = no_index();
      kernels::scaled_copy_(src, dst, 2.0, found_inf, index);
      EXPECT_EQ(found_inf.item<float>(), 1.0f)
          << planted << " at tensor " << site.tensor << " element " << site.element;
      EXPECT_EQ(index.item<int32_t>(), static_cast<int32_t>(site.tensor))
          << planted << " at tensor " << site.tensor << " element " << site.element;
    }
  }
}

TYPED_TEST(ScaledCopyTest, RecordsTheSmallestIndexPlusOffset) {
  const std::vector<int64_t> sizes = {100, 65537, 3, 70000, 8, 1};
  auto src = this->random_src(sizes);
  src[4][7] = std::numeric_limits<float>::quiet_NaN();
  src[1][65536] = std::numeric_limits<float>::infinity();
  src[3][0] = -std::numeric_limits<float>::infinity();
  auto dst = this->random_dst(sizes);
  auto found_inf = zero_flag();
  auto index = no_index();
  kernels::scaled_copy_(src, dst, 1.0, found_inf, index, /*index_offset=*/40);
  EXPECT_EQ(found_inf.item<float>(), 1.0f);
  EXPECT_EQ(index.item<int32_t>(), 41);
}

TYPED_TEST(ScaledCopyTest, FlagsAResultThatOverflows) {
  // 60000 is finite in every dtype; times 1e34 it exceeds fp32's range, so the stored result is inf. The other
  // elements are small enough (~1e-34; zero where fp16 cannot hold them) to stay finite in every dtype.
  std::vector<torch::Tensor> src;
  for (int64_t n : {33, 64}) src.push_back((torch::randn({n}, this->gen_) * 1e-34).to(this->src_dtype()));
  src[1][17] = 60000.0f;
  auto dst = this->random_dst({33, 64});
  auto found_inf = zero_flag();
  auto index = no_index();
  kernels::scaled_copy_(src, dst, 1e34, found_inf, index);
  EXPECT_EQ(found_inf.item<float>(), 1.0f);
  EXPECT_EQ(index.item<int32_t>(), 1);
  EXPECT_TRUE(std::isinf(dst[1][17].template item<float>()));
}

TYPED_TEST(ScaledCopyTest, ACleanCallNeitherClearsTheFlagNorRaisesTheIndex) {
  const std::vector<int64_t> sizes = {65537, 3, 9, 100, 2, 7};
  auto found_inf = torch::ones({1});
  auto index = torch::full({1}, 3, torch::kInt32);
  auto src = this->random_src(sizes);
  auto dst = this->random_dst(sizes);
  kernels::scaled_copy_(src, dst, 0.5, found_inf, index);
  EXPECT_EQ(found_inf.item<float>(), 1.0f) << "found_inf is the caller's to zero";
  EXPECT_EQ(index.item<int32_t>(), 3);
  src[5][0] = std::numeric_limits<float>::infinity();
  kernels::scaled_copy_(src, dst, 0.5, found_inf, index);
  EXPECT_EQ(index.item<int32_t>(), 3) << "a later, larger index must not replace a smaller one";
}

TYPED_TEST(ScaledCopyTest, RecordsTheIndexWithoutAFlag) {
  auto src = this->random_src({10, 20, 30});
  src[2][29] = std::numeric_limits<float>::quiet_NaN();
  auto dst = this->random_dst({10, 20, 30});
  auto index = no_index();
  kernels::scaled_copy_(src, dst, 1.0, /*found_inf=*/{}, index);
  EXPECT_EQ(index.item<int32_t>(), 2);
}

TYPED_TEST(ScaledCopyTest, CudaMatchesCpuTwin) {
  LTA_REQUIRE_CUDA();
  std::vector<int64_t> sizes = copy_test::kSizes;
  for (int64_t n : copy_test::tiny_sizes(2500)) sizes.push_back(n);
  auto src_cpu = this->random_src(sizes);
  auto dst_cpu = this->random_dst(sizes);
  // Misaligned views, on each side.
  auto src_base = copy_test::random_tensor(4099, this->src_dtype(), this->gen_);
  auto dst_base = copy_test::random_tensor(4099, this->dst_dtype(), this->gen_);
  src_cpu.push_back(src_base.slice(0, 3));
  dst_cpu.push_back(dst_base.slice(0, 3).clone());
  src_cpu.push_back(src_base.slice(0, 0, 4096).clone());
  dst_cpu.push_back(dst_base.slice(0, 3).clone());
  src_cpu[7][12345] = std::numeric_limits<float>::infinity();
  src_cpu[2000][0] = std::numeric_limits<float>::quiet_NaN();
  auto src_gpu = copy_test::to_device(src_cpu, torch::kCUDA);
  auto dst_gpu = copy_test::to_device(dst_cpu, torch::kCUDA);
  src_gpu[src_gpu.size() - 2] = src_base.cuda().slice(0, 3);
  dst_gpu.back() = dst_base.cuda().slice(0, 3);
  ASSERT_NE(reinterpret_cast<uintptr_t>(src_gpu[src_gpu.size() - 2].data_ptr()) % 16, 0u);
  ASSERT_NE(reinterpret_cast<uintptr_t>(dst_gpu.back().data_ptr()) % 16, 0u);
  auto found_cpu = zero_flag();
  auto index_cpu = no_index();
  auto found_gpu = zero_flag(torch::kCUDA);
  auto index_gpu = no_index(torch::kCUDA);
  kernels::scaled_copy_(src_cpu, dst_cpu, torch::full({1}, 1.0f / 3), found_cpu, index_cpu, 5);
  kernels::scaled_copy_(src_gpu, dst_gpu, torch::full({1}, 1.0f / 3, torch::kCUDA), found_gpu, index_gpu, 5);
  copy_test::expect_identical(dst_gpu, dst_cpu);
  EXPECT_EQ(found_gpu.item<float>(), 1.0f);
  EXPECT_EQ(found_cpu.item<float>(), 1.0f);
  EXPECT_EQ(index_gpu.item<int32_t>(), 7 + 5);
  EXPECT_EQ(index_cpu.item<int32_t>(), 7 + 5);
}

TEST(ScaledCopyTest, FiniteFp32OverflowingFp16IsFlagged) {
  std::vector<torch::Tensor> src = {torch::full({40}, 1.0f), torch::full({40}, 70000.0f)};
  std::vector<torch::Tensor> dst = {torch::empty({40}, torch::kHalf), torch::empty({40}, torch::kHalf)};
  auto found_inf = zero_flag();
  auto index = no_index();
  kernels::scaled_copy_(src, dst, 1.0, found_inf, index);
  EXPECT_EQ(found_inf.item<float>(), 1.0f);
  EXPECT_EQ(index.item<int32_t>(), 1);
  EXPECT_TRUE(std::isinf(dst[1][39].item<float>()));
}

TEST(ScaledCopyTest, MixedDtypePairsInOneCall) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(test_util::fresh_seed());
  const std::vector<std::pair<torch::ScalarType, torch::ScalarType>> pairs = {
      {torch::kHalf, torch::kFloat},    {torch::kFloat, torch::kBFloat16}, {torch::kBFloat16, torch::kHalf},
      {torch::kFloat, torch::kFloat},   {torch::kHalf, torch::kFloat},     {torch::kHalf, torch::kHalf},
      {torch::kBFloat16, torch::kFloat}};
  std::vector<torch::Tensor> src;
  std::vector<torch::Tensor> dst;
  for (size_t i = 0; i < pairs.size(); ++i) {
    const int64_t n = 100 + 977 * static_cast<int64_t>(i);
    src.push_back(copy_test::random_tensor(n, pairs[i].first, gen));
    dst.push_back(copy_test::random_tensor(n, pairs[i].second, gen));
  }
  src[4][50] = std::numeric_limits<float>::infinity();
  auto found_inf = zero_flag();
  auto index = no_index();
  kernels::scaled_copy_(src, dst, 0.25, found_inf, index);
  for (size_t i = 0; i < src.size(); ++i) {
    if (i == 4) continue;
    copy_test::expect_close(dst[i], reference(src[i], 0.25, dst[i].scalar_type()),
                            test_util::rtol_for(dst[i].scalar_type()), "dst[" + std::to_string(i) + "]");
  }
  EXPECT_EQ(index.item<int32_t>(), 4) << "indices are list positions, not positions within a dtype group";
}

TEST(ScaledCopyTest, InPlaceWhenDstIsSrc) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(test_util::fresh_seed());
  for (const auto dtype : {torch::kFloat, torch::kHalf, torch::kBFloat16}) {
    std::vector<torch::Tensor> list = {copy_test::random_tensor(65537, dtype, gen)};
    const auto expected = reference(list[0], -2.0, dtype);
    kernels::scaled_copy_(list, list, -2.0);
    copy_test::expect_close(list[0], expected, test_util::rtol_for(dtype), "in place");
  }
}

TEST(ScaledCopyTest, ShapesMayDifferWhenElementCountsMatch) {
  auto src = std::vector<torch::Tensor>{torch::randn({4, 6})};
  auto dst = std::vector<torch::Tensor>{torch::empty({24})};
  kernels::scaled_copy_(src, dst, 2.0);
  EXPECT_TRUE(torch::equal(dst[0], (src[0] * 2).reshape({24})));
}

TEST(ScaledCopyTest, EmptyListsAreANoOp) {
  std::vector<torch::Tensor> none;
  auto found_inf = zero_flag();
  EXPECT_NO_THROW(kernels::scaled_copy_(none, none, 2.0, found_inf));
  EXPECT_EQ(found_inf.item<float>(), 0.0f);
}

// Bad input: each error names the argument, the index and the offending value.
TEST(ScaledCopyTest, RejectsListsOfDifferentLengths) {
  std::vector<torch::Tensor> src = {torch::ones({3}), torch::ones({3})};
  std::vector<torch::Tensor> dst = {torch::ones({3})};
  expect_error([&] { kernels::scaled_copy_(src, dst, 1.0); }, "dst has 1 tensors but src has 2");
}

TEST(ScaledCopyTest, RejectsElementCountMismatchNamingIndexAndCounts) {
  std::vector<torch::Tensor> src = {torch::ones({3}), torch::ones({4})};
  std::vector<torch::Tensor> dst = {torch::ones({3}), torch::ones({5})};
  expect_error([&] { kernels::scaled_copy_(src, dst, 1.0); }, "dst[1] has 5 elements but src[1] has 4");
}

TEST(ScaledCopyTest, RejectsIntegerDtypeNamingIndexAndDtype) {
  std::vector<torch::Tensor> src = {torch::ones({3}), torch::ones({3})};
  std::vector<torch::Tensor> dst = {torch::ones({3}), torch::ones({3}, torch::kInt32)};
  expect_error([&] { kernels::scaled_copy_(src, dst, 1.0); }, "dst[1] must be float32, float16 or bfloat16, got Int");
}

TEST(ScaledCopyTest, RejectsNonContiguousNamingIndexAndStrides) {
  std::vector<torch::Tensor> src = {torch::ones({4, 4}).t()};
  std::vector<torch::Tensor> dst = {torch::ones({16})};
  expect_error([&] { kernels::scaled_copy_(src, dst, 1.0); },
               "src[0] must be contiguous, got sizes [4, 4] strides [1, 4]");
}

TEST(ScaledCopyTest, RejectsBadScalarTensors) {
  std::vector<torch::Tensor> src = {torch::ones({3})};
  std::vector<torch::Tensor> dst = {torch::ones({3})};
  expect_error([&] { kernels::scaled_copy_(src, dst, torch::ones({1}, torch::kFloat64)); },
               "scale must be a 1-element Float tensor on cpu, got 1 element(s) of Double on cpu");
  expect_error([&] { kernels::scaled_copy_(src, dst, torch::Tensor()); }, "scale is an undefined tensor");
  expect_error([&] { kernels::scaled_copy_(src, dst, 1.0, torch::zeros({2})); },
               "found_inf must be a 1-element Float tensor on cpu, got 2 element(s) of Float on cpu");
  expect_error([&] { kernels::scaled_copy_(src, dst, 1.0, zero_flag(), torch::zeros({1})); },
               "first_nonfinite_index must be a 1-element Int tensor on cpu, got 1 element(s) of Float on cpu");
  expect_error([&] { kernels::scaled_copy_(src, dst, 1.0, zero_flag(), no_index(), -1); },
               "index_offset must be >= 0, got -1");
}

TEST(ScaledCopyTest, RejectsMixedDevices) {
  LTA_REQUIRE_CUDA();
  std::vector<torch::Tensor> src = {torch::ones({3}), torch::ones({3})};
  std::vector<torch::Tensor> dst = {torch::ones({3}), torch::ones({3}, torch::kCUDA)};
  expect_error([&] { kernels::scaled_copy_(src, dst, 1.0); }, "dst[1] is on cuda:0 but the call runs on cpu");
  std::vector<torch::Tensor> dst_cpu = {torch::ones({3}), torch::ones({3})};
  expect_error([&] { kernels::scaled_copy_(src, dst_cpu, torch::ones({1}, torch::kCUDA)); },
               "scale must be a 1-element Float tensor on cpu, got 1 element(s) of Float on cuda:0");
}

}  // namespace
