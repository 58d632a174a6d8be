#include <kernels/multi_tensor/l2_norm.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <kernels/capture.h>
#ifdef LIBTORCH_AMP_WITH_CUDA
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include "test_util.h"

namespace {

// Sizes that exercise the chunking: empty, single element, odd, and one chunk (65536) plus or minus one.
const std::vector<int64_t> kSizes = {0, 1, 7, 1001, 65535, 65536, 65537, 3 * 65536 + 5};

// Inputs are exact in fp64 whatever their dtype, so a norm's only error is the fp32 squaring and per-thread
// summation (a few hundred to a thousand terms per fp32 sum) and the final rounding to fp32.
constexpr double kNormRtol = 1e-5;

std::vector<int64_t> tiny_sizes(int count) {
  std::vector<int64_t> sizes;
  for (int i = 0; i < count; ++i) sizes.push_back(1 + (i * 37) % 64);
  return sizes;
}

// The fp64 reference: each tensor's norm with torch::linalg_vector_norm in double (after multiplying by the
// fp32 inv_scale in double), and the total as the norm of those norms.
struct ReferenceNorms {
  double total;
  std::vector<double> per_tensor;
};

ReferenceNorms reference_norms(const std::vector<torch::Tensor>& tensors, float inv_scale = 1.0f) {
  ReferenceNorms ref{0.0, {}};
  std::vector<torch::Tensor> norms;
  for (const auto& t : tensors) {
    norms.push_back(torch::linalg_vector_norm(t.cpu().to(torch::kFloat64) * static_cast<double>(inv_scale), 2));
    ref.per_tensor.push_back(norms.back().item<double>());
  }
  if (!norms.empty()) {
    ref.total = torch::linalg_vector_norm(torch::stack(norms), 2).item<double>();
  }
  return ref;
}

void expect_norms_near(const kernels::L2NormResult& actual, const ReferenceNorms& expected) {
  ASSERT_EQ(actual.total.scalar_type(), torch::kFloat);
  ASSERT_EQ(actual.total.numel(), 1);
  EXPECT_NEAR(actual.total.item<float>(), expected.total, kNormRtol * expected.total) << "total norm";
  ASSERT_TRUE(actual.per_tensor.defined());
  ASSERT_EQ(actual.per_tensor.scalar_type(), torch::kFloat);
  ASSERT_EQ(actual.per_tensor.numel(), static_cast<int64_t>(expected.per_tensor.size()));
  const torch::Tensor per = actual.per_tensor.cpu();
  for (size_t i = 0; i < expected.per_tensor.size(); ++i) {
    EXPECT_NEAR(per[static_cast<int64_t>(i)].item<float>(), expected.per_tensor[i], kNormRtol * expected.per_tensor[i])
        << "norm of tensor " << i;
  }
}

// Bitwise equality that also holds for NaN payloads and signed zeros.
bool same_bits(const torch::Tensor& a, const torch::Tensor& b) {
  const torch::Tensor x = a.cpu().contiguous();
  const torch::Tensor y = b.cpu().contiguous();
  return x.scalar_type() == y.scalar_type() && x.sizes() == y.sizes() &&
         std::memcmp(x.data_ptr(), y.data_ptr(), x.nbytes()) == 0;
}

std::vector<torch::Tensor> clones(const std::vector<torch::Tensor>& list) {
  std::vector<torch::Tensor> out;
  for (const auto& t : list) out.push_back(t.clone());
  return out;
}

void expect_same_bits(const std::vector<torch::Tensor>& actual, const std::vector<torch::Tensor>& expected,
                      const std::string& what) {
  ASSERT_EQ(actual.size(), expected.size());
  for (size_t i = 0; i < actual.size(); ++i) EXPECT_TRUE(same_bits(actual[i], expected[i])) << what << ", tensor " << i;
}

template <typename T>
class L2NormTest : public ::testing::Test {
 protected:
  static torch::ScalarType dtype() { return c10::CppTypeToScalarType<T>::value; }
  // The clip results are stored in the dtype after an fp32 coefficient that carries the norm's error.
  static double clip_rtol() { return std::max(test_util::rtol_for(dtype()), 2 * kNormRtol); }
  // A product that lands among the subnormals (fp16: below 6e-5) can round one subnormal step either way.
  static double clip_atol() { return static_cast<double>(std::numeric_limits<T>::denorm_min()); }

