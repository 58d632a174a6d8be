#include <amp/nn/fused_dense.h>

#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <amp/amp.h>
#include <amp/autocast.h>
#include <kernels/gemm/path_autotune.h>

#include "test_util.h"

namespace {

using amp::DensePath;
using kernels::GemmPath;

// Normwise closeness: products rounded to the dtype err relative to the largest magnitude of the result.
void expect_close(const torch::Tensor& actual, const torch::Tensor& expected, double rtol, const std::string& what) {
  ASSERT_TRUE(actual.defined()) << what << " is undefined";
  ASSERT_EQ(actual.sizes(), expected.sizes()) << what;
  const auto e = expected.detach().cpu().to(torch::kFloat64);
  const double scale = e.abs().max().item<double>();
  const double err = (actual.detach().cpu().to(torch::kFloat64) - e).abs().max().item<double>();
  EXPECT_LE(err, rtol * scale + 1e-12) << what << ": max error " << err << " vs scale " << scale;
}

// Copies parameters by name (after mapping `from_prefix` to `to_prefix`), converting dtype and device.
void copy_params(torch::nn::Module& from, torch::nn::Module& to, const std::string& from_prefix = "",
                 const std::string& to_prefix = "") {
  torch::NoGradGuard no_grad;
  auto target = to.named_parameters();
  for (const auto& p : from.named_parameters()) {
    std::string name = p.key();
    if (!from_prefix.empty() && name.rfind(from_prefix, 0) == 0) name = to_prefix + name.substr(from_prefix.size());
    ASSERT_TRUE(target.contains(name)) << name;
    target[name].copy_(p.value());
  }
}

struct Shape {
  std::vector<int64_t> batch;  // leading dimensions of the input
  int64_t in, hidden, out;
};
// A batch of 1, odd sizes, sizes that are not multiples of 8, 3-D inputs, a large K, and one shape cuBLASLt takes
// whole.
const std::vector<Shape> kShapes = {{{1}, 7, 9, 5},     {{3, 4}, 9, 16, 16},  {{17}, 24, 13, 11},
                                    {{33}, 4099, 8, 8}, {{2, 5}, 64, 40, 24}, {{2, 8}, 64, 32, 24}};

/// Every GEMM dimension a multiple of 8 (tokens, and the features of every layer): cuBLASLt must take it, so a
/// module asked for the cuBLASLt path really computed there.
bool lt_takes_whole(const Shape& s, bool block) {
  int64_t tokens = 1;
  for (const int64_t b : s.batch) tokens *= b;
  return tokens % 8 == 0 && s.in % 8 == 0 && s.out % 8 == 0 && (!block || s.hidden % 8 == 0);
}

template <typename Module>
void expect_lt_path_where_whole(const Module& m, const torch::Device& device, DensePath path, const Shape& s,
                                bool block, const std::string& what) {
  if (!device.is_cuda() || path != DensePath::kCublasLt || !lt_takes_whole(s, block)) return;
  EXPECT_EQ(m->paths_taken().forward, GemmPath::kCublasLt) << what;
  EXPECT_EQ(m->paths_taken().backward, GemmPath::kCublasLt) << what;
}

template <typename T>
class FusedDenseTest : public ::testing::Test {
 public:
  static torch::ScalarType dtype() { return c10::CppTypeToScalarType<T>::value; }
  // Two roundings (the product, then the activation or the next layer's input) and sums over the batch: a few ulps.
  // On every CPU kernel path a GEMM rounds once after an fp32 sum (Note [bounds on every CPU kernel path],
  // tests/test_util.h): the sum's own error, K 2^-24 sum |a b|, is below 3e-3 of max |y| even at K = 4099, against a
  // normwise bound of 0.096 (bf16) or 0.012 (fp16). Checked for bf16 and fp16 Linear at K = 4099 under three kernel
  // settings by tests/numerics/check_kernel_paths.py; a path that summed in the dtype would be off by sqrt(K) ulps.
  static double rtol() { return 6 * test_util::rtol_for(dtype()); }

  torch::Tensor random(std::vector<int64_t> sizes) { return torch::randn(sizes, gen_).to(dtype()); }
  std::vector<int64_t> input_sizes(const Shape& s, int64_t features) {
    std::vector<int64_t> sizes = s.batch;
    sizes.push_back(features);
    return sizes;
  }

