#include <kernels/flatten.h>

#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "kernels/copy_test_util.h"
#include "test_util.h"

namespace {

using copy_test::dtype_of;
using copy_test::expect_error;

template <typename T, typename B>
struct DtypePair {
  using Tensor = T;
  using Bucket = B;
};

template <typename P>
class FlattenTest : public ::testing::Test {
 protected:
  static torch::ScalarType tensor_dtype() { return dtype_of<typename P::Tensor>(); }
  static torch::ScalarType bucket_dtype() { return dtype_of<typename P::Bucket>(); }

  std::vector<torch::Tensor> random_tensors(const std::vector<int64_t>& sizes,
                                            const torch::Device& device = torch::kCPU) {
    return copy_test::random_list(sizes, tensor_dtype(), gen_, device);
  }
  // A bucket of random values with `spare` elements beyond what the tensors need (they must stay untouched).
  torch::Tensor random_bucket(const std::vector<torch::Tensor>& tensors, int64_t spare,
                              const torch::Device& device = torch::kCPU) {
    return copy_test::random_tensor(total_numel(tensors) + spare, bucket_dtype(), gen_, device);
  }
  static int64_t total_numel(const std::vector<torch::Tensor>& tensors) {
    int64_t total = 0;
    for (const auto& t : tensors) total += t.numel();
    return total;
  }

  torch::Generator gen_ = at::make_generator<at::CPUGeneratorImpl>(test_util::fresh_seed());
};

// Gradients into buckets and back: fp16/bf16 grads into an fp32 bucket, fp32 grads into a compressed fp16/bf16
// bucket, and fp32 throughout.
using Pairs = ::testing::Types<DtypePair<c10::Half, float>, DtypePair<c10::BFloat16, float>,
                               DtypePair<float, c10::Half>, DtypePair<float, c10::BFloat16>, DtypePair<float, float>>;
TYPED_TEST_SUITE(FlattenTest, Pairs);

// Odd sizes put most tensors at offsets that are not 16-byte aligned.
const std::vector<int64_t> kBucketSizes = {0, 1, 7, 1001, 65535, 65536, 65537, 3 * 65536 + 5, 3};

// Checks bucket[offset_i : offset_i + numel_i] against tensors[i] * scale (fp64, rounded to the bucket's dtype),
// and that the bucket past the tensors still equals `tail`.
void expect_flattened(const torch::Tensor& bucket, const std::vector<torch::Tensor>& tensors, double scale,
                      const torch::Tensor& tail) {
  const double rtol = test_util::rtol_for(bucket.scalar_type());
  int64_t offset = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const int64_t n = tensors[i].numel();
    const auto expected = (tensors[i].cpu().to(torch::kFloat64).reshape({-1}) * scale).to(bucket.scalar_type());
    copy_test::expect_close(bucket.slice(0, offset, offset + n), expected, rtol,
                            "bucket segment of tensors[" + std::to_string(i) + "]");
    offset += n;
  }
  EXPECT_TRUE(torch::equal(bucket.slice(0, offset).cpu(), tail.cpu())) << "the bucket past the tensors was written";
}

TYPED_TEST(FlattenTest, FlattenMatchesFp64ReferenceAndLeavesTheRestAlone) {
  const auto tensors = this->random_tensors(kBucketSizes);
  auto bucket = this->random_bucket(tensors, 13);
  const auto tail = bucket.slice(0, this->total_numel(tensors)).clone();
  kernels::flatten_into_(bucket, tensors, 0.125);
  expect_flattened(bucket, tensors, 0.125, tail);
}

TYPED_TEST(FlattenTest, UnflattenMatchesFp64Reference) {
  auto tensors = this->random_tensors(kBucketSizes);
  const auto bucket = this->random_bucket(tensors, 5);
  const auto bucket_before = bucket.clone();
  kernels::unflatten_from_(bucket, tensors, 1.0 / 3);
  EXPECT_TRUE(torch::equal(bucket, bucket_before)) << "unflatten must not write the bucket";
  int64_t offset = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const int64_t n = tensors[i].numel();
    const auto expected = (bucket.slice(0, offset, offset + n).to(torch::kFloat64) / 3).to(this->tensor_dtype());
    copy_test::expect_close(tensors[i], expected, test_util::rtol_for(this->tensor_dtype()),
                            "tensors[" + std::to_string(i) + "]");
    offset += n;
  }
}

