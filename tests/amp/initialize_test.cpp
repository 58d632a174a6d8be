#include <amp/amp.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "test_util.h"

namespace {

using amp::OptLevel;

// Linear -> BatchNorm -> ReLU -> Linear; records the dtype its first linear computed in.
struct NetImpl : torch::nn::Module {
  NetImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(8, 16));
    bn = register_module("bn", torch::nn::BatchNorm1d(16));
    fc2 = register_module("fc2", torch::nn::Linear(16, 4));
  }
  torch::Tensor forward(torch::Tensor x) {
    auto h = fc1(x);
    hidden_dtype = h.scalar_type();
    return fc2(torch::relu(bn(h)));
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  torch::nn::BatchNorm1d bn{nullptr};
  torch::ScalarType hidden_dtype = torch::kFloat;
};
TORCH_MODULE(Net);

// bf16 on the CPU (autocast's CPU default); dynamic scaling switched on where a test needs the scale to move.
amp::Options cpu_options(OptLevel level) { return amp::Options().opt_level(level).half_dtype(torch::kBFloat16); }

Net make_net(uint64_t seed) {
  torch::manual_seed(seed);
  return Net();
}

torch::Tensor batch(int64_t n, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return torch::randn({n, 8}, gen);
}

void train_step(amp::Model<Net>& model, amp::Optimizer& optimizer, const torch::Tensor& x) {
  optimizer.zero_grad();
  auto loss = model(x).pow(2).mean();
  {
    auto scaled = amp::scale_loss(loss, optimizer);
    scaled.backward();
  }
  optimizer.step();
}

TEST(InitializeTest, O0KeepsEverythingFp32) {
  Net net = make_net(1);
  torch::optim::SGD sgd(net->parameters(), 0.1);
  auto [model, optimizer] = amp::initialize(net, sgd, cpu_options(OptLevel::O0));
  auto out = model(batch(4, 2));
  EXPECT_EQ(out.scalar_type(), torch::kFloat);
  EXPECT_EQ(net->hidden_dtype, torch::kFloat);
  for (const auto& p : net->parameters()) EXPECT_EQ(p.scalar_type(), torch::kFloat);
}

TEST(InitializeTest, O1RunsMatmulsInHalfWithFp32Weights) {
  Net net = make_net(1);
  torch::optim::SGD sgd(net->parameters(), 0.1);
  auto [model, optimizer] = amp::initialize(net, sgd, cpu_options(OptLevel::O1));
  auto out = model(batch(4, 2));
  EXPECT_EQ(net->hidden_dtype, torch::kBFloat16) << "fc1 should have run under autocast";
  EXPECT_EQ(out.scalar_type(), torch::kFloat) << "outputs come back as fp32";
  for (const auto& p : net->parameters()) EXPECT_EQ(p.scalar_type(), torch::kFloat);
  auto loss = out.pow(2).mean();
  {
    auto scaled = amp::scale_loss(loss, optimizer);
    scaled.backward();
  }
  for (const auto& p : net->parameters()) EXPECT_EQ(p.grad().scalar_type(), torch::kFloat);
}

TEST(InitializeTest, O2CastsModelKeepsBatchNormFp32AndUsesFp32Masters) {
  Net net = make_net(1);
  const auto fp32_weight = net->fc1->weight.detach().clone();
  torch::optim::SGD sgd(net->parameters(), 0.1);
  auto [model, optimizer] = amp::initialize(net, sgd, cpu_options(OptLevel::O2));
  EXPECT_EQ(net->fc1->weight.scalar_type(), torch::kBFloat16);
  EXPECT_EQ(net->fc2->bias.scalar_type(), torch::kBFloat16);
  EXPECT_EQ(net->bn->weight.scalar_type(), torch::kFloat);
  EXPECT_EQ(net->bn->running_mean.scalar_type(), torch::kFloat);
  // The optimizer now holds fp32 masters, bit-identical to the original fp32 weights.
  const auto& held = sgd.param_groups()[0].params();
  EXPECT_EQ(held[0].scalar_type(), torch::kFloat);
  EXPECT_FALSE(held[0].is_same(net->fc1->weight));
  EXPECT_TRUE(torch::equal(held[0], fp32_weight));
  auto out = model(batch(4, 2));
  EXPECT_EQ(net->hidden_dtype, torch::kBFloat16);
  EXPECT_EQ(out.scalar_type(), torch::kFloat);
  {
    auto scaled = amp::scale_loss(out.pow(2).mean(), optimizer);
    scaled.backward();
  }
  EXPECT_EQ(held[0].grad().scalar_type(), torch::kFloat) << "gradients reach the masters in fp32";
  optimizer.step();
  EXPECT_TRUE(torch::equal(net->fc1->weight, held[0].to(torch::kBFloat16))) << "model refreshed from masters";
}

