// CUDA graph capture of the amp step (Note [capture-safe step] in kernels/capture.h). What the library decides
// while a stream captures is tested on any machine through kernels::testing::SimulatedCapture; the capture itself
// needs a GPU.

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include <amp/amp.h>
#include <amp/optim/device_lr.h>
#include <amp/optim/fused_optimizers.h>
#include <gtest/gtest.h>
#include <kernels/capture.h>
#include <kernels/multi_tensor/l2_norm.h>
#include <torch/torch.h>
#ifdef LIBTORCH_AMP_WITH_CUDA
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include "test_util.h"

namespace {

using test_util::expect_error;

struct TinyImpl : torch::nn::Module {
  TinyImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(16, 32));
    fc2 = register_module("fc2", torch::nn::Linear(32, 8));
  }
  torch::Tensor forward(torch::Tensor x) { return fc2(torch::relu(fc1(x))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(Tiny);

Tiny make_tiny(uint64_t seed, const torch::Device& device) {
  torch::manual_seed(seed);
  Tiny net;
  net->to(device);
  return net;
}

torch::Tensor input_of(int64_t step, const torch::Device& device) {
  return torch::randn({8, 16}, at::make_generator<at::CPUGeneratorImpl>(1000 + step)).to(device);
}

TEST(DeviceLrTest, WritesOnlyWhenTheHostValueChanged) {
  at::Tensor lr;
  double written = std::numeric_limits<double>::quiet_NaN();
  amp::detail::update_device_lr(lr, written, 0.5, torch::kCPU, false, "test", 0);
  ASSERT_TRUE(lr.defined());
  EXPECT_EQ(lr.item<float>(), 0.5f);
  const auto version = lr._version();
  amp::detail::update_device_lr(lr, written, 0.5, torch::kCPU, false, "test", 0);
  EXPECT_EQ(lr._version(), version) << "an unchanged lr was written again";
  amp::detail::update_device_lr(lr, written, 0.25, torch::kCPU, false, "test", 0);
  EXPECT_GT(lr._version(), version);
  EXPECT_EQ(lr.item<float>(), 0.25f);
}

TEST(DeviceLrTest, CaptureNeitherWritesNorCreatesAndNamesTheFix) {
  at::Tensor lr;
  double written = std::numeric_limits<double>::quiet_NaN();
  expect_error([&] { amp::detail::update_device_lr(lr, written, 0.5, torch::kCPU, true, "FusedAdamW", 2); },
               "param group 2's learning rate is 0.5 but its device copy does not exist yet");
  EXPECT_FALSE(lr.defined());
  amp::detail::update_device_lr(lr, written, 0.5, torch::kCPU, false, "FusedAdamW", 2);
  const auto version = lr._version();
  amp::detail::update_device_lr(lr, written, 0.5, torch::kCPU, true, "FusedAdamW", 2);  // current: fine
  expect_error([&] { amp::detail::update_device_lr(lr, written, 0.125, torch::kCPU, true, "FusedAdamW", 2); },
               "but its device copy holds 0.5");
  expect_error([&] { amp::detail::update_device_lr(lr, written, 0.125, torch::kCPU, true, "FusedAdamW", 2); },
               "call sync_lr()");
  EXPECT_EQ(lr._version(), version);
  EXPECT_EQ(lr.item<float>(), 0.5f);
}

// A scheduler's new lr reaches a (simulated) captured step only through sync_lr(); the result is then the same as
// an eager step with that lr.
TEST(CaptureDecisionTest, FusedStepUnderCaptureUsesSyncedLrAndRefusesAnUnsyncedOne) {
  Tiny a = make_tiny(1, torch::kCPU), b = make_tiny(1, torch::kCPU);
  amp::FusedAdamW fa(a->parameters(), amp::FusedAdamOptions(1e-2));
  amp::FusedAdamW fb(b->parameters(), amp::FusedAdamOptions(1e-2));
  auto step_both = [&](int64_t s, bool capture_a) {
    const auto x = input_of(s, torch::kCPU);
    fa.zero_grad();
    fb.zero_grad();
    a->forward(x).pow(2).mean().backward();
    b->forward(x).pow(2).mean().backward();
    if (capture_a) {
      kernels::testing::SimulatedCapture capture;
      fa.step();
    } else {
      fa.step();
    }
    fb.step();
  };
  step_both(0, false);  // warm-up: creates the state and the device lr
  step_both(1, true);   // lr unchanged: capturable
  fa.param_groups()[0].options().set_lr(3e-3);
  fb.param_groups()[0].options().set_lr(3e-3);
  const auto x = input_of(2, torch::kCPU);
  fa.zero_grad();
  a->forward(x).pow(2).mean().backward();
  {
    kernels::testing::SimulatedCapture capture;
    expect_error([&] { fa.step(); }, "call sync_lr()");
    expect_error([&] { fa.sync_lr(); }, "FusedOptimizer::sync_lr() cannot run while a CUDA graph is being captured");
  }
  fa.sync_lr();
  step_both(2, true);
  const auto pa = a->parameters(), pb = b->parameters();
  for (size_t i = 0; i < pa.size(); ++i) EXPECT_TRUE(torch::equal(pa[i], pb[i])) << "parameter " << i;
}

TEST(CaptureDecisionTest, AmpStepWithAPlainOptimizerIsRefusedWhileCapturing) {
  Tiny net = make_tiny(2, torch::kCPU);
  torch::optim::SGD sgd(net->parameters(), 0.1);
  auto [model, optimizer] =
      amp::initialize(net, sgd, amp::Options().opt_level(amp::OptLevel::O2).half_dtype(torch::kBFloat16));
  {
    auto scaled = amp::scale_loss(model(input_of(0, torch::kCPU)).pow(2).mean(), optimizer);
    scaled.backward();
  }
  kernels::testing::SimulatedCapture capture;
  expect_error([&] { optimizer.step(); }, "plain torch::optim optimizer cannot be captured in a CUDA graph");
}

// While capturing, the scope end and the step take no diagnostics snapshot (no copy to the host, no event) and read
// nothing back; the next diagnostics() outside the capture takes it, and every later read starts a fresh one.
TEST(CaptureDecisionTest, DiagnosticsAreTakenLazilyOutsideTheCapture) {
  Tiny net = make_tiny(3, torch::kCPU);
  amp::FusedAdamW adamw(net->parameters(), amp::FusedAdamOptions(1e-3));
  auto [model, optimizer] = amp::initialize(
      net, adamw,
      amp::Options().opt_level(amp::OptLevel::O2).half_dtype(torch::kBFloat16).dynamic_loss_scale().init_scale(1024.0));
  auto train_step = [&, &model = model, &optimizer = optimizer](int64_t s, bool plant_inf) {
    optimizer.zero_grad();
    auto x = input_of(s, torch::kCPU);
    if (plant_inf) x[0][0] = std::numeric_limits<float>::infinity();
    {
      auto scaled = amp::scale_loss(model(x).pow(2).mean(), optimizer);
      scaled.backward();
    }
    optimizer.step();
  };
  train_step(0, false);
  const amp::ScalerDiagnostics before = optimizer.scaler().diagnostics_now();
  EXPECT_EQ(before.step, 1);
  EXPECT_EQ(before.scale, 1024.0);
  {
    kernels::testing::SimulatedCapture capture;
    train_step(1, /*plant_inf=*/true);  // overflows: the scale halves on the device
    const amp::ScalerDiagnostics during = optimizer.scaler().diagnostics();
    EXPECT_EQ(during.step, before.step) << "a snapshot was read while capturing";
    expect_error([&] { optimizer.scaler().diagnostics_now(); },
                 "LossScaler::diagnostics_now() cannot run while a CUDA graph is being captured");
  }
  const amp::ScalerDiagnostics after = optimizer.scaler().diagnostics();
  EXPECT_EQ(after.scale, 512.0);
  EXPECT_TRUE(after.found_inf);
  EXPECT_EQ(after.skipped_steps, 1);
  // Replays change the device state without host code: simulate one by a device-side change of the scale.
  optimizer.scaler().scale().fill_(256.0);
  optimizer.scaler().diagnostics();
  EXPECT_EQ(optimizer.scaler().diagnostics().scale, 256.0) << "reads after a capture must take fresh snapshots";
}

// The whole O2 step captured in a CUDA graph: forward, scale_loss scope (unscale into fp32 master gradients), clip,
// FusedAdamW step, scale update. 20 replays with a changing lr and an inf planted in one of them must match 20
// eager steps bit for bit.
TEST(AmpCudaGraphTest, CapturedO2StepMatchesEagerBitForBit) {
  LTA_REQUIRE_CUDA();
#ifdef LIBTORCH_AMP_WITH_CUDA
  const torch::Device device(torch::kCUDA, 0);
  constexpr int kWarmupSteps = 3;
  constexpr int kReplays = 20;
  constexpr int kInfReplay = 7;
  constexpr double kMaxNorm = 1.0;
  auto lr_at = [](int step) { return 1e-3 * (1.0 + 0.1 * step); };
  auto options = [] { return amp::Options().opt_level(amp::OptLevel::O2).half_dtype(torch::kHalf).init_scale(1024.0); };
  auto data_at = [&](int step) {
    auto x = input_of(step, device);
    if (step == kWarmupSteps + kInfReplay) x[0][3] = std::numeric_limits<float>::infinity();
    return x;
  };
  // Both runs on the same side stream (graphs cannot be captured on the default stream).
  const c10::cuda::CUDAStream stream = c10::cuda::getStreamFromPool(false, device.index());
  const c10::cuda::CUDAStreamGuard on_stream(stream);

  Tiny eager_net = make_tiny(5, device), graph_net = make_tiny(5, device);
  amp::FusedAdamW eager_opt(eager_net->parameters(), amp::FusedAdamOptions(lr_at(0)));
  amp::FusedAdamW graph_opt(graph_net->parameters(), amp::FusedAdamOptions(lr_at(0)));
  auto eager = amp::initialize(eager_net, eager_opt, options());
  auto graphed = amp::initialize(graph_net, graph_opt, options());

  torch::Tensor static_x = data_at(0).clone();
  auto step_body = [&](auto& model, amp::Optimizer& optimizer, const torch::Tensor& x) {
    optimizer.zero_grad();
    {
      auto scaled = amp::scale_loss(model(x).pow(2).mean(), optimizer);
      scaled.backward();
    }
    amp::clip_grad_norm_(optimizer, kMaxNorm);
    optimizer.step();
  };
  for (int s = 0; s < kWarmupSteps + kReplays; ++s) {
    eager_opt.param_groups()[0].options().set_lr(lr_at(s));
    step_body(eager.model, eager.optimizer, data_at(s));
  }
  // Graphed: warm-up steps run eagerly (they create the optimizer state and the device lr), then one capture.
  for (int s = 0; s < kWarmupSteps; ++s) {
    graph_opt.param_groups()[0].options().set_lr(lr_at(s));
    static_x.copy_(data_at(s));
    step_body(graphed.model, graphed.optimizer, static_x);
  }
  at::cuda::CUDAGraph graph;
  graph_opt.param_groups()[0].options().set_lr(lr_at(kWarmupSteps));
  graph_opt.sync_lr();
  static_x.copy_(data_at(kWarmupSteps));
  graph.capture_begin();
  step_body(graphed.model, graphed.optimizer, static_x);
  graph.capture_end();  // capture runs nothing: every step, the first included, is a replay
  for (int r = 0; r < kReplays; ++r) {
    const int s = kWarmupSteps + r;
    graph_opt.param_groups()[0].options().set_lr(lr_at(s));
    graph_opt.sync_lr();
    static_x.copy_(data_at(s));
    graph.replay();
  }
  stream.synchronize();
  const auto pe = eager_net->parameters(), pg = graph_net->parameters();
  for (size_t i = 0; i < pe.size(); ++i) EXPECT_TRUE(torch::equal(pe[i], pg[i])) << "model parameter " << i;
  const auto me = eager_opt.param_groups()[0].params(), mg = graph_opt.param_groups()[0].params();
  for (size_t i = 0; i < me.size(); ++i) EXPECT_TRUE(torch::equal(me[i], mg[i])) << "fp32 master " << i;
  EXPECT_TRUE(torch::equal(eager.optimizer.scaler().scale(), graphed.optimizer.scaler().scale()));
  const amp::ScalerDiagnostics d = graphed.optimizer.scaler().diagnostics_now();
  EXPECT_EQ(d.skipped_steps, 1) << "the planted inf must skip exactly one replayed step";
  EXPECT_EQ(d.scale, eager.optimizer.scaler().diagnostics_now().scale);
#else
  GTEST_SKIP() << "libtorch_amp was built without CUDA (LIBTORCH_AMP_CUDA=OFF)";
#endif
}

}  // namespace
