// The fused Adam/AdamW and SGD kernels (kernels/optim/) against torch::optim on the same gradients: every dtype
// setup, mixed dtypes in one call, skipped steps, the learning rate read from its tensor, and late parameters.
// Bad input and the CUDA path: fused_optimizers_cuda_test.cpp.

#include <kernels/optim/fused_optimizers.h>

#include <algorithm>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "kernels/fused_optimizer_harness.h"
#include "test_util.h"

namespace {

using namespace fused_optimizer_test;  // NOLINT(google-build-using-namespace): the shared harness
using kernels::AdamStepOptions;
using kernels::SgdStepOptions;

// Typed over the parameter dtype: fp32 params are updated directly from fp32 grads; fp16/bf16 params carry
// fp32 masters and get gradients of their own dtype, pre-multiplied by the loss scale (the AMP O2 setup).
template <typename T>
class FusedOptimizerTest : public ::testing::Test {
 protected:
  static RunSetup amp_setup() {
    const auto dtype = c10::CppTypeToScalarType<T>::value;
    const bool reduced = dtype != torch::kFloat;
    return RunSetup{dtype, dtype, reduced, reduced};
  }
};

using Dtypes = ::testing::Types<float, c10::Half, c10::BFloat16>;
TYPED_TEST_SUITE(FusedOptimizerTest, Dtypes);

TYPED_TEST(FusedOptimizerTest, AdamWMatchesTorch) {
  check_adam_against_torch(this->amp_setup(), AdamStepOptions().weight_decay(0.1));
}

TYPED_TEST(FusedOptimizerTest, AdamWithL2WeightDecayMatchesTorch) {
  check_adam_against_torch(this->amp_setup(), AdamStepOptions().weight_decay(0.1).decoupled_weight_decay(false));
}

TYPED_TEST(FusedOptimizerTest, AdamWAmsgradMatchesTorch) {
  check_adam_against_torch(this->amp_setup(), AdamStepOptions().weight_decay(0.1).amsgrad(true));
}

TYPED_TEST(FusedOptimizerTest, AdamAmsgradWithL2MatchesTorch) {
  check_adam_against_torch(this->amp_setup(),
                           AdamStepOptions().weight_decay(0.1).decoupled_weight_decay(false).amsgrad(true));
}

TYPED_TEST(FusedOptimizerTest, AdamWithoutWeightDecayAndOtherBetasMatchesTorch) {
  check_adam_against_torch(this->amp_setup(), AdamStepOptions().beta1(0.8).beta2(0.95).eps(1e-4));
}

TYPED_TEST(FusedOptimizerTest, SgdWithWeightDecayMatchesTorch) {
  check_sgd_against_torch(this->amp_setup(), SgdStepOptions().weight_decay(0.1));
}

TYPED_TEST(FusedOptimizerTest, SgdMomentumWithDampeningMatchesTorch) {
  check_sgd_against_torch(this->amp_setup(), SgdStepOptions().momentum(0.9).dampening(0.1).weight_decay(0.05));
}

TYPED_TEST(FusedOptimizerTest, SgdNesterovMatchesTorch) {
  check_sgd_against_torch(this->amp_setup(), SgdStepOptions().momentum(0.9).nesterov(true).weight_decay(0.05));
}

// Gradients of another dtype than the params, with and without masters and loss scale.
TEST(FusedOptimizerMixedTest, Fp32ParamsWithScaledBf16GradsMatchTorch) {
  check_adam_against_torch(RunSetup{torch::kFloat, torch::kBFloat16, false, true}, AdamStepOptions().weight_decay(0.1));
}

TEST(FusedOptimizerMixedTest, Fp16ParamsWithFp32GradsAndMastersMatchTorch) {
  check_adam_against_torch(RunSetup{torch::kHalf, torch::kFloat, true, false}, AdamStepOptions().amsgrad(true));
}

TEST(FusedOptimizerMixedTest, Bf16ParamsWithScaledFp16GradsAndMastersMatchTorch) {
  check_sgd_against_torch(RunSetup{torch::kBFloat16, torch::kHalf, true, true}, SgdStepOptions().momentum(0.9));
}

// Without masters a 16-bit parameter is widened, updated in fp32 and rounded back every step.
TEST(FusedOptimizerMixedTest, Bf16ParamsWithoutMastersRoundEveryStepLikeTorch) {
  check_adam_against_torch(RunSetup{torch::kBFloat16, torch::kBFloat16, false, true},
                           AdamStepOptions().weight_decay(0.1));
}

TEST(FusedOptimizerMixedTest, Fp16ParamsWithoutMastersRoundEveryStepLikeTorch) {
  check_sgd_against_torch(RunSetup{torch::kHalf, torch::kHalf, false, false}, SgdStepOptions().momentum(0.5));
}

// Several dtype groups in one call: each param's update must use its own count, advanced once per call.
TEST(FusedOptimizerMixedTest, MixedParamDtypesInOneCallAdvanceEachCountOnce) {
  RunSetup setup{torch::kFloat, torch::kBFloat16, true, true};
  setup.mixed_params = true;
  check_adam_against_torch(setup, AdamStepOptions().weight_decay(0.1).amsgrad(true));
  check_sgd_against_torch(setup, SgdStepOptions().momentum(0.9).dampening(0.2));
}

TEST(FusedOptimizerMixedTest, HundredsOfSmallTensorsSplitAcrossThreads) {
  std::vector<int64_t> sizes;
  for (int i = 0; i < 400; ++i) sizes.push_back((i * 7919) % 1500);  // includes empty tensors
  check_adam_against_torch(RunSetup{torch::kBFloat16, torch::kBFloat16, true, true},
                           AdamStepOptions().weight_decay(0.1), sizes);
}

TEST(FusedOptimizerSkipTest, AdamFoundInfLeavesEverythingBitIdentical) {
  Harness h(RunSetup{torch::kBFloat16, torch::kBFloat16, true, true}, kSizes);
  AdamState state{h.params, h.masters, zeros_fp32(h.params), zeros_fp32(h.params), zeros_fp32(h.params), h.steps};
  const auto options = AdamStepOptions().weight_decay(0.1).amsgrad(true);
  const auto found_inf = torch::zeros({1});
  auto step_with = [&](const TensorVector& grads) {
    kernels::fused_adam_step_(state.params, grads, state.exp_avgs, state.exp_avg_sqs, state.max_exp_avg_sqs,
                              state.masters, state.steps, h.lr, options, h.inv_scale, found_inf);
  };
  for (int s = 0; s < 2; ++s) step_with(h.next_grads());  // nonzero moments to protect
  ASSERT_EQ(state.steps[3].item<float>(), 2.0f);

  TensorVector bad_grads = h.next_grads();
  bad_grads[4][0] = std::numeric_limits<float>::infinity();  // what an overflowing backward leaves
  const AdamState before = state.snapshot();
  found_inf.fill_(1.0f);
  step_with(bad_grads);
  expect_bit_identical(state, before);

  // The same call with found_inf cleared takes the step: the check above could fail.
  found_inf.zero_();
  step_with(h.next_grads());
  EXPECT_FALSE(torch::equal(state.masters[5], before.masters[5]));
  EXPECT_FALSE(torch::equal(state.exp_avgs[5], before.exp_avgs[5]));
  for (const auto& step : state.steps) EXPECT_EQ(step.item<float>(), 3.0f);
}

TEST(FusedOptimizerSkipTest, SgdFoundInfLeavesEverythingBitIdentical) {
  Harness h(RunSetup{torch::kHalf, torch::kHalf, true, true}, kSizes);
  TensorVector buffers = zeros_fp32(h.params);
  const auto options = SgdStepOptions().momentum(0.9).weight_decay(0.1);
  const auto found_inf = torch::zeros({1});
  auto step_with = [&](const TensorVector& grads) {
    kernels::fused_sgd_step_(h.params, grads, buffers, h.masters, h.steps, h.lr, options, h.inv_scale, found_inf);
  };
  // A skipped first step must leave the count at 0, so the next step still starts the buffer from its gradient.
  found_inf.fill_(1.0f);
  step_with(h.next_grads());
  expect_all_equal(h.steps, zeros_fp32(h.steps), "steps after a skipped first step");
  found_inf.zero_();
  step_with(h.next_grads());
  const TensorVector params = clone_all(h.params), masters = clone_all(h.masters), bufs = clone_all(buffers);
  const TensorVector steps = clone_all(h.steps);
  found_inf.fill_(1.0f);
  step_with(h.next_grads());
  expect_all_equal(h.params, params, "params");
  expect_all_equal(h.masters, masters, "masters");
  expect_all_equal(buffers, bufs, "momentum_buffers");
  expect_all_equal(h.steps, steps, "steps");

  found_inf.zero_();
  step_with(h.next_grads());
  EXPECT_FALSE(torch::equal(buffers[5], bufs[5]));
  for (const auto& step : h.steps) EXPECT_EQ(step.item<float>(), 2.0f);
}

// The learning rate comes from the tensor at every call: lr = 0 moves nothing but the state advances.
TEST(FusedOptimizerStepTest, LearningRateIsReadFromItsTensorEachStep) {
  Harness h(RunSetup{}, kSizes);
  TensorVector exp_avgs = zeros_fp32(h.params), exp_avg_sqs = zeros_fp32(h.params);
  const TensorVector before = clone_all(h.params);
  h.lr.fill_(0.0f);
  kernels::fused_adam_step_(h.params, h.next_grads(), exp_avgs, exp_avg_sqs, {}, {}, h.steps, h.lr,
                            AdamStepOptions().weight_decay(0.1));
  expect_all_equal(h.params, before, "params at lr 0");
  EXPECT_GT(exp_avgs[5].abs().sum().item<float>(), 0.0f);
  EXPECT_EQ(h.steps[5].item<float>(), 1.0f);
  h.lr.fill_(1e-2f);
  kernels::fused_adam_step_(h.params, h.next_grads(), exp_avgs, exp_avg_sqs, {}, {}, h.steps, h.lr,
                            AdamStepOptions().weight_decay(0.1));
  EXPECT_FALSE(torch::equal(h.params[5], before[5]));
}

TEST(FusedOptimizerStepTest, EmptyParamListDoesNothing) {
  const auto lr = torch::ones({1});
  kernels::fused_sgd_step_({}, {}, {}, {}, {}, lr, SgdStepOptions().momentum(0.9));
  kernels::fused_adam_step_({}, {}, {}, {}, {}, {}, {}, lr, AdamStepOptions());
  EXPECT_EQ(lr.item<float>(), 1.0f);
}

/// A model whose last parameter gets its first gradient only at step kLateStep, as a branch unused early: ours
/// is called with the parameters that have a gradient (as FusedAdam / FusedSGD do), torch::optim gets an
/// undefined gradient for the late one, so it neither steps it nor creates its state until then.
constexpr int kLateStep = 3;

using LateStepFn = std::function<void(const TensorVector& params, const TensorVector& grads,
                                      const TensorVector& masters, size_t count)>;

void run_with_late_param(Harness& h, torch::optim::Optimizer& reference, const LateStepFn& ours) {
  const size_t all = h.params.size();
  for (int s = 0; s < kSteps; ++s) {
    const TensorVector grads = h.next_grads();
    const size_t count = s < kLateStep ? all - 1 : all;
    if (count < all) h.ref.back().mutable_grad() = torch::Tensor();
    reference.step();
    h.round_reference();
    ours(h.params, grads, h.masters, count);
  }
}

TensorVector first(const TensorVector& v, size_t count) { return TensorVector(v.begin(), v.begin() + count); }

// Adam: the late parameter's first update is bias-corrected as its step 1 (a step of about lr), not as the
// group's step kLateStep + 1, and its count ends kLateStep behind the others.
TEST(FusedOptimizerLateParamTest, AdamBiasCorrectionCountsEachParamsOwnSteps) {
  for (const bool decoupled : {true, false}) {
    const RunSetup setup{torch::kBFloat16, torch::kBFloat16, true, true};
    Harness h(setup, {1000, 33, 17});
    const auto options = AdamStepOptions().weight_decay(0.1).amsgrad(true).decoupled_weight_decay(decoupled);
    TensorVector exp_avgs = zeros_fp32(h.params), exp_avg_sqs = zeros_fp32(h.params);
    TensorVector max_exp_avg_sqs = zeros_fp32(h.params);
    std::unique_ptr<torch::optim::Optimizer> opt;
    if (decoupled) {
      opt =
          std::make_unique<torch::optim::AdamW>(h.ref, torch::optim::AdamWOptions(kLr).weight_decay(0.1).amsgrad(true));
    } else {
      opt = std::make_unique<torch::optim::Adam>(h.ref, torch::optim::AdamOptions(kLr).weight_decay(0.1).amsgrad(true));
    }
    run_with_late_param(
        h, *opt, [&](const TensorVector& params, const TensorVector& grads, const TensorVector& masters, size_t n) {
          kernels::fused_adam_step_(first(params, n), first(grads, n), first(exp_avgs, n), first(exp_avg_sqs, n),
                                    first(max_exp_avg_sqs, n), first(masters, n), first(h.steps, n), h.lr, options,
                                    h.inv_scale);
        });
    const std::string what = decoupled ? "AdamW" : "Adam";
    expect_all_close(h.masters, h.ref, kStateRtol, kParamAtol, "masters (" + what + ")");
    EXPECT_EQ(h.steps[0].item<float>(), static_cast<float>(kSteps)) << what;
    EXPECT_EQ(h.steps.back().item<float>(), static_cast<float>(kSteps - kLateStep)) << what;
  }
}

// SGD: the late parameter's buffer (NaN here, as uninitialised memory may be) starts as its first gradient.
TEST(FusedOptimizerLateParamTest, SgdMomentumBufferStartsAsTheLateParamsFirstGradient) {
  for (const bool nesterov : {false, true}) {
    const RunSetup setup{torch::kFloat, torch::kFloat, false, false};
    Harness h(setup, {1000, 33, 17});
    auto options = SgdStepOptions().momentum(0.9).weight_decay(0.05);
    auto ref_options = torch::optim::SGDOptions(kLr).momentum(0.9).weight_decay(0.05);
    if (nesterov) {
      options.nesterov(true);
      ref_options.nesterov(true);
    } else {
      options.dampening(0.25);
      ref_options.dampening(0.25);
    }
    TensorVector buffers;
    for (const auto& p : h.params) buffers.push_back(torch::full({p.numel()}, NAN, torch::kFloat));
    torch::optim::SGD opt(h.ref, ref_options);
    run_with_late_param(h, opt,
                        [&](const TensorVector& params, const TensorVector& grads, const TensorVector&, size_t n) {
                          kernels::fused_sgd_step_(first(params, n), first(grads, n), first(buffers, n), {},
                                                   first(h.steps, n), h.lr, options);
                        });
    const std::string what = nesterov ? "nesterov" : "dampening";
    expect_all_close(h.params, h.ref, kStateRtol, kParamAtol, "params (" + what + ")");
    EXPECT_EQ(h.steps.back().item<float>(), static_cast<float>(kSteps - kLateStep)) << what;
  }
}

}  // namespace