  std::vector<torch::Tensor> random_list(const std::vector<int64_t>& sizes, const torch::Device& device) {
    std::vector<torch::Tensor> list;
    for (int64_t n : sizes) list.push_back(torch::randn({n}, gen_).to(dtype()).to(device));
    return list;
  }
  torch::Generator gen_ = at::make_generator<at::CPUGeneratorImpl>(test_util::fresh_seed());
};

using Dtypes = ::testing::Types<float, c10::Half, c10::BFloat16>;
TYPED_TEST_SUITE(L2NormTest, Dtypes);

TYPED_TEST(L2NormTest, CpuMatchesFp64ReferenceAcrossChunkBoundaries) {
  const std::vector<torch::Tensor> list = this->random_list(kSizes, torch::kCPU);
  expect_norms_near(kernels::l2_norm(list, /*per_tensor=*/true), reference_norms(list));
}

TYPED_TEST(L2NormTest, CpuHandlesThousandsOfTinyTensors) {
  const std::vector<torch::Tensor> list = this->random_list(tiny_sizes(3000), torch::kCPU);
  expect_norms_near(kernels::l2_norm(list, /*per_tensor=*/true), reference_norms(list));
}

TYPED_TEST(L2NormTest, CpuIsBitIdenticalAcrossCallsAndThreadCounts) {
  std::vector<int64_t> sizes = kSizes;
  for (int64_t n : tiny_sizes(500)) sizes.push_back(n);
  sizes.push_back(20 * 65536 + 3);  // enough chunks for every thread to take several
  const std::vector<torch::Tensor> list = this->random_list(sizes, torch::kCPU);
  const auto first = kernels::l2_norm(list, true);
  const auto second = kernels::l2_norm(list, true);
  const int threads = at::get_num_threads();
  at::set_num_threads(1);
  const auto single_thread = kernels::l2_norm(list, true);
  at::set_num_threads(threads);
  EXPECT_TRUE(same_bits(first.total, second.total));
  EXPECT_TRUE(same_bits(first.per_tensor, second.per_tensor));
  EXPECT_TRUE(same_bits(first.total, single_thread.total)) << "with " << threads << " threads vs 1";
  EXPECT_TRUE(same_bits(first.per_tensor, single_thread.per_tensor));
}

TYPED_TEST(L2NormTest, CpuInvScaleGivesNormOfScaledTensorsWithoutTouchingThem) {
  const std::vector<torch::Tensor> list = this->random_list(kSizes, torch::kCPU);
  const auto before = clones(list);
  const float inv = 0.37f / 65536.0f;  // not a power of two: the product is rounded in fp32 per element
  const auto result = kernels::l2_norm(list, true, torch::full({1}, inv));
  expect_norms_near(result, reference_norms(list, inv));
  expect_same_bits(list, before, "l2_norm modified its input");
}

TYPED_TEST(L2NormTest, CpuClipScalesByMaxNormOverTotalWhenAbove) {
  std::vector<int64_t> sizes = kSizes;
  for (int64_t n : tiny_sizes(100)) sizes.push_back(n);
  std::vector<torch::Tensor> grads = this->random_list(sizes, torch::kCPU);
  const ReferenceNorms ref = reference_norms(grads);
  const double max_norm = 0.25 * ref.total;
  const double coef = max_norm / (ref.total + 1e-6);
  std::vector<torch::Tensor> expected;
  for (const auto& g : grads) expected.push_back((g.to(torch::kFloat64) * coef).to(this->dtype()));
  auto found_inf = torch::zeros({1});

  const torch::Tensor total = kernels::clip_grad_norm_(grads, max_norm, found_inf);

  EXPECT_EQ(total.dim(), 0);
  EXPECT_NEAR(total.item<float>(), ref.total, kNormRtol * ref.total) << "returns the norm before clipping";
  for (size_t i = 0; i < grads.size(); ++i) {
    EXPECT_TRUE(torch::allclose(grads[i].to(torch::kFloat64), expected[i].to(torch::kFloat64), this->clip_rtol(),
                                this->clip_atol()))
        << "tensor " << i;
  }
  EXPECT_NEAR(reference_norms(grads).total, max_norm, this->clip_rtol() * max_norm) << "the clipped norm";
  EXPECT_EQ(found_inf.item<float>(), 0.0f);
}

TYPED_TEST(L2NormTest, CpuClipLeavesGradsUntouchedWhenNormBelowMax) {
  std::vector<torch::Tensor> grads = this->random_list(kSizes, torch::kCPU);
  const auto before = clones(grads);
  const ReferenceNorms ref = reference_norms(grads);
  const torch::Tensor total = kernels::clip_grad_norm_(grads, 1.01 * ref.total);
  EXPECT_NEAR(total.item<float>(), ref.total, kNormRtol * ref.total);
  expect_same_bits(grads, before, "grads changed although the norm was below max_norm");
  kernels::clip_grad_norm_(grads, std::numeric_limits<double>::infinity());
  expect_same_bits(grads, before, "max_norm = inf clipped");
}

TYPED_TEST(L2NormTest, CpuNonFiniteNormLeavesGradsUntouchedAndRaisesFoundInf) {
  for (float bad : {std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()}) {
    std::vector<torch::Tensor> grads = this->random_list({1001, 65537, 9}, torch::kCPU);
    grads[1][65536] = bad;  // the only element of tensor 1's second chunk
    const auto before = clones(grads);
    auto found_inf = torch::zeros({1});
    const torch::Tensor total = kernels::clip_grad_norm_(grads, 1e-3, found_inf);
    EXPECT_FALSE(std::isfinite(total.item<float>())) << "value " << bad;
    EXPECT_EQ(std::isnan(total.item<float>()), std::isnan(bad)) << "NaN gives a NaN norm, inf an inf one";
    EXPECT_EQ(found_inf.item<float>(), 1.0f) << "value " << bad;
    expect_same_bits(grads, before, "grads changed although the norm was not finite");
  }
}

TEST(L2NormTest, FoundInfIsNeverCleared) {
  std::vector<torch::Tensor> grads = {torch::randn({100})};
  auto found_inf = torch::ones({1});
  kernels::clip_grad_norm_(grads, 1e-3, found_inf);
  EXPECT_EQ(found_inf.item<float>(), 1.0f);
}

TEST(L2NormTest, ClipMatchesTorchClipGradNormOnFloat32) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(test_util::fresh_seed());
  for (double fraction : {0.3, 1.5}) {  // clipped, then left alone
    std::vector<torch::Tensor> params;
    std::vector<torch::Tensor> grads;
    for (int64_t n : std::vector<int64_t>{3 * 65536 + 5, 1, 1001, 65536, 7}) {
      auto p = torch::randn({n}, gen).requires_grad_(true);
      p.mutable_grad() = torch::randn({n}, gen);
      grads.push_back(p.grad().clone());
      params.push_back(p);
    }
    const double norm = reference_norms(grads).total;
    const double torch_total = torch::nn::utils::clip_grad_norm_(params, fraction * norm);
    const torch::Tensor ours = kernels::clip_grad_norm_(grads, fraction * norm);
    EXPECT_NEAR(ours.item<float>(), torch_total, kNormRtol * torch_total);
    for (size_t i = 0; i < grads.size(); ++i) {
      EXPECT_TRUE(torch::allclose(grads[i], params[i].grad(), 2 * kNormRtol, 0.0))
          << "tensor " << i << ", max_norm = " << fraction << " x norm";
    }
  }
}

