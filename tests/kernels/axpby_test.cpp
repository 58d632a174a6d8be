#include <kernels/multi_tensor/axpby.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "kernels/copy_test_util.h"
#include "test_util.h"

namespace {

using copy_test::dtype_of;
using copy_test::expect_error;
using copy_test::zero_flag;
using kernels::CheckInputs;

template <typename X_, typename Y_, typename Out_>
struct DtypeTriple {
  using X = X_;
  using Y = Y_;
  using Out = Out_;
};

template <typename P>
class AxpbyTest : public ::testing::Test {
 protected:
  static torch::ScalarType x_dtype() { return dtype_of<typename P::X>(); }
  static torch::ScalarType y_dtype() { return dtype_of<typename P::Y>(); }
  static torch::ScalarType out_dtype() { return dtype_of<typename P::Out>(); }

  struct Lists {
    std::vector<torch::Tensor> out, x, y;
  };
  // Random x, y and out (so an element the kernel forgot to write is caught).
  Lists random_lists(const std::vector<int64_t>& sizes, const torch::Device& device = torch::kCPU) {
    return {copy_test::random_list(sizes, out_dtype(), gen_, device),
            copy_test::random_list(sizes, x_dtype(), gen_, device),
            copy_test::random_list(sizes, y_dtype(), gen_, device)};
  }