  torch::Generator gen_ = at::make_generator<at::CPUGeneratorImpl>(test_util::fresh_seed());
};

using Dtypes = ::testing::Types<float, c10::Half, c10::BFloat16>;
TYPED_TEST_SUITE(FusedDenseTest, Dtypes);

// Forward and every gradient against torch::nn::Linear in fp64 with the same (rounded) parameters.
template <typename Test>
void check_dense_against_linear(Test& t, const torch::Device& device, DensePath path) {
  for (const Shape& s : kShapes) {
    amp::FusedDense fused(amp::FusedDenseOptions(s.in, s.out).path(path));
    fused->to(device, t.dtype());
    torch::nn::Linear linear(s.in, s.out);
    linear->to(torch::kFloat64);
    copy_params(*fused, *linear);
    const auto x = t.random(t.input_sizes(s, s.in)).to(device).requires_grad_();
    const auto x64 = x.detach().cpu().to(torch::kFloat64).requires_grad_();
    const auto y = fused(x);
    const auto y64 = linear(x64);
    const auto dy = t.random(t.input_sizes(s, s.out));
    y.backward(dy.to(device));
    y64.backward(dy.to(torch::kFloat64));
    const std::string what = "FusedDense in=" + std::to_string(s.in) + " out=" + std::to_string(s.out);
    expect_lt_path_where_whole(fused, device, path, s, /*block=*/false, what);
    EXPECT_EQ(y.scalar_type(), t.dtype());
    expect_close(y, y64, t.rtol(), what + " output");
    expect_close(x.grad(), x64.grad(), t.rtol(), what + " grad input");
    expect_close(fused->weight.grad(), linear->weight.grad(), t.rtol(), what + " grad weight");
    expect_close(fused->bias.grad(), linear->bias.grad(), t.rtol(), what + " grad bias");
  }
}

// Forward and every gradient against Linear -> GELU(tanh) -> Linear in fp64.
template <typename Test>
void check_gelu_block_against_sequential(Test& t, const torch::Device& device, DensePath path, bool bias = true) {
  for (const Shape& s : kShapes) {
    amp::FusedDenseGeluDense fused(amp::FusedDenseGeluDenseOptions(s.in, s.hidden, s.out).bias(bias).path(path));
    fused->to(device, t.dtype());
    torch::nn::Linear first(torch::nn::LinearOptions(s.in, s.hidden).bias(bias));
    torch::nn::Linear second(torch::nn::LinearOptions(s.hidden, s.out).bias(bias));
    torch::nn::Sequential seq(first, torch::nn::GELU(torch::nn::GELUOptions().approximate("tanh")), second);
    seq->to(torch::kFloat64);
    copy_params(*fused->dense1, *seq[0]);
    copy_params(*fused->dense2, *seq[2]);
    const auto x = t.random(t.input_sizes(s, s.in)).to(device).requires_grad_();
    const auto x64 = x.detach().cpu().to(torch::kFloat64).requires_grad_();
    const auto y = fused(x);
    const auto y64 = seq->forward(x64);
    const auto dy = t.random(t.input_sizes(s, s.out));
    y.backward(dy.to(device));
    y64.backward(dy.to(torch::kFloat64));
    const std::string what = "FusedDenseGeluDense " + std::to_string(s.in) + "-" + std::to_string(s.hidden) + "-" +
                             std::to_string(s.out) + (bias ? "" : " (no bias)");
    expect_lt_path_where_whole(fused, device, path, s, /*block=*/true, what);
    expect_close(y, y64, t.rtol(), what + " output");
    expect_close(x.grad(), x64.grad(), t.rtol(), what + " grad input");
    auto reference = seq->named_parameters();
    expect_close(fused->dense1->weight.grad(), reference["0.weight"].grad(), t.rtol(), what + " grad dense1.weight");
    expect_close(fused->dense2->weight.grad(), reference["2.weight"].grad(), t.rtol(), what + " grad dense2.weight");
    if (bias) {
      expect_close(fused->dense1->bias.grad(), reference["0.bias"].grad(), t.rtol(), what + " grad dense1.bias");
      expect_close(fused->dense2->bias.grad(), reference["2.bias"].grad(), t.rtol(), what + " grad dense2.bias");
    }
  }
}

TYPED_TEST(FusedDenseTest, CpuFallbackMatchesLinearInFp64) {
  check_dense_against_linear(*this, torch::kCPU, DensePath::kAuto);
}

TYPED_TEST(FusedDenseTest, CpuFallbackGeluBlockMatchesLinearGeluLinearInFp64) {
  check_gelu_block_against_sequential(*this, torch::kCPU, DensePath::kAuto);
}

TYPED_TEST(FusedDenseTest, CpuFallbackGeluBlockWithoutBiasMatches) {
  check_gelu_block_against_sequential(*this, torch::kCPU, DensePath::kAten, /*bias=*/false);
}

TYPED_TEST(FusedDenseTest, CudaCublasLtPathMatchesLinearInFp64) {
  LTA_REQUIRE_CUDA();
  check_dense_against_linear(*this, torch::kCUDA, DensePath::kCublasLt);
  check_gelu_block_against_sequential(*this, torch::kCUDA, DensePath::kCublasLt);
  check_gelu_block_against_sequential(*this, torch::kCUDA, DensePath::kCublasLt, /*bias=*/false);
}

TYPED_TEST(FusedDenseTest, CudaFallbackGivesTheSameGradientsAsCublasLt) {
  LTA_REQUIRE_CUDA();
  // Shapes cuBLASLt takes whole (every dimension a multiple of 8), so one module really is on the Lt path.
  for (const Shape& s : {Shape{{64}, 256, 512, 128}, Shape{{2, 24}, 96, 64, 40}}) {
    amp::FusedDenseGeluDense lt(amp::FusedDenseGeluDenseOptions(s.in, s.hidden, s.out).path(DensePath::kCublasLt));
    amp::FusedDenseGeluDense aten(amp::FusedDenseGeluDenseOptions(s.in, s.hidden, s.out).path(DensePath::kAten));
    lt->to(torch::kCUDA, this->dtype());
    aten->to(torch::kCUDA, this->dtype());
    copy_params(*lt, *aten);
    const auto x = this->random(this->input_sizes(s, s.in)).cuda();
    const auto x_lt = x.clone().requires_grad_();
    const auto x_aten = x.clone().requires_grad_();
    const auto dy = this->random(this->input_sizes(s, s.out)).cuda();
    lt(x_lt).backward(dy);
    aten(x_aten).backward(dy);
    EXPECT_EQ(lt->paths_taken().forward, GemmPath::kCublasLt);
    EXPECT_EQ(lt->paths_taken().backward, GemmPath::kCublasLt);
    EXPECT_EQ(aten->paths_taken().forward, GemmPath::kAten);
    EXPECT_EQ(aten->paths_taken().backward, GemmPath::kAten);
    expect_close(x_lt.grad(), x_aten.grad(), this->rtol(), "grad input");
    auto reference = aten->named_parameters();
    for (const auto& p : lt->named_parameters()) {
      expect_close(p.value().grad(), reference[p.key()].grad(), this->rtol(), "grad " + p.key());
    }
  }
}

TEST(FusedDenseTest, CudaAutoPathMeasuresEachShapeOnceAndRecordsIt) {
  LTA_REQUIRE_CUDA();
  amp::FusedDenseGeluDense block(128, 512, 128);
  block->to(torch::kCUDA, torch::kBFloat16);
  const auto x = torch::randn({256, 128}, torch::kCUDA).to(torch::kBFloat16);
  const int64_t before = kernels::autotune_measurement_count();
  block(x).sum().backward();
  EXPECT_EQ(kernels::autotune_measurement_count(), before + 1);
  block(x).sum().backward();
  EXPECT_EQ(kernels::autotune_measurement_count(), before + 1) << "a known shape was measured again";
  const auto choice = kernels::cached_path({2, 256, 128, 512, 128, static_cast<int64_t>(torch::kBFloat16), 0, 1});
  ASSERT_TRUE(choice.has_value());
  EXPECT_EQ(block->paths_taken().forward, choice->path);
}

TEST(FusedDenseTest, ParameterNamesAndShapesMatchLinear) {
  for (bool bias : {true, false}) {
    torch::nn::Linear linear(torch::nn::LinearOptions(12, 5).bias(bias));
    amp::FusedDense fused(amp::FusedDenseOptions(12, 5).bias(bias));
    const auto expected = linear->named_parameters();
    const auto actual = fused->named_parameters();
    ASSERT_EQ(actual.size(), expected.size());
    for (const auto& p : expected) {
      ASSERT_TRUE(actual.contains(p.key())) << p.key();
      EXPECT_EQ(actual[p.key()].sizes(), p.value().sizes()) << p.key();
    }
    EXPECT_TRUE(fused->named_buffers().is_empty()) << "no extra state in the state dict";
  }
}

TEST(FusedDenseTest, SeededInitializationEqualsLinears) {
  torch::manual_seed(7);
  torch::nn::Linear linear(33, 17);
  torch::manual_seed(7);
  amp::FusedDense fused(33, 17);
  EXPECT_TRUE(torch::equal(fused->weight, linear->weight));
  EXPECT_TRUE(torch::equal(fused->bias, linear->bias));
  torch::manual_seed(8);
  // Constructed in order (the order of evaluation of function arguments is unspecified).
  torch::nn::Linear first(6, 24);
  torch::nn::Linear second(24, 3);
  torch::nn::Sequential seq(first, torch::nn::GELU(), second);
  torch::manual_seed(8);
  amp::FusedDenseGeluDense block(6, 24, 3);
  auto reference = seq->named_parameters();
  for (const auto& [from, to] : std::vector<std::pair<std::string, std::string>>{{"0.weight", "dense1.weight"},
                                                                                 {"0.bias", "dense1.bias"},
                                                                                 {"2.weight", "dense2.weight"},
                                                                                 {"2.bias", "dense2.bias"}}) {
    EXPECT_TRUE(torch::equal(block->named_parameters()[to], reference[from])) << from << " -> " << to;
  }
}

TEST(FusedDenseTest, CheckpointsMoveBetweenLinearAndFusedDense) {
  torch::nn::Linear linear(10, 6);
  amp::FusedDense fused(10, 6);
  std::stringstream stream;
  torch::save(linear, stream);
  torch::load(fused, stream);
  const auto x = torch::randn({4, 10});
  expect_close(fused(x), linear(x), 1e-6, "FusedDense loaded from a Linear checkpoint");
  // And back.
  amp::FusedDense other(10, 6);
  torch::nn::Linear back(10, 6);
  std::stringstream stream2;
  torch::save(other, stream2);
  torch::load(back, stream2);
  expect_close(back(x), other(x), 1e-6, "Linear loaded from a FusedDense checkpoint");
}

TEST(FusedDenseTest, CpuReportsTheAtenPathForEveryPolicy) {
  for (DensePath path : {DensePath::kAuto, DensePath::kCublasLt, DensePath::kAten}) {
    amp::FusedDense fused(amp::FusedDenseOptions(8, 8).path(path));
    fused(torch::randn({2, 8}, torch::requires_grad())).sum().backward();
    EXPECT_EQ(fused->paths_taken().forward, GemmPath::kAten) << amp::dense_path_name(path);
    EXPECT_EQ(fused->paths_taken().backward, GemmPath::kAten) << amp::dense_path_name(path);
    ASSERT_TRUE(fused->weight.grad().defined());
    ASSERT_TRUE(fused->bias.grad().defined()) << "the fallback computes the bias gradient too";
  }
}

using test_util::expect_error;

TEST(FusedDenseTest, BadInputIsAnErrorNamingTheShapes) {
  amp::FusedDense fused(8, 4);
  expect_error(
      [&] {
        fused(torch::randn({3, 7}));
      },
      "FusedDense: input's last dimension must be in_features=8, got input sizes [3, 7]");
  amp::FusedDense half(8, 4);
  half->to(torch::kBFloat16);
  expect_error([&] { half(torch::randn({3, 8})); }, "FusedDense: input [3, 8] is Float but weight [4, 8] is BFloat16");
  amp::FusedDenseGeluDense block(8, 16, 4);
  expect_error(
      [&] {
        block(torch::randn({2, 2, 9}));
      },
      "FusedDenseGeluDense: input's last dimension must be in_features=8, got input sizes [2, 2, 9]");
  expect_error([] { amp::FusedDense(0, 4); }, "in_features and out_features must be > 0, got 0 and 4");
}

TEST(FusedDenseTest, AutocastRunsTheLayerInTheAutocastDtypeWithFp32Gradients) {
  amp::FusedDenseGeluDense block(8, 16, 4);
  const auto x = torch::randn({5, 8});
  torch::Tensor y;
  {
    amp::AutocastScope scope(c10::DeviceType::CPU, torch::kBFloat16);
    y = block(x);
  }
  EXPECT_EQ(y.scalar_type(), torch::kBFloat16) << "like Linear under autocast";
  y.to(torch::kFloat).pow(2).sum().backward();
  for (const auto& p : block->parameters()) {
    ASSERT_TRUE(p.grad().defined());
    EXPECT_EQ(p.grad().scalar_type(), torch::kFloat);
  }
}

// The same small model built on FusedDenseGeluDense or on Linear-GELU-Linear, trained one step under each opt level
// (bf16 on the CPU): outputs, gradients and updated parameters agree, so the layers are drop-in under amp.
template <typename Block>
struct MlpImpl : torch::nn::Module {
  explicit MlpImpl(Block b) : block(register_module("block", std::move(b))) {
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({8})));
  }
  torch::Tensor forward(torch::Tensor x) { return norm(block->forward(x)); }
  Block block;
  torch::nn::LayerNorm norm{nullptr};
};

