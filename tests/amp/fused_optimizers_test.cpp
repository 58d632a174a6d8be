#include <amp/optim/fused_optimizers.h>

#include <algorithm>
#include <cstdio>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include <amp/amp.h>
#include <gtest/gtest.h>
#include <torch/torch.h>
#ifdef LIBTORCH_AMP_WITH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#endif

#include "test_util.h"

namespace {

struct MlpImpl : torch::nn::Module {
  MlpImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(6, 12));
    ln = register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({12})));
    fc2 = register_module("fc2", torch::nn::Linear(12, 3));
  }
  torch::Tensor forward(torch::Tensor x) { return fc2(torch::gelu(ln(fc1(x)))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  torch::nn::LayerNorm ln{nullptr};
};
TORCH_MODULE(Mlp);

Mlp make_mlp(uint64_t seed) {
  torch::manual_seed(seed);
  return Mlp();
}

torch::Tensor batch(uint64_t seed) { return torch::randn({16, 6}, at::make_generator<at::CPUGeneratorImpl>(seed)); }

/// The optimizer's state as its checkpoint holds it, read back.
torch::serialize::InputArchive saved(const torch::optim::Optimizer& optimizer) {
  torch::serialize::OutputArchive out;
  optimizer.save(out);
  std::ostringstream bytes;
  out.save_to(bytes);
  torch::serialize::InputArchive in;
  std::istringstream stream(bytes.str());
  in.load_from(stream);
  return in;
}

std::vector<torch::Tensor> snapshot(const std::vector<torch::Tensor>& tensors) {
  std::vector<torch::Tensor> out;
  for (const auto& t : tensors) out.push_back(t.detach().clone());
  return out;
}

// Bounds of these comparisons (fp32): both sides see bit-identical gradients (the same model and kernels); the
// updates differ by the order of fp32 operations (our twins vs ATen's ops, FMA or not per vector width: Note [bounds
// on every CPU kernel path], tests/test_util.h), a few ulps per step: over 10 steps well inside 1e-5 (+ 1e-6 near 0).
TEST(FusedOptimizerTest, FusedAdamWFollowsTorchAdamW) {
  Mlp a = make_mlp(3), b = make_mlp(3);
  amp::FusedAdamW fused(a->parameters(), amp::FusedAdamOptions(1e-2).weight_decay(0.05));
  torch::optim::AdamW reference(b->parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.05));
  for (int step = 0; step < 10; ++step) {
    const auto x = batch(step);
    fused.zero_grad();
    reference.zero_grad();
    a->forward(x).pow(2).mean().backward();
    b->forward(x).pow(2).mean().backward();
    fused.step();
    reference.step();
  }
  const auto pa = a->parameters(), pb = b->parameters();
  for (size_t i = 0; i < pa.size(); ++i) EXPECT_TRUE(torch::allclose(pa[i], pb[i], 1e-5, 1e-6)) << "parameter " << i;
}

TEST(FusedOptimizerTest, FusedSgdFollowsTorchSgd) {
  Mlp a = make_mlp(4), b = make_mlp(4);
  amp::FusedSGD fused(a->parameters(), amp::FusedSgdOptions(0.1).momentum(0.9).nesterov(true).weight_decay(1e-3));
  torch::optim::SGD reference(b->parameters(),
                              torch::optim::SGDOptions(0.1).momentum(0.9).nesterov(true).weight_decay(1e-3));
  for (int step = 0; step < 10; ++step) {
    const auto x = batch(100 + step);
    fused.zero_grad();
    reference.zero_grad();
    a->forward(x).pow(2).mean().backward();
    b->forward(x).pow(2).mean().backward();
    fused.step();
    reference.step();
  }
  const auto pa = a->parameters(), pb = b->parameters();
  for (size_t i = 0; i < pa.size(); ++i) EXPECT_TRUE(torch::allclose(pa[i], pb[i], 1e-5, 1e-6)) << "parameter " << i;
}

amp::Options o2_bf16() {
  return amp::Options().opt_level(amp::OptLevel::O2).half_dtype(torch::kBFloat16).dynamic_loss_scale();
}

void amp_step(amp::Model<Mlp>& model, amp::Optimizer& optimizer, const torch::Tensor& x) {
  optimizer.zero_grad();
  auto loss = model(x).pow(2).mean();
  {
    auto scaled = amp::scale_loss(loss, optimizer);
    scaled.backward();
  }
  optimizer.step();
}