TEST(L2NormTest, MixedDtypesAreGroupedAndPerTensorKeepsListOrder) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(test_util::fresh_seed());
  const std::vector<torch::Tensor> list = {torch::randn({100}, gen),
                                           torch::randn({65537}, gen).to(torch::kHalf),
                                           torch::randn({5}, gen).to(torch::kBFloat16),
                                           torch::empty({0}),
                                           torch::randn({7}, gen).to(torch::kHalf),
                                           torch::randn({70000}, gen)};
  expect_norms_near(kernels::l2_norm(list, true), reference_norms(list));
}

TEST(L2NormTest, PerTensorIsUndefinedUnlessAsked) {
  const std::vector<torch::Tensor> list = {torch::ones({4})};
  const auto result = kernels::l2_norm(list);
  EXPECT_FALSE(result.per_tensor.defined());
  EXPECT_EQ(result.total.item<float>(), 2.0f);
}

TEST(L2NormTest, EmptyListAndEmptyTensorsGiveZero) {
  const std::vector<torch::Tensor> none;
  const auto empty_list = kernels::l2_norm(none, true);
  EXPECT_EQ(empty_list.total.item<float>(), 0.0f);
  EXPECT_EQ(empty_list.per_tensor.numel(), 0);
  std::vector<torch::Tensor> no_grads;
  EXPECT_EQ(kernels::clip_grad_norm_(no_grads, 1.0).item<float>(), 0.0f);

  const std::vector<torch::Tensor> empties = {torch::empty({0}), torch::empty({0, 3}, torch::kHalf)};
  const auto result = kernels::l2_norm(empties, true);
  EXPECT_EQ(result.total.item<float>(), 0.0f);
  EXPECT_TRUE(torch::equal(result.per_tensor, torch::zeros({2})));
}