TEST(InitializeTest, O3CastsEverythingToHalf) {
  Net net = make_net(1);
  torch::optim::SGD sgd(net->parameters(), 0.1);
  auto [model, optimizer] = amp::initialize(net, sgd, cpu_options(OptLevel::O3));
  for (const auto& p : net->parameters()) EXPECT_EQ(p.scalar_type(), torch::kBFloat16);
  EXPECT_EQ(net->bn->running_var.scalar_type(), torch::kBFloat16);
  EXPECT_TRUE(sgd.param_groups()[0].params()[0].is_same(net->fc1->weight)) << "no masters in O3";
  EXPECT_EQ(model(batch(4, 2)).scalar_type(), torch::kFloat);
}

// O2 (bf16 model, fp32 masters) tracks fp32 training over 100 steps: the two loss curves stay within bf16
// tolerance of each other while both learn.
// Note [O2 training margins]
// A training outcome (Note [bounds on every CPU kernel path], tests/test_util.h): the gap between the curves is the
// bf16 rounding of the model (weights, activations, gradients: 2^-8 each) carried along 100 steps, and another
// kernel path, thread count or seed only rounds differently. So the bounds cover the gap's spread over seeds and
// kernel settings, measured with LTA_O2_TRAINING_SEED (the test prints both gaps) on 2026-12-03, 2-core Intel Xeon VM,
// seeds 1-5 and 7-21, each natively (AVX512, AMX), under ATen default + oneDNN AVX2 and under ATen avx2 + oneDNN
// AVX512_CORE (60 runs): tail gap (mean of the last 10 losses) 0.0000-0.0091, worst per-step gap 0.019-0.098 (seed 20,
// default + AVX2; seed 7: 0.051-0.056). The per-step gap divides by a loss that falls 10-30x, so a rounding that is
// harmless early is a larger fraction late; the old 10% bound sat at the edge of that spread (0.098), so it is now
// 20%, twice the worst measured, and the tail stays at 5%, five times its worst. What they catch is an O2 that does
// not train like fp32 (an update lost or not unscaled changes the tail loss by far more than 5%), not its rounding.
constexpr double kO2TailGap = 0.05;
constexpr double kO2StepGap = 0.2;

uint64_t o2_training_seed() {
  const char* env = std::getenv("LTA_O2_TRAINING_SEED");
  return env != nullptr && *env != '\0' ? std::stoull(env) : 7;
}