  torch::Generator gen_ = at::make_generator<at::CPUGeneratorImpl>(test_util::fresh_seed());
};

// Same-dtype accumulation in each dtype, and the mixed ones gradient accumulation meets: fp16/bf16 grads added
// into fp32 accumulators, and fp32 into fp16/bf16 outputs.
using Triples = ::testing::Types<DtypeTriple<float, float, float>, DtypeTriple<c10::Half, c10::Half, c10::Half>,
                                 DtypeTriple<c10::BFloat16, c10::BFloat16, c10::BFloat16>,
                                 DtypeTriple<float, c10::Half, float>, DtypeTriple<float, c10::BFloat16, float>,
                                 DtypeTriple<c10::Half, float, c10::Half>, DtypeTriple<float, float, c10::BFloat16>>;
TYPED_TEST_SUITE(AxpbyTest, Triples);

// The fp64 reference rounded once to out's dtype. The error bound scales with |a*x| + |b*y|, not with the
// result: when the two terms cancel, fp32 arithmetic is only accurate relative to the terms. fp16 results may
// also land one subnormal step away where the terms themselves are tiny.
void expect_matches_reference(const std::vector<torch::Tensor>& out, const std::vector<torch::Tensor>& x,
                              const std::vector<torch::Tensor>& y, double a, double b) {
  ASSERT_EQ(out.size(), x.size());
  for (size_t i = 0; i < out.size(); ++i) {
    const auto xd = x[i].cpu().to(torch::kFloat64);
    const auto yd = y[i].cpu().to(torch::kFloat64);
    const auto expected = (a * xd + b * yd).to(out[i].scalar_type()).to(torch::kFloat64);
    const double rtol = test_util::rtol_for(out[i].scalar_type());
    const double atol = out[i].scalar_type() == torch::kHalf ? copy_test::kHalfSmallestSubnormal : 0.0;
    const auto bound = rtol * ((a * xd).abs() + (b * yd).abs()) + atol;
    const auto error = (out[i].cpu().to(torch::kFloat64) - expected).abs();
    EXPECT_TRUE((error <= bound).all().item<bool>())
        << "out[" << i << "] of " << out[i].numel() << " elements, " << out[i].scalar_type() << ": max excess "
        << (error - bound).max().item<double>();
  }
}

TYPED_TEST(AxpbyTest, MatchesFp64ReferenceAcrossChunkBoundaries) {
  auto l = this->random_lists(copy_test::kSizes);
  auto found_inf = zero_flag();
  kernels::axpby_(l.out, l.x, l.y, 0.75, -1.0 / 1024, found_inf);
  expect_matches_reference(l.out, l.x, l.y, 0.75, -1.0 / 1024);
  EXPECT_EQ(found_inf.item<float>(), 0.0f) << "finite data must not set found_inf";
}

TYPED_TEST(AxpbyTest, RoundsLikeFmaOfAXAndBY) {
  // Note [axpby rounding]: out = fma(a, x, b*y) in fp32, then rounded to out's dtype, bit for bit under every
  // CPU capability (the CUDA kernel computes the same).
  auto l = this->random_lists({65536 + 77, 13});
  const float a = 0.3f;
  const float b = -1.7f;
  kernels::axpby_(l.out, l.x, l.y, a, b);
  for (size_t i = 0; i < l.out.size(); ++i) {
    const torch::Tensor x = l.x[i].to(torch::kFloat).contiguous();
    const torch::Tensor y = l.y[i].to(torch::kFloat).contiguous();
    torch::Tensor expected = torch::empty_like(x);
    const float* xs = x.const_data_ptr<float>();
    const float* ys = y.const_data_ptr<float>();
    float* e = expected.mutable_data_ptr<float>();
    for (int64_t k = 0; k < x.numel(); ++k) e[k] = std::fma(a, xs[k], b * ys[k]);
    EXPECT_TRUE(torch::equal(l.out[i], expected.to(this->out_dtype()))) << "out[" << i << "]";
  }
}

TYPED_TEST(AxpbyTest, HandlesMisalignedViews) {
  // Entry 0: x misaligned; entry 1: y and out misaligned; entry 2: all three.
  const int64_t n = 65536 + 9;
  auto x_base = copy_test::random_tensor(n + 1, this->x_dtype(), this->gen_);
  auto y_base = copy_test::random_tensor(n + 1, this->y_dtype(), this->gen_);
  auto out_base = copy_test::random_tensor(n + 1, this->out_dtype(), this->gen_);
  auto out_small = copy_test::random_tensor(40, this->out_dtype(), this->gen_);
  const auto out_first = out_base.slice(0, 0, 1).clone();
  const auto out_small_first = out_small.slice(0, 0, 1).clone();
  std::vector<torch::Tensor> x = {x_base.slice(0, 1), copy_test::random_tensor(n, this->x_dtype(), this->gen_),
                                  copy_test::random_tensor(40, this->x_dtype(), this->gen_).slice(0, 1)};
  std::vector<torch::Tensor> y = {copy_test::random_tensor(n, this->y_dtype(), this->gen_), y_base.slice(0, 1),
                                  copy_test::random_tensor(40, this->y_dtype(), this->gen_).slice(0, 1)};
  std::vector<torch::Tensor> out = {copy_test::random_tensor(n, this->out_dtype(), this->gen_), out_base.slice(0, 1),
                                    out_small.slice(0, 1)};
  ASSERT_NE(reinterpret_cast<uintptr_t>(x[0].data_ptr()) % 16, 0u);
  kernels::axpby_(out, x, y, 2.0, 0.5);
  expect_matches_reference(out, x, y, 2.0, 0.5);
  EXPECT_TRUE(torch::equal(out_base.slice(0, 0, 1), out_first)) << "an element outside a view was written";
  EXPECT_TRUE(torch::equal(out_small.slice(0, 0, 1), out_small_first)) << "an element outside a view was written";
}

TYPED_TEST(AxpbyTest, HandlesThousandsOfTinyTensors) {
  auto l = this->random_lists(copy_test::tiny_sizes(3000));
  kernels::axpby_(l.out, l.x, l.y, 1.0, 1.0 / 65536);
  expect_matches_reference(l.out, l.x, l.y, 1.0, 1.0 / 65536);
}

// Tensor 1 spans four chunks (the last one 5 elements long); tensor 3 ends one element into its second chunk.
const std::vector<int64_t> kPlantSizes = {5, 3 * 65536 + 5, 17, 65537};
const std::vector<std::pair<size_t, int64_t>> kPlantSites = {
    {0, 0}, {0, 4}, {1, 0}, {1, 65535}, {1, 65536}, {1, 131071}, {1, 3 * 65536 + 4}, {3, 65535}, {3, 65536}};

TYPED_TEST(AxpbyTest, ChecksExactlyTheRequestedInputs) {
  const auto clean = this->random_lists(kPlantSizes);
  for (const float planted : {std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()}) {
    for (const auto& [tensor, element] : kPlantSites) {
      for (const bool in_x : {true, false}) {
        auto x = copy_test::clones(clean.x);
        auto y = copy_test::clones(clean.y);
        (in_x ? x : y)[tensor][element] = planted;
        for (const CheckInputs check : {CheckInputs::kNone, CheckInputs::kX, CheckInputs::kY, CheckInputs::kBoth}) {
          auto out = copy_test::clones(clean.out);
          auto found_inf = zero_flag();
          kernels::axpby_(out, x, y, 1.5, -0.5, found_inf, check);
          const bool checked =
              check == CheckInputs::kBoth || (in_x ? check == CheckInputs::kX : check == CheckInputs::kY);
          EXPECT_EQ(found_inf.item<float>(), checked ? 1.0f : 0.0f)
              << planted << " in " << (in_x ? "x" : "y") << "[" << tensor << "][" << element << "], check "
              << static_cast<int>(check);
        }
      }
    }
  }
}

TYPED_TEST(AxpbyTest, ACleanCallDoesNotClearTheFlag) {
  auto l = this->random_lists({65537, 3});
  auto found_inf = torch::ones({1});
  kernels::axpby_(l.out, l.x, l.y, 1.0, 1.0, found_inf);
  EXPECT_EQ(found_inf.item<float>(), 1.0f) << "found_inf is the caller's to zero";
}

TYPED_TEST(AxpbyTest, CudaMatchesCpuTwin) {
  LTA_REQUIRE_CUDA();
  std::vector<int64_t> sizes = copy_test::kSizes;
  for (int64_t n : copy_test::tiny_sizes(2500)) sizes.push_back(n);
  auto cpu = this->random_lists(sizes);
  // A misaligned entry on the GPU: the views are made there, the CPU gets equal copies.
  auto x_base = copy_test::random_tensor(4099, this->x_dtype(), this->gen_);
  auto y_base = copy_test::random_tensor(4099, this->y_dtype(), this->gen_);
  auto out_base = copy_test::random_tensor(4099, this->out_dtype(), this->gen_);
  cpu.x.push_back(x_base.slice(0, 1));
  cpu.y.push_back(y_base.slice(0, 3));
  cpu.out.push_back(out_base.slice(0, 3).clone());
  cpu.x[7][70000] = std::numeric_limits<float>::infinity();
  auto x_gpu = copy_test::to_device(cpu.x, torch::kCUDA);
  auto y_gpu = copy_test::to_device(cpu.y, torch::kCUDA);
  auto out_gpu = copy_test::to_device(cpu.out, torch::kCUDA);
  x_gpu.back() = x_base.cuda().slice(0, 1);
  out_gpu.back() = out_base.cuda().slice(0, 3);
  ASSERT_NE(reinterpret_cast<uintptr_t>(x_gpu.back().data_ptr()) % 16, 0u);
  auto found_cpu = zero_flag();
  auto found_gpu = zero_flag(torch::kCUDA);
  kernels::axpby_(cpu.out, cpu.x, cpu.y, 0.3, -1.7, found_cpu);
  kernels::axpby_(out_gpu, x_gpu, y_gpu, 0.3, -1.7, found_gpu);
  copy_test::expect_identical(out_gpu, cpu.out);
  EXPECT_EQ(found_cpu.item<float>(), 1.0f);
  EXPECT_EQ(found_gpu.item<float>(), 1.0f);
}

TEST(AxpbyTest, OutMayBeXOrY) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(test_util::fresh_seed());
  for (const auto dtype : {torch::kFloat, torch::kHalf, torch::kBFloat16}) {
    std::vector<torch::Tensor> x = {copy_test::random_tensor(65537, dtype, gen),
                                    copy_test::random_tensor(9, dtype, gen)};
    std::vector<torch::Tensor> y = {copy_test::random_tensor(65537, dtype, gen),
                                    copy_test::random_tensor(9, dtype, gen)};
    const auto x_before = copy_test::clones(x);
    const auto y_before = copy_test::clones(y);
    kernels::axpby_(x, x, y, 0.5, 2.0);  // x = 0.5 x + 2 y
    expect_matches_reference(x, x_before, y_before, 0.5, 2.0);
    const auto x_now = copy_test::clones(x);
    kernels::axpby_(y, x, y, 1.0, -1.0);  // y = x - y
    expect_matches_reference(y, x_now, y_before, 1.0, -1.0);
  }
}

