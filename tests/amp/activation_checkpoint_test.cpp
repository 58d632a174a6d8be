// amp::activation_checkpoint: a block that keeps only its inputs and runs again in backward gives the gradients of the
// unwrapped block bit for bit (dropout included: the random state is stashed), under FP32 and amp O1/O2 bf16, over
// several steps; misuse is one line.
#include <amp/recompute/activation_checkpoint.h>

#include <string>
#include <vector>

#include <amp/amp.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "test_util.h"

namespace {

/// A model whose middle block (Linear, GELU, dropout, Linear) runs under activation_checkpoint when asked.
struct NetImpl : torch::nn::Module {
  NetImpl() {
    in = register_module("in", torch::nn::Linear(8, 16));
    up = register_module("up", torch::nn::Linear(16, 32));
    down = register_module("down", torch::nn::Linear(32, 16));
    out = register_module("out", torch::nn::Linear(16, 4));
  }
  torch::Tensor block(const torch::Tensor& x) {
    return down(torch::dropout(torch::gelu(up(x)), /*p=*/0.3, is_training()));
  }
  torch::Tensor forward(torch::Tensor x) {
    auto h = torch::relu(in(x));
    h = checkpointed ? amp::activation_checkpoint([this](const torch::Tensor& t) { return block(t); }, h, options)
                     : block(h);
    return out(h + 0.5 * h.pow(2));
  }
  torch::nn::Linear in{nullptr}, up{nullptr}, down{nullptr}, out{nullptr};
  bool checkpointed = false;
  amp::ActivationCheckpointOptions options;
};
TORCH_MODULE(Net);

Net make_net(bool checkpointed) {
  torch::manual_seed(11);
  Net net;
  net->checkpointed = checkpointed;
  return net;
}

torch::Tensor batch(int64_t step) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(100 + step);
  return torch::randn({6, 8}, gen);
}

std::vector<torch::Tensor> values(torch::nn::Module& module, bool grads) {
  std::vector<torch::Tensor> out;
  for (const auto& p : module.parameters()) out.push_back((grads ? p.grad() : p).detach().clone());
  return out;
}

void expect_bit_identical(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b,
                          const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_TRUE(a[i].defined() && b[i].defined()) << what << " " << i;
    EXPECT_TRUE(torch::equal(a[i], b[i]))
        << what << " " << i << ": max diff "
        << (a[i].to(torch::kDouble) - b[i].to(torch::kDouble)).abs().max().item<double>();
  }
}