TEST(InitializeTest, O2TrainingFollowsFp32Training) {
  const uint64_t seed = o2_training_seed();  // 7: the data below are those the test always used
  Net fp32_net = make_net(seed);
  Net amp_net = make_net(seed);
  torch::optim::SGD fp32_sgd(fp32_net->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  torch::optim::SGD amp_sgd(amp_net->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  auto [model, optimizer] = amp::initialize(amp_net, amp_sgd, cpu_options(OptLevel::O2));
  const auto target = torch::randn({4, 4}, at::make_generator<at::CPUGeneratorImpl>(92 + seed));
  std::vector<double> fp32_curve, amp_curve;
  for (int step = 0; step < 100; ++step) {
    const auto x = batch(32, 1000 * (seed - 6) + static_cast<uint64_t>(step));
    const auto y = torch::mm(x.narrow(1, 0, 4), target);
    fp32_sgd.zero_grad();
    auto l32 = torch::mse_loss(fp32_net->forward(x), y);
    l32.backward();
    fp32_sgd.step();
    optimizer.zero_grad();
    auto l16 = torch::mse_loss(model(x), y);
    {
      auto scaled = amp::scale_loss(l16, optimizer);
      scaled.backward();
    }
    optimizer.step();
    fp32_curve.push_back(l32.item<double>());
    amp_curve.push_back(l16.item<double>());
  }
  auto tail_mean = [](const std::vector<double>& curve) {
    double sum = 0;
    for (size_t i = curve.size() - 10; i < curve.size(); ++i) sum += curve[i];
    return sum / 10;
  };
  EXPECT_LT(tail_mean(fp32_curve), 0.5 * fp32_curve.front()) << "the fp32 reference should have learned";
  EXPECT_NEAR(tail_mean(amp_curve), tail_mean(fp32_curve), kO2TailGap * tail_mean(fp32_curve));
  double worst = 0;
  for (size_t i = 0; i < fp32_curve.size(); ++i) {
    worst = std::max(worst, std::abs(amp_curve[i] - fp32_curve[i]) / fp32_curve[i]);
  }
  EXPECT_LT(worst, kO2StepGap) << "largest relative gap between the two loss curves";
  std::printf(
      "O2 vs fp32, seed %llu: tail gap %.4f (bound %.2f), worst per-step gap %.4f (bound %.2f), fp32 loss "
      "%.4f -> %.4f\n",
      static_cast<unsigned long long>(seed), std::abs(tail_mean(amp_curve) / tail_mean(fp32_curve) - 1), kO2TailGap,
      worst, kO2StepGap, fp32_curve.front(), tail_mean(fp32_curve));
}

// A gradient with an inf makes step() skip: parameters, masters and optimizer state stay bit-identical, and the
// dynamic scale backs off.
TEST(InitializeTest, OverflowSkipsStepLeavingEverythingBitIdentical) {
  Net net = make_net(3);
  torch::optim::Adam adam(net->parameters(), 1e-3);
  auto [model, optimizer] = amp::initialize(net, adam, cpu_options(OptLevel::O2).dynamic_loss_scale());
  train_step(model, optimizer, batch(8, 4));  // creates Adam's state
  const auto masters_before = [&] {
    std::vector<torch::Tensor> v;
    for (const auto& p : adam.param_groups()[0].params()) v.push_back(p.detach().clone());
    return v;
  }();
  std::vector<torch::Tensor> model_before, exp_avg_before;
  for (const auto& p : net->parameters()) model_before.push_back(p.detach().clone());
  for (const auto& p : adam.param_groups()[0].params()) {
    exp_avg_before.push_back(
        static_cast<torch::optim::AdamParamState&>(*adam.state().at(p.unsafeGetTensorImpl())).exp_avg().clone());
  }
  const double scale_before = optimizer.scaler().scale().item<double>();
  auto x = batch(8, 5);
  x[0][0] = std::numeric_limits<float>::infinity();
  train_step(model, optimizer, x);
  const auto& masters = adam.param_groups()[0].params();
  for (size_t i = 0; i < masters.size(); ++i) {
    EXPECT_TRUE(torch::equal(masters[i], masters_before[i])) << "master " << i;
    const auto& st = static_cast<torch::optim::AdamParamState&>(*adam.state().at(masters[i].unsafeGetTensorImpl()));
    EXPECT_TRUE(torch::equal(st.exp_avg(), exp_avg_before[i])) << "exp_avg " << i;
  }
  const auto params = net->parameters();
  for (size_t i = 0; i < params.size(); ++i) EXPECT_TRUE(torch::equal(params[i], model_before[i])) << "param " << i;
  EXPECT_EQ(optimizer.scaler().scale().item<double>(), scale_before / 2);
  const auto d = optimizer.scaler().diagnostics_now();
  EXPECT_TRUE(d.found_inf);
  EXPECT_EQ(d.skipped_steps, 1);
  EXPECT_EQ(optimizer.parameter_name(0, d), "fc1.weight") << "the first non-finite gradient is named";
}

// delay_unscale accumulation over two half-batches equals one backward over the whole batch.
TEST(InitializeTest, DelayedUnscaleAccumulationEqualsOneBigBatch) {
  const auto x = batch(16, 11);
  auto run = [&](bool accumulate) {
    Net net = make_net(5);
    torch::optim::SGD sgd(net->parameters(), 0.1);
    auto [model, optimizer] = amp::initialize(net, sgd, cpu_options(OptLevel::O1));
    net->eval();  // batch norm statistics must not depend on how the batch is split
    optimizer.zero_grad();
    if (accumulate) {
      for (int half = 0; half < 2; ++half) {
        auto loss = model(x.narrow(0, 8 * half, 8)).pow(2).sum();
        auto scaled = amp::scale_loss(loss, optimizer, 0, /*delay_unscale=*/half == 0);
        scaled.backward();
      }
    } else {
      auto scaled = amp::scale_loss(model(x).pow(2).sum(), optimizer);
      scaled.backward();
    }
    std::vector<torch::Tensor> grads;
    for (const auto& p : net->parameters()) grads.push_back(p.grad().clone());
    return grads;
  };
  const auto accumulated = run(true);
  const auto big = run(false);
  for (size_t i = 0; i < big.size(); ++i) {
    // Autocast computes in bf16 (relative precision 2^-8): compare within that, scaled to the gradient's size. Both
    // runs use the same kernels; the split rounds each half-batch's weight gradient to bf16 before the sum, the whole
    // batch once: 2-3 roundings of 2^-8, under 1e-2 on any kernel path (Note [bounds on every CPU kernel path]).
    const double atol = 1e-2 * big[i].abs().max().item<double>();
    EXPECT_TRUE(torch::allclose(accumulated[i], big[i], 1e-2, atol))
        << "gradient " << i << " max abs diff " << (accumulated[i] - big[i]).abs().max().item<double>() << " of max "
        << big[i].abs().max().item<double>();
  }
}

TEST(InitializeTest, TwoLossesKeepSeparateScalesAndSumTheirGradients) {
  Net net = make_net(2);
  torch::optim::SGD sgd(net->parameters(), 0.1);
  auto [model, optimizer] = amp::initialize(net, sgd, cpu_options(OptLevel::O2).dynamic_loss_scale().num_losses(2));
  net->eval();
  auto x = batch(4, 3);
  optimizer.zero_grad();
  auto out = model(x);
  {
    auto scaled = amp::scale_loss(out.sum(), optimizer, 0);
    scaled.backward(/*retain_graph=*/true);
  }
  {
    auto scaled = amp::scale_loss((out * 2).sum(), optimizer, 1);
    scaled.backward();
  }
  // Gradient of sum(out) + sum(2 out) = 3 x gradient of sum(out).
  const auto master = sgd.param_groups()[0].params()[4];  // fc2.weight's master (fc1.w, fc1.b, bn.w, bn.b, fc2.w)
  Net ref_net = make_net(2);
  ref_net->eval();
  ref_net->forward(x).sum().mul(3).backward();
  // bf16 model (O2) against fp32: the activations and the bf16 weights are each rounded once (2^-8), and the
  // gradient of fc2.weight is a sum over 4 rows of products of them: a few 2^-8, far inside 5e-2 (12 units) on any
  // kernel path (Note [bounds on every CPU kernel path]). A lost scale or a missing loss is off by 1/3 or more.
  EXPECT_TRUE(torch::allclose(master.grad(), ref_net->fc2->weight.grad(), 5e-2, 5e-2));
  // Now overflow only loss 1: its scale backs off, loss 0's does not, and the log line says which loss.
  std::vector<std::string> lines;
  optimizer.set_overflow_logger([&](const std::string& line) { lines.push_back(line); });
  optimizer.step();
  optimizer.zero_grad();
  auto x2 = batch(4, 4);
  auto out2 = model(x2);
  {
    auto scaled = amp::scale_loss(out2.sum(), optimizer, 0);
    scaled.backward(true);
  }
  {
    auto scaled = amp::scale_loss(out2.sum() * std::numeric_limits<float>::infinity(), optimizer, 1);
    scaled.backward();
  }
  optimizer.step();
  EXPECT_EQ(optimizer.scaler(0).scale().item<double>(), 65536.0);
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_EQ(lines[0].rfind("amp: gradient overflow in loss_id 1 at step ", 0), 0u) << lines[0];
  EXPECT_EQ(optimizer.scaler(1).scale().item<double>(), 32768.0);
}

std::string temp_path(const std::string& stem) { return "/tmp/lta_" + stem + "_" + std::to_string(::getpid()) + ".pt"; }

// An optimizer that already has state (steps taken, or a plain checkpoint loaded, before initialize): each
// parameter's state moves to its master whole. Re-keying the state map used to read an entry after an insert that
// could rehash the map; the moved-from state then crashed a later save (a model of two parameters did).
TEST(InitializeTest, O2MovesStateTheOptimizerAlreadyHasToTheMasters) {
  torch::manual_seed(1);
  torch::nn::Linear net(4, 3);  // two parameters: moving the second's state grows the map (3 entries at a time)
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  for (int i = 0; i < 2; ++i) {
    sgd.zero_grad();
    net->forward(torch::randn({5, 4})).pow(2).mean().backward();
    sgd.step();
  }
  std::vector<at::Tensor> momentum;  // each parameter's buffer, in the optimizer's order
  for (const auto& p : sgd.param_groups()[0].params()) {
    const auto& state = static_cast<torch::optim::SGDParamState&>(*sgd.state().at(p.unsafeGetTensorImpl()));
    momentum.push_back(state.momentum_buffer().clone());
  }
  auto [model, optimizer] = amp::initialize(net, sgd, cpu_options(OptLevel::O2));
  const auto& held = sgd.param_groups()[0].params();
  ASSERT_EQ(held.size(), momentum.size());
  EXPECT_EQ(sgd.state().size(), momentum.size()) << "no state left under a replaced parameter";
  for (size_t i = 0; i < held.size(); ++i) {
    const auto found = sgd.state().find(held[i].unsafeGetTensorImpl());
    ASSERT_NE(found, sgd.state().end()) << "parameter " << i << "'s state is under what the optimizer holds";
    const auto& state = static_cast<torch::optim::SGDParamState&>(*found->second);
    EXPECT_TRUE(torch::equal(state.momentum_buffer(), momentum[i])) << "parameter " << i;
  }
  const std::string path = temp_path("moved_state");
  amp::save_checkpoint(path, model, optimizer);  // crashed on the moved-from state
  EXPECT_GT(std::ifstream(path, std::ios::binary | std::ios::ate).tellg(), 0);
  std::remove(path.c_str());
}

// The checkpoint recipe: a run interrupted at step 5 and resumed from its checkpoint ends bit-identical to an
// uninterrupted run.
TEST(InitializeTest, ResumeFromCheckpointIsBitIdentical) {
  const std::string path = temp_path("resume");
  const auto options = cpu_options(OptLevel::O2).dynamic_loss_scale().growth_interval(3);
  auto make = [&](Net& net, std::unique_ptr<torch::optim::Adam>& adam) {
    net = make_net(21);
    adam = std::make_unique<torch::optim::Adam>(net->parameters(), 1e-2);
    return amp::initialize(net, *adam, options);
  };
  Net net_a{nullptr};
  std::unique_ptr<torch::optim::Adam> adam_a;
  auto a = make(net_a, adam_a);
  for (int step = 0; step < 10; ++step) {
    if (step == 5) amp::save_checkpoint(path, a.model, a.optimizer);
    train_step(a.model, a.optimizer, batch(8, 300 + step));
  }
  Net net_b{nullptr};
  std::unique_ptr<torch::optim::Adam> adam_b;
  auto b = make(net_b, adam_b);
  amp::load_checkpoint(path, b.model, b.optimizer);
  for (int step = 5; step < 10; ++step) train_step(b.model, b.optimizer, batch(8, 300 + step));
  const auto pa = net_a->parameters(), pb = net_b->parameters();
  for (size_t i = 0; i < pa.size(); ++i) EXPECT_TRUE(torch::equal(pa[i], pb[i])) << "parameter " << i;
  const auto& ma = adam_a->param_groups()[0].params();
  const auto& mb = adam_b->param_groups()[0].params();
  for (size_t i = 0; i < ma.size(); ++i) EXPECT_TRUE(torch::equal(ma[i], mb[i])) << "master " << i;
  EXPECT_EQ(a.optimizer.scaler().scale().item<float>(), b.optimizer.scaler().scale().item<float>());
  std::remove(path.c_str());
}

TEST(InitializeTest, CheckpointFromOtherOptionsOrCorruptFileChangesNothing) {
  const std::string path = temp_path("other");
  {
    Net net = make_net(1);
    torch::optim::SGD sgd(net->parameters(), 0.1);
    auto [model, optimizer] = amp::initialize(net, sgd, cpu_options(OptLevel::O2).dynamic_loss_scale());
    amp::save_checkpoint(path, model, optimizer);
  }
  Net net = make_net(2);
  torch::optim::SGD sgd(net->parameters(), 0.1);
  auto [model, optimizer] = amp::initialize(net, sgd, cpu_options(OptLevel::O2).dynamic_loss_scale().hysteresis(2));
  const auto before = net->fc1->weight.detach().clone();
  try {
    amp::load_checkpoint(path, model, optimizer);
    ADD_FAILURE() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("amp checkpoint was saved with other options"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(torch::equal(net->fc1->weight, before)) << "a refused checkpoint must change nothing";
  { std::ofstream(path, std::ios::binary | std::ios::trunc) << "not a checkpoint"; }
  try {
    amp::load_checkpoint(path, model, optimizer);
    ADD_FAILURE() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("checkpoint '" + path + "': cannot read it as a checkpoint"),
              std::string::npos)
        << e.what();
  }
  EXPECT_TRUE(torch::equal(net->fc1->weight, before));
  std::remove(path.c_str());
}

using test_util::expect_error;

TEST(InitializeTest, BadInputIsNamed) {
  {
    Net net = make_net(1);
    net->fc2->to(torch::kDouble);
    torch::optim::SGD sgd(net->parameters(), 0.1);
    expect_error([&] { amp::initialize(net, sgd, cpu_options(OptLevel::O2)); },
                 "amp::initialize needs fp32 parameters on entry, but 'fc2.weight' is Double");
  }
  {
    Net net = make_net(1);
    auto stranger = torch::zeros({3}, torch::requires_grad());
    torch::optim::SGD sgd(std::vector<torch::Tensor>{net->fc1->weight, stranger}, 0.1);
    expect_error([&] { amp::initialize(net, sgd, cpu_options(OptLevel::O2)); },
                 "optimizer parameter 1 (shape [3]) is not a parameter of the model");
  }
  {
    Net net = make_net(1);
    torch::optim::SGD sgd(net->parameters(), 0.1);
    auto first = amp::initialize(net, sgd, cpu_options(OptLevel::O1));
    expect_error([&] { amp::initialize(net, sgd, cpu_options(OptLevel::O1)); },
                 "amp::initialize was already called with this optimizer");
    expect_error([&] { amp::scale_loss(torch::ones({}), first.optimizer, 3); },
                 "loss_id 3 is out of range: initialize was called with num_losses=1");
  }
}

struct FakeDataParallelImpl : torch::nn::Module {
  FakeDataParallelImpl() { fc = register_module("fc", torch::nn::Linear(2, 2)); }
  torch::Tensor forward(torch::Tensor x) { return fc(x); }
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(FakeDataParallel);

TEST(InitializeTest, RefusesModelAlreadyWrappedForDataParallel) {
  FakeDataParallel wrapped;
  torch::optim::SGD sgd(wrapped->parameters(), 0.1);
  expect_error([&] { amp::initialize(wrapped, sgd, cpu_options(OptLevel::O1)); },
               "already wrapped for data parallel training");
}

TEST(InitializeTest, OverflowsAreLoggedRateLimitedAndAStalledFloorIsAnError) {
  Net net = make_net(1);
  torch::optim::SGD sgd(net->parameters(), 0.1);
  auto [model, optimizer] =
      amp::initialize(net, sgd, cpu_options(OptLevel::O2).dynamic_loss_scale().init_scale(4).max_overflows_at_floor(5));
  std::vector<std::string> lines;
  optimizer.set_overflow_logger([&](const std::string& line) { lines.push_back(line); });
  auto x = batch(4, 1);
  x[1][2] = std::numeric_limits<float>::quiet_NaN();
  bool threw = false;
  for (int step = 0; step < 20 && !threw; ++step) {
    try {
      train_step(model, optimizer, x);
    } catch (const c10::Error& e) {
      threw = true;
      EXPECT_NE(std::string(e.what()).find("amp: the gradients have overflowed for 5 consecutive steps with the loss "
                                           "scale at the floor (1)"),
                std::string::npos)
          << e.what();
      EXPECT_NE(std::string(e.what()).find("'fc1.weight'"), std::string::npos) << e.what();
    }
  }
  EXPECT_TRUE(threw) << "every step overflows with the scale at its floor: the scaler must give up";
  ASSERT_EQ(lines.size(), 1u) << "overflow lines are rate-limited";
  EXPECT_NE(lines[0].find("first non-finite gradient in 'fc1.weight'"), std::string::npos) << lines[0];
  // One loss: no loss id in the line ("loss 0" would read as a loss value of 0).
  EXPECT_EQ(lines[0].rfind("amp: gradient overflow at step 1: loss scale now ", 0), 0u) << lines[0];
}

}  // namespace