TYPED_TEST(FlattenTest, MultiDimensionalTensorsAndAMisalignedBucket) {
  // The bucket itself starts one element into its storage; the tensors have shapes.
  std::vector<torch::Tensor> tensors = {torch::randn({3, 5}, this->gen_).to(this->tensor_dtype()),
                                        torch::randn({64, 1025}, this->gen_).to(this->tensor_dtype()),
                                        torch::randn({2, 2, 2}, this->gen_).to(this->tensor_dtype())};
  auto storage = copy_test::random_tensor(this->total_numel(tensors) + 2, this->bucket_dtype(), this->gen_);
  auto bucket = storage.slice(0, 1);
  ASSERT_NE(reinterpret_cast<uintptr_t>(bucket.data_ptr()) % 16, 0u);
  const auto first = storage.slice(0, 0, 1).clone();
  const auto tail = bucket.slice(0, this->total_numel(tensors)).clone();
  kernels::flatten_into_(bucket, tensors, 2.0);
  expect_flattened(bucket, tensors, 2.0, tail);
  EXPECT_TRUE(torch::equal(storage.slice(0, 0, 1), first)) << "an element before the bucket view was written";

  std::vector<torch::Tensor> back;
  for (const auto& t : tensors) back.push_back(torch::empty_like(t));
  kernels::unflatten_from_(bucket, back, 0.5);
  // Two roundings: one into the bucket, one back; tiny values may have gone through fp16 subnormals.
  const double atol = this->bucket_dtype() == torch::kHalf ? copy_test::kHalfSmallestSubnormal : 0.0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    copy_test::expect_close(back[i], tensors[i].to(torch::kFloat64), 2 * test_util::rtol_for(this->bucket_dtype()),
                            "round trip of tensors[" + std::to_string(i) + "]", atol);
  }
}

TYPED_TEST(FlattenTest, HandlesThousandsOfTinyTensors) {
  const auto tensors = this->random_tensors(copy_test::tiny_sizes(3000));
  auto bucket = this->random_bucket(tensors, 1);
  const auto tail = bucket.slice(0, this->total_numel(tensors)).clone();
  kernels::flatten_into_(bucket, tensors, 0.5);
  expect_flattened(bucket, tensors, 0.5, tail);
}

TYPED_TEST(FlattenTest, CudaMatchesCpuTwin) {
  LTA_REQUIRE_CUDA();
  std::vector<int64_t> sizes = kBucketSizes;
  for (int64_t n : copy_test::tiny_sizes(2500)) sizes.push_back(n);
  const auto tensors_cpu = this->random_tensors(sizes);
  const auto tensors_gpu = copy_test::to_device(tensors_cpu, torch::kCUDA);
  auto bucket_cpu = this->random_bucket(tensors_cpu, 3);
  auto bucket_gpu = bucket_cpu.cuda();
  kernels::flatten_into_(bucket_cpu, tensors_cpu, 0.25);
  kernels::flatten_into_(bucket_gpu, tensors_gpu, 0.25);
  EXPECT_TRUE(torch::equal(bucket_gpu.cpu(), bucket_cpu)) << "flattened buckets differ between CUDA and CPU";

  auto back_cpu = this->random_tensors(sizes);
  auto back_gpu = copy_test::to_device(back_cpu, torch::kCUDA);
  kernels::unflatten_from_(bucket_cpu, back_cpu, 3.0);
  kernels::unflatten_from_(bucket_gpu, back_gpu, 3.0);
  copy_test::expect_identical(back_gpu, back_cpu);
}

TEST(FlattenTest, Fp32RoundTripIsExact) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(test_util::fresh_seed());
  // Mixed dtypes into an fp32 bucket round-trip exactly too: fp16 and bf16 are subsets of fp32.
  std::vector<torch::Tensor> tensors;
  const torch::ScalarType dtypes[] = {torch::kFloat, torch::kHalf, torch::kBFloat16};
  for (size_t i = 0; i < kBucketSizes.size(); ++i) {
    tensors.push_back(copy_test::random_tensor(kBucketSizes[i], dtypes[i % 3], gen));
  }
  int64_t total = 0;
  for (const auto& t : tensors) total += t.numel();
  auto bucket = torch::empty({total});
  kernels::flatten_into_(bucket, tensors);
  std::vector<torch::Tensor> back;
  for (const auto& t : tensors) back.push_back(torch::full_like(t, -7.0));
  kernels::unflatten_from_(bucket, back);
  for (size_t i = 0; i < tensors.size(); ++i) {
    EXPECT_TRUE(torch::equal(back[i], tensors[i])) << "tensors[" << i << "] of " << tensors[i].scalar_type();
  }
}