// Under O2 the fused optimizer updates the fp32 masters and writes the bf16 model in the same pass; an overflow
// is skipped on the device with everything bit-identical.
TEST(FusedOptimizerTest, AmpO2WithFusedAdamWUpdatesModelInTheSamePassAndSkipsOnOverflow) {
  Mlp net = make_mlp(5);
  amp::FusedAdamW adam(net->parameters(), amp::FusedAdamOptions(1e-2));
  auto [model, optimizer] = amp::initialize(net, adam, o2_bf16());
  amp_step(model, optimizer, batch(1));
  const auto& masters = adam.param_groups()[0].params();
  EXPECT_TRUE(torch::equal(net->fc1->weight, masters[0].to(torch::kBFloat16)));
  EXPECT_EQ(net->ln->weight.scalar_type(), torch::kBFloat16) << "LayerNorm is cast in O2 unless keep_layernorm_fp32";
  EXPECT_TRUE(torch::equal(net->ln->weight, masters[2].to(torch::kBFloat16)));

  const auto model_before = snapshot(net->parameters());
  const auto masters_before = snapshot(masters);
  torch::serialize::InputArchive state_before = saved(adam);
  auto x = batch(2);
  x[3][1] = std::numeric_limits<float>::infinity();
  amp_step(model, optimizer, x);
  const auto params = net->parameters();
  for (size_t i = 0; i < params.size(); ++i) EXPECT_TRUE(torch::equal(params[i], model_before[i])) << "param " << i;
  for (size_t i = 0; i < masters.size(); ++i)
    EXPECT_TRUE(torch::equal(masters[i], masters_before[i])) << "master " << i;
  EXPECT_EQ(optimizer.scaler().scale().item<double>(), 32768.0);
  // The per-parameter state, step counts included, did not advance either.
  torch::serialize::InputArchive state_after = saved(adam);
  for (size_t i = 0; i < masters.size(); ++i) {
    for (const char* field : {"step", "exp_avg", "exp_avg_sq"}) {
      const std::string key = std::string("group0.") + field + "." + std::to_string(i);
      torch::Tensor before, after;
      ASSERT_TRUE(state_before.try_read(key, before) && state_after.try_read(key, after)) << key;
      EXPECT_TRUE(torch::equal(before, after)) << key;
    }
  }
}

// FusedAdam is torch::optim::Adam (L2 weight decay), FusedAdamW torch::optim::AdamW (decoupled), with the same
// options object: FusedAdamOptions does not make FusedAdam decoupled by default.
TEST(FusedOptimizerTest, FusedAdamIsAdamAndFusedAdamWIsAdamW) {
  Mlp ours_adam = make_mlp(10), ours_adamw = make_mlp(10), ref_adam = make_mlp(10), ref_adamw = make_mlp(10);
  const auto options = amp::FusedAdamOptions(1e-2).weight_decay(0.1);
  amp::FusedAdam fused_adam(ours_adam->parameters(), options);
  amp::FusedAdamW fused_adamw(ours_adamw->parameters(), options);
  torch::optim::Adam adam(ref_adam->parameters(), torch::optim::AdamOptions(1e-2).weight_decay(0.1));
  torch::optim::AdamW adamw(ref_adamw->parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
  std::vector<std::pair<Mlp*, torch::optim::Optimizer*>> runs = {
      {&ours_adam, &fused_adam}, {&ours_adamw, &fused_adamw}, {&ref_adam, &adam}, {&ref_adamw, &adamw}};
  for (int step = 0; step < 10; ++step) {
    const auto x = batch(200 + step);
    for (auto& [net, opt] : runs) {
      opt->zero_grad();
      (*net)->forward(x).pow(2).mean().backward();
      opt->step();
    }
  }
  const auto a = ours_adam->parameters(), aw = ours_adamw->parameters();
  const auto ra = ref_adam->parameters(), raw = ref_adamw->parameters();
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_TRUE(torch::allclose(a[i], ra[i], 1e-5, 1e-6)) << "FusedAdam vs Adam, parameter " << i;
    EXPECT_TRUE(torch::allclose(aw[i], raw[i], 1e-5, 1e-6)) << "FusedAdamW vs AdamW, parameter " << i;
  }
  EXPECT_FALSE(torch::allclose(ra[0], raw[0], 1e-5, 1e-6)) << "the test needs Adam and AdamW to differ";
}