TEST(AxpbyTest, MixedDtypeEntriesInOneCall) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(test_util::fresh_seed());
  const std::vector<std::array<torch::ScalarType, 3>> triples = {{torch::kHalf, torch::kFloat, torch::kFloat},
                                                                 {torch::kFloat, torch::kFloat, torch::kFloat},
                                                                 {torch::kBFloat16, torch::kHalf, torch::kFloat},
                                                                 {torch::kHalf, torch::kFloat, torch::kFloat}};
  std::vector<torch::Tensor> x, y, out;
  for (size_t i = 0; i < triples.size(); ++i) {
    const int64_t n = 1000 + 33 * static_cast<int64_t>(i);
    x.push_back(copy_test::random_tensor(n, triples[i][0], gen));
    y.push_back(copy_test::random_tensor(n, triples[i][1], gen));
    out.push_back(copy_test::random_tensor(n, triples[i][2], gen));
  }
  kernels::axpby_(out, x, y, -1.0, 4.0);
  expect_matches_reference(out, x, y, -1.0, 4.0);
}

TEST(AxpbyTest, AResultThatOverflowsIsNotFlagged) {
  // Documented: only inputs are checked, as in Apex's axpby.
  std::vector<torch::Tensor> x = {torch::full({8}, 60000.0f).to(torch::kHalf)};
  std::vector<torch::Tensor> y = {torch::full({8}, 60000.0f).to(torch::kHalf)};
  std::vector<torch::Tensor> out = {torch::empty({8}, torch::kHalf)};
  auto found_inf = zero_flag();
  kernels::axpby_(out, x, y, 1.0, 1.0, found_inf);
  EXPECT_TRUE(std::isinf(out[0][0].item<float>()));
  EXPECT_EQ(found_inf.item<float>(), 0.0f);
}