TEST(FusedDenseTest, DropInForLinearGeluLinearUnderEveryOptLevel) {
  for (amp::OptLevel level : {amp::OptLevel::O0, amp::OptLevel::O1, amp::OptLevel::O2, amp::OptLevel::O3}) {
    torch::manual_seed(3);
    auto fused = std::make_shared<MlpImpl<amp::FusedDenseGeluDense>>(amp::FusedDenseGeluDense(8, 32, 8));
    torch::manual_seed(3);
    torch::nn::Linear first(8, 32);
    torch::nn::Linear second(32, 8);
    auto reference = std::make_shared<MlpImpl<torch::nn::Sequential>>(
        torch::nn::Sequential(first, torch::nn::GELU(torch::nn::GELUOptions().approximate("tanh")), second));
    torch::optim::SGD sgd_fused(fused->parameters(), 0.1);
    torch::optim::SGD sgd_reference(reference->parameters(), 0.1);
    const auto options = amp::Options().opt_level(level).half_dtype(torch::kBFloat16);
    auto [model, optimizer] =
        amp::initialize(torch::nn::ModuleHolder<MlpImpl<amp::FusedDenseGeluDense>>(fused), sgd_fused, options);
    auto [ref_model, ref_optimizer] =
        amp::initialize(torch::nn::ModuleHolder<MlpImpl<torch::nn::Sequential>>(reference), sgd_reference, options);
    const auto x = torch::randn({16, 8});
    const std::string what = amp::opt_level_name(level);
    // The same ATen kernels on both sides except the fused GEMM + GELU epilogue: O0 differs by fp32 rounding order,
    // O1-O3 by where bf16 rounds (after the bias, before GELU, ...): a few 2^-8, on any kernel path.
    const double rtol = level == amp::OptLevel::O0 ? 1e-5 : 8 * test_util::rtol_for(torch::kBFloat16);
    optimizer.zero_grad();
    ref_optimizer.zero_grad();
    const auto out = model(x);
    const auto ref_out = ref_model(x);
    EXPECT_EQ(out.scalar_type(), torch::kFloat) << what;
    expect_close(out, ref_out, rtol, what + " output");
    {
      auto scaled = amp::scale_loss(out.pow(2).mean(), optimizer);
      scaled.backward();
    }
    {
      auto scaled = amp::scale_loss(ref_out.pow(2).mean(), ref_optimizer);
      scaled.backward();
    }
    const auto grads = optimizer.gradients();
    const auto ref_grads = ref_optimizer.gradients();
    ASSERT_EQ(grads.size(), ref_grads.size()) << what;
    for (size_t i = 0; i < grads.size(); ++i) {
      ASSERT_TRUE(grads[i].defined()) << what << " gradient " << i;
      EXPECT_EQ(grads[i].scalar_type(), ref_grads[i].scalar_type()) << what << " gradient " << i;
      expect_close(grads[i], ref_grads[i], rtol, what + " gradient " + std::to_string(i));
    }
    optimizer.step();
    ref_optimizer.step();
    const auto params = fused->parameters();
    const auto ref_params = reference->parameters();
    for (size_t i = 0; i < params.size(); ++i) {
      EXPECT_EQ(params[i].scalar_type(), ref_params[i].scalar_type()) << what << " parameter " << i;
      expect_close(params[i], ref_params[i], rtol, what + " parameter " + std::to_string(i) + " after the step");
    }
  }
}

}  // namespace