// The fused path follows the same run with torch::optim::AdamW under amp (both O2, same data).
TEST(FusedOptimizerTest, AmpWithFusedAdamWMatchesAmpWithTorchAdamW) {
  Mlp a = make_mlp(6), b = make_mlp(6);
  amp::FusedAdamW fused(a->parameters(), amp::FusedAdamOptions(1e-2).weight_decay(1e-2));
  torch::optim::AdamW plain(b->parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(1e-2));
  auto fa = amp::initialize(a, fused, o2_bf16());
  auto fb = amp::initialize(b, plain, o2_bf16());
  for (int step = 0; step < 10; ++step) {
    amp_step(fa.model, fa.optimizer, batch(50 + step));
    amp_step(fb.model, fb.optimizer, batch(50 + step));
  }
  const auto& ma = fused.param_groups()[0].params();
  const auto& mb = plain.param_groups()[0].params();
  // O2: the masters differ by a few fp32 ulps (above), and a bf16 model weight rounded from them may land one bf16 ulp
  // apart, which changes later gradients by ~2^-8 of one weight's share; Adam's normalized update (lr m / sqrt(v))
  // turns that into far less than lr 2^-8 = 4e-5 per step. 1e-4 relative (+ 1e-5 near 0) over 10 steps.
  double worst = 0;
  for (size_t i = 0; i < ma.size(); ++i) {
    worst = std::max(worst, ((ma[i] - mb[i]).abs() / (1e-4 * mb[i].abs() + 1e-5)).max().item<double>());
  }
  std::printf("O2 FusedAdamW vs AdamW masters: worst difference %.3f of the bound\n", worst);
  for (size_t i = 0; i < ma.size(); ++i) EXPECT_TRUE(torch::allclose(ma[i], mb[i], 1e-4, 1e-5)) << "master " << i;
}

TEST(FusedOptimizerTest, ResumeWithFusedAdamIsBitIdentical) {
  const std::string path = "/tmp/lta_fused_resume_" + std::to_string(::getpid()) + ".pt";
  auto run = [&](int start, bool load, bool save_at_5) {
    Mlp net = make_mlp(8);
    amp::FusedAdam adam(net->parameters(), amp::FusedAdamOptions(1e-2).amsgrad(true).decoupled_weight_decay(false));
    auto [model, optimizer] = amp::initialize(net, adam, o2_bf16().growth_interval(2));
    if (load) amp::load_checkpoint(path, model, optimizer);
    for (int step = start; step < 8; ++step) {
      if (save_at_5 && step == 5) amp::save_checkpoint(path, model, optimizer);
      amp_step(model, optimizer, batch(70 + step));
    }
    return snapshot(adam.param_groups()[0].params());
  };
  const auto straight = run(0, false, true);
  const auto resumed = run(5, true, false);
  for (size_t i = 0; i < straight.size(); ++i) EXPECT_TRUE(torch::equal(straight[i], resumed[i])) << "master " << i;
  std::remove(path.c_str());
}

// The whole AMP step (forward, scaled backward, fused unscale + check, scale update, fused AdamW with found_inf)
// performs no host synchronization: c10's sync debug mode turns any sync into an error.
TEST(FusedOptimizerTest, CudaAmpStepWithFusedAdamWHasNoHostSync) {
  LTA_REQUIRE_CUDA();
#ifdef LIBTORCH_AMP_WITH_CUDA
  Mlp net = make_mlp(9);
  net->to(torch::kCUDA);
  amp::FusedAdamW adam(net->parameters(), amp::FusedAdamOptions(1e-3));
  auto [model, optimizer] = amp::initialize(
      net, adam, amp::Options().opt_level(amp::OptLevel::O2).half_dtype(torch::kHalf).max_overflows_at_floor(0));
  const auto x = batch(1).cuda();
  amp_step(model, optimizer, x);  // warm-up: allocations and lazy state
  c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_ERROR);
  try {
    for (int i = 0; i < 3; ++i) amp_step(model, optimizer, x);
  } catch (...) {
    c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_DISABLED);
    throw;
  }
  c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_DISABLED);
  EXPECT_EQ(optimizer.scaler().diagnostics_now().skipped_steps, 0);
#endif
}

}  // namespace

namespace {

// amp::clip_grad_norm_ clips the gradients the optimizer applies (the fp32 masters'), on the device, and a
// non-finite norm marks the step as overflowed so it is skipped.
TEST(AmpClipTest, ClipsMasterGradientsAndSkipsOnNonFiniteNorm) {
  Mlp net = make_mlp(12);
  torch::optim::SGD sgd(net->parameters(), 0.1);
  auto [model, optimizer] = amp::initialize(net, sgd, o2_bf16());
  optimizer.zero_grad();
  {
    auto scaled = amp::scale_loss(model(batch(3)).pow(2).sum() * 100, optimizer);
    scaled.backward();
  }
  const auto norm = amp::clip_grad_norm_(optimizer, 0.5);
  EXPECT_GT(norm.item<double>(), 0.5) << "the test needs a norm above the limit";
  double clipped = 0;
  for (const auto& g : optimizer.gradients()) clipped += g.pow(2).sum().item<double>();
  EXPECT_NEAR(std::sqrt(clipped), 0.5, 1e-3);

  const auto before = snapshot(sgd.param_groups()[0].params());
  optimizer.gradients()[0].view(-1)[0] = std::numeric_limits<float>::quiet_NaN();
  amp::clip_grad_norm_(optimizer, 0.5);
  optimizer.step();
  const auto& after = sgd.param_groups()[0].params();
  for (size_t i = 0; i < after.size(); ++i) EXPECT_TRUE(torch::equal(after[i], before[i])) << "master " << i;
}

}  // namespace