// Bad input: each error names the argument, the index and the offending value.
using test_util::expect_error;

TEST(L2NormTest, RejectsMaxNormThatIsNotPositive) {
  std::vector<torch::Tensor> grads = {torch::randn({3})};
  for (double bad : {0.0, -1.5, 1e-60}) {
    expect_error([&] { kernels::clip_grad_norm_(grads, bad); },
                 "max_norm must be > 0 (as a float32; +inf never clips), got " + c10::str(bad));
  }
  expect_error([&] { kernels::clip_grad_norm_(grads, std::numeric_limits<double>::quiet_NaN()); },
               "max_norm must be > 0 (as a float32; +inf never clips), got nan");
}

TEST(L2NormTest, RejectsBadTensorsNamingArgumentIndexAndValue) {
  expect_error(
      [] {
        kernels::l2_norm({torch::ones({3}), torch::ones({3}, torch::kInt32)});
      },
      "tensors[1] must be float32, float16 or bfloat16, got Int");
  expect_error(
      [] {
        kernels::clip_grad_norm_({torch::ones({2}), torch::ones({2}), torch::ones({4, 4}).t()}, 1.0);
      },
      "grads[2] must be contiguous, got sizes [4, 4] strides [1, 4]");
  expect_error([] { kernels::l2_norm({torch::ones({2}), torch::Tensor()}); }, "tensors[1] is an undefined tensor");
}

TEST(L2NormTest, RejectsBadScalarTensors) {
  const std::vector<torch::Tensor> list = {torch::ones({3})};
  expect_error([&] { kernels::l2_norm(list, false, torch::ones({1}, torch::kDouble)); },
               "inv_scale must be a 1-element Float tensor on cpu, got 1 element(s) of Double on cpu");
  expect_error([&] { kernels::clip_grad_norm_(list, 1.0, torch::zeros({2})); },
               "found_inf must be a 1-element Float tensor on cpu, got 2 element(s) of Float on cpu");
}

// Note [alignment-independent sums] (kernels/cuda/l2_norm.cu): the same values give the same bits whether the tensor
// starts on a 16-byte boundary or not. The CPU twin maps elements by their offset from the start (unaligned vector
// loads), so it holds by construction there; the CUDA test below is the one that failed before the fix.
std::vector<torch::Tensor> offset_views(const std::vector<torch::Tensor>& aligned, int64_t offset) {
  std::vector<torch::Tensor> views;
  for (const auto& t : aligned) {
    auto base = torch::empty({t.numel() + offset}, t.options());
    auto view = base.slice(0, offset);
    view.copy_(t);
    views.push_back(view);
  }
  return views;
}

TYPED_TEST(L2NormTest, MisalignedViewGivesTheSameBitsAsAlignedTensor) {
  const auto aligned = this->random_list({1001, 65536 + 17, 5}, torch::kCPU);
  for (int64_t offset : {1, 3}) {
    const auto views = offset_views(aligned, offset);
    ASSERT_NE(reinterpret_cast<uintptr_t>(views[0].data_ptr()) % 16, 0u);
    const auto a = kernels::l2_norm(aligned, true), b = kernels::l2_norm(views, true);
    EXPECT_TRUE(same_bits(a.total, b.total)) << "offset " << offset;
    EXPECT_TRUE(same_bits(a.per_tensor, b.per_tensor)) << "offset " << offset;
  }
}

// --- CUDA: the kernels against their CPU twins (skipped without a GPU) ---

