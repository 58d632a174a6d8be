// amp::activation_checkpoint: a block that keeps only its inputs and runs again in backward gives the gradients of the
// unwrapped block bit for bit (dropout included: the random state is stashed), under FP32 and amp O1/O2/O3 bf16, over
// several steps; misuse is one line.
#include <amp/recompute/activation_checkpoint.h>
#include <amp/recompute/checkpointed.h>

#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include <amp/amp.h>
#include <ddp/sync_batch_norm.h>
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

/// amp O1 (autocast bf16: the recompute re-enters it), O2 (a bf16 model with fp32 masters) and O3 (pure bf16): the same
/// steps, the same bits as the unwrapped model.
TEST(ActivationCheckpointTest, AmpO1O2AndO3Bf16AreBitIdenticalToTheUnwrappedModel) {
  for (const amp::OptLevel level : {amp::OptLevel::O1, amp::OptLevel::O2, amp::OptLevel::O3}) {
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

/// A block of two FP8 layers under amp O2 + FP8, wrapped and not. The wrapped block's first forward runs without
/// grad, which casts with the current scales and records no amax (Float8Linear records under grad only); the recompute
/// records them, once, into the same slot of the step, and the histories roll only at the optimizer's step. So the
/// weights, the amax histories and the scales are those of the unwrapped model, bit for bit, for delayed and current
/// scaling.
struct Fp8NetImpl : torch::nn::Module {
  Fp8NetImpl() {
    in = register_module("in", torch::nn::Linear(16, 32));
    a = register_module("a", amp::Float8Linear(32, 64));
    b = register_module("b", amp::Float8Linear(64, 32));
    out = register_module("out", torch::nn::Linear(32, 4));
  }
  torch::Tensor block(const torch::Tensor& x) { return b(torch::gelu(a(x))); }
  torch::Tensor forward(torch::Tensor x) {
    auto h = torch::relu(in(x));
    h = checkpointed ? amp::activation_checkpoint([this](const torch::Tensor& t) { return block(t); }, h) : block(h);
    return out(h);
  }
  torch::nn::Linear in{nullptr}, out{nullptr};
  amp::Float8Linear a{nullptr}, b{nullptr};
  bool checkpointed = false;
};
TORCH_MODULE(Fp8Net);

TEST(ActivationCheckpointTest, Fp8LayersRecordEachAmaxOnceAndTrainLikeTheUnwrappedModel) {
  for (const amp::Fp8Scaling scaling : {amp::Fp8Scaling::kDelayed, amp::Fp8Scaling::kCurrent}) {
    SCOPED_TRACE(scaling == amp::Fp8Scaling::kDelayed ? "delayed" : "current");
    const auto options = amp::Options()
                             .opt_level(amp::OptLevel::O2)
                             .half_dtype(torch::kBFloat16)
                             .fp8(amp::Fp8Recipe().scaling(scaling).amax_history_len(4));
    std::vector<Fp8Net> nets;
    std::vector<std::unique_ptr<torch::optim::SGD>> sgds;
    std::vector<amp::Initialized<Fp8Net>> runs;
    for (bool checkpointed : {false, true}) {
      torch::manual_seed(3);
      nets.emplace_back();
      nets.back()->checkpointed = checkpointed;
      sgds.push_back(std::make_unique<torch::optim::SGD>(nets.back()->parameters(), 0.05));
      runs.push_back(amp::initialize(nets.back(), *sgds.back(), options));
    }
    for (int64_t step = 0; step < 3; ++step) {
      for (auto& run : runs) {
        run.optimizer.zero_grad();
        auto loss =
            run.model(torch::randn({16, 16}, at::make_generator<at::CPUGeneratorImpl>(300 + step))).pow(2).mean();
        {
          auto scaled = amp::scale_loss(loss, run.optimizer);
          scaled.backward();
        }
        run.optimizer.step();
      }
      const std::string at = "step " + std::to_string(step);
      expect_bit_identical(values(*nets[0], false), values(*nets[1], false), "weight, " + at);
      const auto state = [](const amp::Float8Linear& layer) {
        const amp::Fp8Meta& meta = layer->fp8_meta();
        return std::vector<torch::Tensor>{meta.history, meta.scale, meta.scale_inv};
      };
      expect_bit_identical(state(nets[0]->a), state(nets[1]->a), "layer a's FP8 state, " + at);
      expect_bit_identical(state(nets[0]->b), state(nets[1]->b), "layer b's FP8 state, " + at);
    }
    // The histories moved: the comparison above compared amaxes, not zeros.
    EXPECT_GT(nets[1]->a->fp8_meta().history.abs().sum().item<float>(), 0.0f);
  }
}

/// amp::Checkpointed around a block (its own parameter, submodules, dropout) inside a Sequential model: the same names
/// as the unwrapped model (its archive loads into the wrapped one), the same gradients and weights over three SGD steps
/// with dropout, and eval() reaches the wrapped block's dropout.
struct BlockImpl : torch::nn::Module {
  BlockImpl() {
    up = register_module("up", torch::nn::Linear(16, 32));
    dropout = register_module("dropout", torch::nn::Dropout(0.3));
    down = register_module("down", torch::nn::Linear(32, 16));
    scale = register_parameter("scale", torch::ones({16}));
  }
  torch::Tensor forward(const torch::Tensor& x) { return down(dropout(torch::gelu(up(x)))) * scale; }
  torch::nn::Linear up{nullptr}, down{nullptr};
  torch::nn::Dropout dropout{nullptr};
  torch::Tensor scale;
};
TORCH_MODULE(Block);

torch::nn::Sequential sequential_model(bool wrapped) {
  torch::manual_seed(21);
  Block block;
  torch::nn::Sequential model(torch::nn::Linear(8, 16), torch::nn::ReLU());
  if (wrapped) {
    model->push_back(amp::Checkpointed(block));
  } else {
    model->push_back(block);
  }
  model->push_back(torch::nn::Linear(16, 4));
  return model;
}

TEST(ActivationCheckpointTest, CheckpointedWrapsAModuleUnderItsOwnNames) {
  torch::nn::Sequential plain = sequential_model(false);
  torch::nn::Sequential wrapped = sequential_model(true);
  std::vector<std::string> plain_names, wrapped_names;
  for (const auto& p : plain->named_parameters()) plain_names.push_back(p.key());
  for (const auto& p : wrapped->named_parameters()) wrapped_names.push_back(p.key());
  EXPECT_EQ(wrapped_names, plain_names);
  EXPECT_EQ(plain_names[2], "2.scale");
  EXPECT_EQ(plain_names[3], "2.up.weight");

  // The unwrapped model's archive loads into the wrapped one (here: weights that differ from its own).
  torch::nn::Sequential other = sequential_model(false);
  for (const auto& p : other->parameters()) p.data().uniform_(-1, 1);
  std::stringstream bytes;
  {
    torch::serialize::OutputArchive archive;
    other->save(archive);
    archive.save_to(bytes);
  }
  torch::serialize::InputArchive archive;
  archive.load_from(bytes);
  torch::nn::Sequential loaded = sequential_model(true);
  loaded->load(archive);
  expect_bit_identical(values(*loaded, false), values(*other, false), "loaded weight");

  torch::optim::SGD plain_sgd(plain->parameters(), 0.1);
  torch::optim::SGD wrapped_sgd(wrapped->parameters(), 0.1);
  for (int64_t step = 0; step < 3; ++step) {
    for (auto [model, sgd] : {std::pair{plain, &plain_sgd}, std::pair{wrapped, &wrapped_sgd}}) {
      torch::manual_seed(500 + step);
      sgd->zero_grad();
      model->forward(batch(step)).pow(2).mean().backward();
      sgd->step();
    }
    expect_bit_identical(values(*plain, false), values(*wrapped, false), "weight, step " + std::to_string(step));
  }
  // eval(): no dropout in the wrapped block (the same output twice, and the unwrapped model's).
  wrapped->eval();
  plain->eval();
  EXPECT_FALSE(wrapped[2]->as<amp::CheckpointedImpl>()->wrapped()->is_training());
  const auto x = batch(9);
  EXPECT_TRUE(torch::equal(wrapped->forward(x), plain->forward(x)));
  std::ostringstream printed;
  printed << *wrapped[2];
  EXPECT_EQ(printed.str().rfind("amp::Checkpointed(", 0), 0u) << printed.str();

  // A single norm or FP8 layer is refused (amp::initialize and convert_sync_batch_norm find those by type); a block
  // whose BatchNorm is swapped after wrapping is refused at forward.
  try {
    amp::Checkpointed bn_alone(torch::nn::BatchNorm1d(4));
    ADD_FAILURE() << "a lone BatchNorm was wrapped";
  } catch (const c10::Error& e) {
    EXPECT_EQ(std::string(e.what_without_backtrace()),
              "amp::Checkpointed: wrap a block, not a single torch::nn::BatchNorm1dImpl: amp::initialize and "
              "convert_sync_batch_norm find such a layer by its type, which the wrapper hides");
  }
  amp::Checkpointed with_bn(torch::nn::Sequential(torch::nn::Linear(4, 4), torch::nn::BatchNorm1d(4)));
  torch::nn::Sequential parent(with_bn);
  ddp::convert_sync_batch_norm(parent.ptr(), std::nullopt, [](const std::string&) {});
  try {
    parent->forward(torch::randn({3, 4}, torch::requires_grad()));
    ADD_FAILURE() << "a BatchNorm converted after wrapping went unnoticed";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("submodule '1' was replaced after wrapping"),
              std::string::npos)
        << e.what_without_backtrace();
  }

  // A Sequential wraps too (its forward is a template: the wrapper calls it with one tensor).
  amp::Checkpointed seq(torch::nn::Sequential(torch::nn::Linear(4, 4), torch::nn::Tanh()));
  const auto in = torch::randn({2, 4}, torch::requires_grad());
  seq->forward(in).sum().backward();
  EXPECT_TRUE(in.grad().defined() && seq->named_parameters()["0.weight"].grad().defined());
}

/// On a GPU: dropout draws from the CUDA generator of the input's device, which the checkpoint stashes and restores;
/// FP32 and amp O1 (CUDA autocast, bf16). Three SGD steps, weights bit-identical to the unwrapped model's, and the
/// caller's CUDA random state after backward the same as without checkpointing. Never run on a GPU yet
/// (scripts/gpu_check.sh runs it in its first group).
TEST(ActivationCheckpointCudaTest, DropoutAndAutocastOnTheGpuAreBitIdenticalToTheUnwrappedModel) {
  LTA_REQUIRE_CUDA();
  const torch::Device cuda(torch::kCUDA, 0);
  for (const amp::OptLevel level : {amp::OptLevel::O0, amp::OptLevel::O1}) {
    SCOPED_TRACE(amp::opt_level_name(level));
    const auto options = amp::Options().opt_level(level).half_dtype(torch::kBFloat16);
    Net plain = make_net(false);
    Net wrapped = make_net(true);
    plain->to(cuda);
    wrapped->to(cuda);
    torch::optim::SGD plain_sgd(plain->parameters(), 0.05);
    torch::optim::SGD wrapped_sgd(wrapped->parameters(), 0.05);
    auto a = amp::initialize(plain, plain_sgd, options);
    auto b = amp::initialize(wrapped, wrapped_sgd, options);
    std::vector<torch::Tensor> after;
    for (int64_t step = 0; step < 3; ++step) {
      for (auto* run : {&a, &b}) {
        torch::manual_seed(3000 + step);  // the CUDA generators too
        run->optimizer.zero_grad();
        auto loss = run->model(batch(step).to(cuda)).pow(2).mean();
        {
          auto scaled = amp::scale_loss(loss, run->optimizer);
          scaled.backward();
        }
        run->optimizer.step();
        after.push_back(torch::rand({8}, torch::TensorOptions().device(cuda)));
      }
      expect_bit_identical(values(*plain, false), values(*wrapped, false), "weight, step " + std::to_string(step));
      EXPECT_TRUE(torch::equal(after[after.size() - 2], after.back())) << "the CUDA random state after step " << step;
    }
  }
}

}  // namespace