TEST(AxpbyTest, EmptyListsAreANoOp) {
  std::vector<torch::Tensor> none;
  EXPECT_NO_THROW(kernels::axpby_(none, none, none, 1.0, 1.0));
}

// Bad input: each error names the argument, the index and the offending value.
TEST(AxpbyTest, RejectsACheckWithoutAFlag) {
  std::vector<torch::Tensor> t = {torch::ones({3})};
  expect_error([&] { kernels::axpby_(t, t, t, 1.0, 1.0, {}, CheckInputs::kX); },
               "check=kX asks to check inputs but found_inf is undefined");
  expect_error([&] { kernels::axpby_(t, t, t, 1.0, 1.0, {}, CheckInputs::kY); },
               "check=kY asks to check inputs but found_inf is undefined");
}

TEST(AxpbyTest, RejectsListsOfDifferentLengths) {
  std::vector<torch::Tensor> two = {torch::ones({3}), torch::ones({3})};
  std::vector<torch::Tensor> one = {torch::ones({3})};
  expect_error([&] { kernels::axpby_(one, two, two, 1.0, 1.0); }, "out has 1 tensors but x has 2");
  expect_error([&] { kernels::axpby_(two, two, one, 1.0, 1.0); }, "y has 1 tensors but x has 2");
}

TEST(AxpbyTest, RejectsElementCountMismatchNamingIndexAndCounts) {
  std::vector<torch::Tensor> x = {torch::ones({3}), torch::ones({4})};
  std::vector<torch::Tensor> y = {torch::ones({3}), torch::ones({6})};
  expect_error([&] { kernels::axpby_(x, x, y, 1.0, 1.0); }, "y[1] has 6 elements but x[1] has 4");
}

TEST(AxpbyTest, RejectsIntegerAndNonContiguousTensors) {
  std::vector<torch::Tensor> x = {torch::ones({3}), torch::ones({16})};
  std::vector<torch::Tensor> bad_dtype = {torch::ones({3}), torch::ones({16}, torch::kInt64)};
  std::vector<torch::Tensor> strided = {torch::ones({3}), torch::ones({4, 4}).t()};
  expect_error([&] { kernels::axpby_(bad_dtype, x, x, 1.0, 1.0); },
               "out[1] must be float32, float16 or bfloat16, got Long");
  expect_error([&] { kernels::axpby_(x, x, strided, 1.0, 1.0); },
               "y[1] must be contiguous, got sizes [4, 4] strides [1, 4]");
}

TEST(AxpbyTest, RejectsMixedDevices) {
  LTA_REQUIRE_CUDA();
  std::vector<torch::Tensor> x = {torch::ones({3}), torch::ones({3})};
  std::vector<torch::Tensor> out = {torch::ones({3}), torch::ones({3}, torch::kCUDA)};
  expect_error([&] { kernels::axpby_(out, x, x, 1.0, 1.0); }, "out[1] is on cuda:0 but the call runs on cpu");
}

}  // namespace