TYPED_TEST(L2NormTest, CudaMisalignedViewGivesTheSameBitsAsAlignedTensor) {
  LTA_REQUIRE_CUDA();
  std::vector<torch::Tensor> aligned;
  for (const auto& t : this->random_list({1001, 65536 + 17, 5, 3 * 65536}, torch::kCPU)) aligned.push_back(t.cuda());
  for (int64_t offset : {1, 3, 5}) {
    const auto views = offset_views(aligned, offset);
    ASSERT_NE(reinterpret_cast<uintptr_t>(views[0].data_ptr()) % 16, 0u);
    const auto a = kernels::l2_norm(aligned, true), b = kernels::l2_norm(views, true);
    EXPECT_TRUE(same_bits(a.total, b.total)) << "offset " << offset;
    EXPECT_TRUE(same_bits(a.per_tensor, b.per_tensor)) << "offset " << offset;
  }
}

// Captured in a CUDA graph, l2_norm and clip_grad_norm_ replay with their device slot table: replays after the
// host side of the capture is long gone (and other allocations reused its memory) match eager calls bit for bit.
TYPED_TEST(L2NormTest, CudaGraphReplayMatchesEagerCalls) {
  LTA_REQUIRE_CUDA();
#ifdef LIBTORCH_AMP_WITH_CUDA
  std::vector<int64_t> sizes = kSizes;
  for (int64_t n : tiny_sizes(300)) sizes.push_back(n);
  std::vector<torch::Tensor> grads;
  for (const auto& t : this->random_list(sizes, torch::kCPU)) grads.push_back(t.cuda());
  const c10::cuda::CUDAStream stream = c10::cuda::getStreamFromPool();
  const c10::cuda::CUDAStreamGuard on_stream(stream);
  auto found_inf = torch::zeros({1}, torch::kCUDA);
  kernels::l2_norm(grads, true);  // warm-up outside the capture
  at::cuda::CUDAGraph graph;
  graph.capture_begin();
  EXPECT_TRUE(kernels::is_capturing(torch::Device(torch::kCUDA, 0)));
  const auto captured = kernels::l2_norm(grads, true);
  const auto captured_total = kernels::clip_grad_norm_(grads, 1.0, found_inf);
  graph.capture_end();
  for (int replay = 0; replay < 3; ++replay) {
    for (auto& g : grads) g.normal_();  // new values in the same memory
    std::vector<torch::Tensor> scratch;
    for (int i = 0; i < 20; ++i) scratch.push_back(torch::empty({1 << 16}, torch::kLong).pin_memory());
    const auto copies = clones(grads);
    const auto expected = kernels::l2_norm(copies, true);
    const auto expected_total = kernels::clip_grad_norm_(copies, 1.0);
    graph.replay();
    stream.synchronize();
    EXPECT_TRUE(same_bits(captured.total, expected.total)) << "replay " << replay;
    EXPECT_TRUE(same_bits(captured.per_tensor, expected.per_tensor)) << "replay " << replay;
    EXPECT_TRUE(same_bits(captured_total, expected_total)) << "replay " << replay;
    expect_same_bits(grads, copies, "captured clip differs from the eager one");
  }
#else
  GTEST_SKIP() << "libtorch_amp was built without CUDA (LIBTORCH_AMP_CUDA=OFF)";
#endif
}

TYPED_TEST(L2NormTest, CudaMatchesCpuTwin) {
  LTA_REQUIRE_CUDA();
  std::vector<int64_t> sizes = kSizes;
  for (int64_t n : tiny_sizes(2500)) sizes.push_back(n);  // more tensors than one launch holds
  sizes.push_back(2100 * 65536 + 11);                     // more chunks than one launch holds
  std::vector<torch::Tensor> cpu = this->random_list(sizes, torch::kCPU);
  std::vector<torch::Tensor> gpu;
  for (const auto& t : cpu) gpu.push_back(t.cuda());
  // A misaligned view on the GPU too.
  auto base = torch::randn({1027}, this->gen_).to(this->dtype());
  cpu.push_back(base.slice(0, 3).clone());
  gpu.push_back(base.cuda().slice(0, 3));
  const float inv = 1.0f / 3.0f;
  for (bool scaled : {false, true}) {
    const kernels::L2NormResult cpu_result =
        kernels::l2_norm(cpu, true, scaled ? torch::full({1}, inv) : torch::Tensor());
    const kernels::L2NormResult gpu_result =
        kernels::l2_norm(gpu, true, scaled ? torch::full({1}, inv, torch::kCUDA) : torch::Tensor());
    ASSERT_TRUE(gpu_result.total.is_cuda() && gpu_result.per_tensor.is_cuda());
    ReferenceNorms as_reference{cpu_result.total.item<double>(), {}};
    for (int64_t i = 0; i < cpu_result.per_tensor.numel(); ++i) {
      as_reference.per_tensor.push_back(cpu_result.per_tensor[i].item<double>());
    }
    // Chunks are summed in different orders on the two devices: equal to the fp32 accumulation error.
    expect_norms_near(gpu_result, as_reference);
  }
}