TEST(FlattenTest, MixedDtypesLandInListOrder) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(test_util::fresh_seed());
  std::vector<torch::Tensor> tensors = {
      copy_test::random_tensor(5, torch::kHalf, gen), copy_test::random_tensor(70000, torch::kFloat, gen),
      copy_test::random_tensor(3, torch::kBFloat16, gen), copy_test::random_tensor(9, torch::kHalf, gen)};
  auto bucket = torch::randn({70017 + 4}, gen).to(torch::kBFloat16);
  const auto tail = bucket.slice(0, 70017).clone();
  kernels::flatten_into_(bucket, tensors, -1.0);
  expect_flattened(bucket, tensors, -1.0, tail);
}

TEST(FlattenTest, EmptyListIsANoOp) {
  auto bucket = torch::randn({10});
  const auto before = bucket.clone();
  std::vector<torch::Tensor> none;
  kernels::flatten_into_(bucket, none);
  kernels::unflatten_from_(bucket, none);
  EXPECT_TRUE(torch::equal(bucket, before));
}

// Bad input: each error names the argument, the index and the offending value.
TEST(FlattenTest, RejectsABucketTooSmallNamingBothCounts) {
  std::vector<torch::Tensor> tensors = {torch::ones({5}), torch::ones({7})};
  auto bucket = torch::zeros({11});
  expect_error([&] { kernels::flatten_into_(bucket, tensors); },
               "bucket has 11 elements but the 2 tensors hold 12 in all");
  expect_error([&] { kernels::unflatten_from_(bucket, tensors); },
               "bucket has 11 elements but the 2 tensors hold 12 in all");
}

TEST(FlattenTest, RejectsBadBuckets) {
  std::vector<torch::Tensor> tensors = {torch::ones({2})};
  expect_error([&] { kernels::flatten_into_(torch::zeros({4}, torch::kInt32), tensors); },
               "bucket must be float32, float16 or bfloat16, got Int");
  expect_error([&] { kernels::flatten_into_(torch::zeros({2, 3}), tensors); }, "bucket must be 1-D, got sizes [2, 3]");
  expect_error([&] { kernels::flatten_into_(torch::zeros({8}).slice(0, 0, 8, 2), tensors); },
               "bucket must be contiguous, got stride 2");
  expect_error([&] { kernels::unflatten_from_(torch::Tensor(), tensors); }, "bucket is an undefined tensor");
}

TEST(FlattenTest, RejectsBadTensorsNamingIndexAndValue) {
  auto bucket = torch::zeros({64});
  std::vector<torch::Tensor> integer = {torch::ones({2}), torch::ones({2}, torch::kInt64)};
  std::vector<torch::Tensor> strided = {torch::ones({2}), torch::ones({2}), torch::ones({4, 4}).t()};
  expect_error([&] { kernels::flatten_into_(bucket, integer); },
               "tensors[1] must be float32, float16 or bfloat16, got Long");
  expect_error([&] { kernels::unflatten_from_(bucket, strided); },
               "tensors[2] must be contiguous, got sizes [4, 4] strides [1, 4]");
}

TEST(FlattenTest, RejectsMixedDevices) {
  LTA_REQUIRE_CUDA();
  std::vector<torch::Tensor> tensors = {torch::ones({2}), torch::ones({2}, torch::kCUDA)};
  expect_error([&] { kernels::flatten_into_(torch::zeros({4}), tensors); },
               "tensors[1] is on cuda:0 but the call runs on cpu");
  std::vector<torch::Tensor> on_gpu = {torch::ones({2}, torch::kCUDA)};
  expect_error([&] { kernels::unflatten_from_(torch::zeros({4}), on_gpu); },
               "tensors[0] is on cuda:0 but the call runs on cpu");
}

}  // namespace