/// Three SGD steps of a plain and a checkpointed copy, each from the same random state: gradients and weights after
/// each step, and the random state after the steps, are the same bit for bit.
TEST(ActivationCheckpointTest, Fp32GradientsWithDropoutAreBitIdenticalOverSteps) {
  Net plain = make_net(false);
  Net wrapped = make_net(true);
  torch::optim::SGD plain_sgd(plain->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  torch::optim::SGD wrapped_sgd(wrapped->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  for (int64_t step = 0; step < 3; ++step) {
    for (auto [net, sgd] : {std::pair{plain, &plain_sgd}, std::pair{wrapped, &wrapped_sgd}}) {
      torch::manual_seed(1000 + step);  // each run's dropout draws from the same state
      sgd->zero_grad();
      net->forward(batch(step)).pow(2).mean().backward();
    }
    expect_bit_identical(values(*plain, true), values(*wrapped, true), "gradient, step " + std::to_string(step));
    plain_sgd.step();
    wrapped_sgd.step();
    expect_bit_identical(values(*plain, false), values(*wrapped, false), "weight, step " + std::to_string(step));
  }
  // The recompute restores the caller's random state: what is drawn next is what the plain run draws next.
  torch::manual_seed(7);
  plain->forward(batch(0)).sum().backward();
  const auto after_plain = torch::rand({4});
  torch::manual_seed(7);
  wrapped->forward(batch(0)).sum().backward();
  EXPECT_TRUE(torch::equal(torch::rand({4}), after_plain));
}

/// amp O1 (autocast bf16: the recompute re-enters it) and O2 (a bf16 model with fp32 masters): the same steps, the
/// same bits as the unwrapped model.
TEST(ActivationCheckpointTest, AmpO1AndO2Bf16AreBitIdenticalToTheUnwrappedModel) {
  for (const amp::OptLevel level : {amp::OptLevel::O1, amp::OptLevel::O2}) {
    SCOPED_TRACE(amp::opt_level_name(level));
    const auto options = amp::Options().opt_level(level).half_dtype(torch::kBFloat16);
    Net plain = make_net(false);
    Net wrapped = make_net(true);
    torch::optim::SGD plain_sgd(plain->parameters(), 0.05);
    torch::optim::SGD wrapped_sgd(wrapped->parameters(), 0.05);
    auto a = amp::initialize(plain, plain_sgd, options);
    auto b = amp::initialize(wrapped, wrapped_sgd, options);
    for (int64_t step = 0; step < 3; ++step) {
      for (auto* run : {&a, &b}) {
        torch::manual_seed(2000 + step);
        run->optimizer.zero_grad();
        auto loss = run->model(batch(step)).pow(2).mean();
        {
          auto scaled = amp::scale_loss(loss, run->optimizer);
          scaled.backward();
        }
        run->optimizer.step();
      }
      expect_bit_identical(values(*plain, false), values(*wrapped, false), "weight, step " + std::to_string(step));
    }
  }
}

// The block runs once in forward (its output's node is the checkpoint's, which keeps only the inputs) and once more
// in backward.
TEST(ActivationCheckpointTest, TheBlockRunsAgainInBackwardAndItsOperationsAreNotInTheGraph) {
  torch::nn::Linear layer(4, 4);
  int calls = 0;
  const auto x = torch::ones({2, 4}, torch::requires_grad());
  auto y = amp::activation_checkpoint(
      [&](const torch::Tensor& t) {
        ++calls;
        return torch::gelu(layer(t));
      },
      x);
  EXPECT_EQ(calls, 1);
  ASSERT_TRUE(y.grad_fn());
  EXPECT_NE(y.grad_fn()->name().find("CheckpointFunction"), std::string::npos) << y.grad_fn()->name();
  y.sum().backward();
  EXPECT_EQ(calls, 2) << "recomputed once, in backward";
  EXPECT_TRUE(layer->weight.grad().defined() && x.grad().defined());
}

// checkpoint_sequential: the same gradients as the Sequential's own forward, the first part (fed the data) run as
// usual, and a bad number of segments refused.
TEST(ActivationCheckpointTest, CheckpointSequentialGivesTheSequentialsGradients) {
  const auto make = [] {
    torch::manual_seed(21);
    return torch::nn::Sequential(torch::nn::Linear(8, 16), torch::nn::GELU(), torch::nn::Dropout(0.2),
                                 torch::nn::Linear(16, 16), torch::nn::Tanh(), torch::nn::Dropout(0.2),
                                 torch::nn::Linear(16, 4));
  };
  torch::nn::Sequential plain = make();
  torch::nn::Sequential wrapped = make();
  for (int segments : {1, 3, 7}) {
    SCOPED_TRACE(segments);
    plain->zero_grad();
    wrapped->zero_grad();
    torch::manual_seed(9);
    plain->forward(batch(1)).pow(2).sum().backward();
    torch::manual_seed(9);
    amp::checkpoint_sequential(wrapped, segments, batch(1)).pow(2).sum().backward();
    expect_bit_identical(values(*plain, true), values(*wrapped, true), "gradient");
  }
  test_util::expect_error(
      [&] { amp::checkpoint_sequential(wrapped, 8, batch(1)); },
      "amp::checkpoint_sequential: segments must be in [1, 7] (the modules of the Sequential), got 8");
}

// A weight used again in the same autocast region, with backward run inside the region, gets its whole gradient.
// (The block runs with autocast's cast cache off, so that a copy cast in the no-grad forward cannot stand in for the
// weight later; this CPU test passes with the cache on too, so it does not tell that guard's effect.)
TEST(ActivationCheckpointTest, AWeightUsedAgainInTheAutocastRegionGetsItsWholeGradient) {
  const auto run = [](bool checkpointed) {
    torch::manual_seed(3);
    torch::nn::Linear layer(8, 8);
    amp::AutocastScope autocast(c10::kCPU, torch::kBFloat16);
    const auto x = torch::randn({4, 8}, torch::requires_grad());
    auto h = checkpointed ? amp::activation_checkpoint(
                                [l = layer.ptr()](const torch::Tensor& t) { return torch::tanh(l->forward(t)); }, x)
                          : torch::tanh(layer(x));
    layer(h).to(torch::kFloat).sum().backward();  // the same weight again, and backward inside the region
    return layer->weight.grad().clone();
  };
  const auto plain = run(false);
  const auto wrapped = run(true);
  EXPECT_TRUE(torch::equal(plain, wrapped)) << "max diff " << (plain - wrapped).abs().max().item<double>();
}

// As PyTorch's reentrant checkpoint: not under torch::autograd::grad (the recompute's backward would leak into the
// parameters' .grad), and no double backward.
TEST(ActivationCheckpointTest, GradAndDoubleBackwardAreRefused) {
  torch::nn::Linear layer(4, 4);
  const auto x = torch::ones({2, 4}, torch::requires_grad());
  const auto fn = [l = layer.ptr()](const torch::Tensor& t) { return torch::tanh(l->forward(t)); };
  auto y = amp::activation_checkpoint(fn, x).sum();
  test_util::expect_error([&] { torch::autograd::grad({y}, {x}); },
                          "amp::activation_checkpoint: not with torch::autograd::grad or backward with inputs");
  EXPECT_FALSE(layer->weight.grad().defined()) << "nothing leaked into the parameters";
  auto z = amp::activation_checkpoint(fn, x).sum();
  test_util::expect_error([&] { z.backward({}, /*retain_graph=*/true, /*create_graph=*/true); },
                          "amp::activation_checkpoint: no double backward (create_graph)");
}

TEST(ActivationCheckpointTest, WithoutTheRngStashDropoutDrawsNewMasks) {
  Net plain = make_net(false);
  Net wrapped = make_net(true);
  wrapped->options.preserve_rng_state = false;
  for (Net net : {plain, wrapped}) {
    torch::manual_seed(5);
    net->forward(batch(0)).pow(2).mean().backward();
  }
  EXPECT_FALSE(torch::equal(plain->up->weight.grad(), wrapped->up->weight.grad()))
      << "the recompute drew other dropout masks than the forward (preserve_rng_state = false)";
}

TEST(ActivationCheckpointTest, MisuseIsOneLine) {
  // No input requires grad: backward would never reach the block.
  torch::nn::Linear layer(4, 4);
  test_util::expect_error(
      [&] {
        amp::activation_checkpoint([&](const torch::Tensor& t) { return layer(t); }, torch::ones({2, 4}));
      },
      "amp::activation_checkpoint: none of the 1 input(s) requires grad");
  // A function that computes something else the second time: refused in backward, naming the output.
  int calls = 0;
  const auto x = torch::ones({2, 4}, torch::requires_grad());
  auto y =
      amp::activation_checkpoint([&](const torch::Tensor& t) { return ++calls == 1 ? layer(t) : layer(t).sum(0); }, x);
  test_util::expect_error([&] { y.sum().backward(); },
                          "amp::activation_checkpoint: output 0 of the recompute is [4] Float, of the forward [2, 4] "
                          "Float: the wrapped function must compute the same thing each time");
  // Evaluation (no grad): the function itself, nothing refused.
  torch::NoGradGuard no_grad;
  EXPECT_TRUE(
      torch::equal(amp::activation_checkpoint([&](const torch::Tensor& t) { return layer(t); }, torch::ones({2, 4})),
                   layer(torch::ones({2, 4}))));
}

}  // namespace