TYPED_TEST(L2NormTest, CudaIsBitIdenticalAcrossCalls) {
  LTA_REQUIRE_CUDA();
  std::vector<int64_t> sizes = kSizes;
  for (int64_t n : tiny_sizes(2500)) sizes.push_back(n);
  std::vector<torch::Tensor> gpu;
  for (const auto& t : this->random_list(sizes, torch::kCPU)) gpu.push_back(t.cuda());
  const auto first = kernels::l2_norm(gpu, true);
  for (int call = 0; call < 5; ++call) {
    const auto again = kernels::l2_norm(gpu, true);
    ASSERT_TRUE(same_bits(first.total, again.total)) << "call " << call;
    ASSERT_TRUE(same_bits(first.per_tensor, again.per_tensor)) << "call " << call;
  }
  expect_norms_near(first, reference_norms(gpu));
}

TYPED_TEST(L2NormTest, CudaClipMatchesCpuTwin) {
  LTA_REQUIRE_CUDA();
  std::vector<int64_t> sizes = kSizes;
  for (int64_t n : tiny_sizes(1500)) sizes.push_back(n);
  std::vector<torch::Tensor> cpu = this->random_list(sizes, torch::kCPU);
  std::vector<torch::Tensor> gpu;
  for (const auto& t : cpu) gpu.push_back(t.cuda());
  const double norm = reference_norms(cpu).total;
  auto found_inf = torch::zeros({1}, torch::kCUDA);
  const torch::Tensor gpu_total = kernels::clip_grad_norm_(gpu, 0.5 * norm, found_inf);
  kernels::clip_grad_norm_(cpu, 0.5 * norm);
  EXPECT_TRUE(gpu_total.is_cuda());
  EXPECT_NEAR(gpu_total.item<float>(), norm, kNormRtol * norm);
  EXPECT_EQ(found_inf.item<float>(), 0.0f);
  for (size_t i = 0; i < cpu.size(); ++i) {
    EXPECT_TRUE(torch::allclose(gpu[i].cpu().to(torch::kFloat64), cpu[i].to(torch::kFloat64), this->clip_rtol(),
                                this->clip_atol()))
        << "tensor " << i;
  }
  // Below max_norm nothing moves.
  const auto before = clones(gpu);
  kernels::clip_grad_norm_(gpu, 2.0 * norm, found_inf);
  expect_same_bits(gpu, before, "CUDA clip changed grads below max_norm");
}

TYPED_TEST(L2NormTest, CudaNonFiniteNormLeavesGradsUntouchedAndRaisesFoundInf) {
  LTA_REQUIRE_CUDA();
  std::vector<torch::Tensor> gpu = this->random_list({1001, 65537, 9}, torch::kCUDA);
  gpu[1][65536] = std::numeric_limits<float>::infinity();  // the second chunk
  const auto before = clones(gpu);
  auto found_inf = torch::zeros({1}, torch::kCUDA);
  const torch::Tensor total = kernels::clip_grad_norm_(gpu, 1e-3, found_inf);
  EXPECT_TRUE(std::isinf(total.item<float>()));
  EXPECT_EQ(found_inf.item<float>(), 1.0f);
  expect_same_bits(gpu, before, "CUDA clip changed grads with a non-finite norm");
}

TEST(L2NormTest, RejectsMixedDevices) {
  LTA_REQUIRE_CUDA();
  expect_error(
      [] {
        kernels::l2_norm({torch::ones({2}, torch::kCUDA), torch::ones({2})});
      },
      "tensors[1] is on cpu but the call runs on cuda:0");
  const std::vector<torch::Tensor> gpu = {torch::ones({2}, torch::kCUDA)};
  expect_error([&] { kernels::l2_norm(gpu, false, torch::ones({1})); },
               "inv_scale must be a 1-element Float tensor on cuda:0, got 1 element(s) of Float on cpu");
}

}  // namespace
