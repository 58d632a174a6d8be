// keep_layernorm_fp32 (Note [kept norms under a model cast] in amp/state/model_cast.h): the norm ops must get weights
// in the dtype of their half input (CUDA's layer_norm and group_norm require it; CPU's accept a mix, so the dtypes are
// checked where they reach the op), while the parameters, gradients and updates stay fp32.

#include <vector>

#include <amp/amp.h>
#include <amp/optim/fused_optimizers.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "test_util.h"

namespace {

/// Linear -> LayerNorm -> GroupNorm -> Linear; records the dtypes each norm op receives and returns.
struct NormNetImpl : torch::nn::Module {
  NormNetImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(6, 12));
    ln = register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({12})));
    gn = register_module("gn", torch::nn::GroupNorm(torch::nn::GroupNormOptions(3, 12)));
    fc2 = register_module("fc2", torch::nn::Linear(12, 2));
  }
  struct Seen {
    c10::ScalarType input, weight, bias, output;
  };
  torch::Tensor forward(torch::Tensor x) {
    auto h = fc1(x);
    auto l = ln(h);
    seen.push_back({h.scalar_type(), ln->weight.scalar_type(), ln->bias.scalar_type(), l.scalar_type()});
    auto g = gn(l);
    seen.push_back({l.scalar_type(), gn->weight.scalar_type(), gn->bias.scalar_type(), g.scalar_type()});
    return fc2(torch::relu(g));
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  torch::nn::LayerNorm ln{nullptr};
  torch::nn::GroupNorm gn{nullptr};
  std::vector<Seen> seen;
};
TORCH_MODULE(NormNet);

torch::Tensor batch(uint64_t seed) { return torch::randn({4, 6}, at::make_generator<at::CPUGeneratorImpl>(seed)); }

class KeptNormTest : public ::testing::TestWithParam<amp::OptLevel> {};

TEST_P(KeptNormTest, NormOpsGetTheInputDtypeWhileParametersAndGradientsStayFp32) {
  torch::manual_seed(4);
  NormNet net;
  const auto ln_weight = net->ln->weight;
  amp::FusedAdamW adamw(net->parameters(), amp::FusedAdamOptions(1e-2));
  auto [model, optimizer] = amp::initialize(
      net, adamw, amp::Options().opt_level(GetParam()).half_dtype(torch::kBFloat16).keep_layernorm_fp32(true));
  EXPECT_EQ(net->ln->weight.scalar_type(), torch::kFloat);
  EXPECT_EQ(net->gn->bias.scalar_type(), torch::kFloat);
  const auto before = net->ln->weight.detach().clone();
  const auto out = model(batch(1));
  ASSERT_EQ(net->seen.size(), 2u);
  for (const auto& s : net->seen) {
    EXPECT_EQ(s.input, torch::kBFloat16);
    EXPECT_EQ(s.weight, s.input) << "the norm op got a weight in another dtype than its input (fails on CUDA)";
    EXPECT_EQ(s.bias, s.input);
    EXPECT_EQ(s.output, s.input) << "the norm's output is not in the model's half dtype";
  }
  // After the forward the modules hold their fp32 parameters again, the very tensors the optimizer updates.
  EXPECT_TRUE(net->ln->weight.is_same(ln_weight));
  EXPECT_EQ(net->ln->weight.scalar_type(), torch::kFloat);
  EXPECT_TRUE(net->gn->weight.is_same(net->named_parameters()["gn.weight"]));
  {
    auto scaled = amp::scale_loss(out.pow(2).mean(), optimizer);
    scaled.backward();
  }
  ASSERT_TRUE(net->ln->weight.grad().defined());
  EXPECT_EQ(net->ln->weight.grad().scalar_type(), torch::kFloat);
  EXPECT_EQ(net->gn->bias.grad().scalar_type(), torch::kFloat);
  optimizer.step();
  EXPECT_FALSE(torch::equal(net->ln->weight, before)) << "the fp32 LayerNorm weight was not updated";
  EXPECT_EQ(net->ln->weight.scalar_type(), torch::kFloat);
}

TEST_P(KeptNormTest, MembersAreRestoredWhenTheForwardThrows) {
  torch::manual_seed(5);
  NormNet net;
  torch::optim::SGD sgd(net->parameters(), 0.1);
  auto [model, optimizer] = amp::initialize(
      net, sgd, amp::Options().opt_level(GetParam()).half_dtype(torch::kBFloat16).keep_layernorm_fp32(true));
  EXPECT_THROW(model(torch::randn({4, 5})), c10::Error);  // fc1 refuses the width
  EXPECT_EQ(net->ln->weight.scalar_type(), torch::kFloat);
  EXPECT_TRUE(net->ln->weight.is_same(net->named_parameters()["ln.weight"]));
}

// The same model on CUDA: before the fix, layer_norm refused the fp32 weight with a half input.
TEST_P(KeptNormTest, CudaForwardAndBackwardRun) {
  LTA_REQUIRE_CUDA();
  torch::manual_seed(6);
  NormNet net;
  net->to(torch::kCUDA);
  torch::optim::SGD sgd(net->parameters(), 0.1);
  auto [model, optimizer] = amp::initialize(
      net, sgd, amp::Options().opt_level(GetParam()).half_dtype(torch::kHalf).keep_layernorm_fp32(true));
  const auto out = model(batch(2).to(torch::kCUDA));
  {
    auto scaled = amp::scale_loss(out.pow(2).mean(), optimizer);
    scaled.backward();
  }
  optimizer.step();
  EXPECT_EQ(net->ln->weight.grad().scalar_type(), torch::kFloat);
  EXPECT_TRUE(torch::isfinite(net->ln->weight).all().item<bool>());
}

INSTANTIATE_TEST_SUITE_P(O2AndO3, KeptNormTest, ::testing::Values(amp::OptLevel::O2, amp::OptLevel::O3),
                         [](const auto& info) { return info.param == amp::OptLevel::O2 ? "O2" : "O3"; });

}  // namespace
