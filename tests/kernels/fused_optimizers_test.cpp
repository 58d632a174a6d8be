#include <kernels/optim/fused_optimizers.h>

#include <algorithm>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>
#ifdef LIBTORCH_AMP_WITH_CUDA
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include "test_util.h"

namespace {

using kernels::AdamStepOptions;
using kernels::SgdStepOptions;
using TensorVector = std::vector<torch::Tensor>;

constexpr int kSteps = 20;
constexpr double kLr = 1e-2;
/// A power of two, so unscaling a gradient that was fed pre-multiplied by it is exact.
constexpr double kGradScale = 1024.0;

// Empty, tails of the CPU vector loop (16 or 32 elements per iteration) and of a CUDA block's ILP sweep, and
// tensors spanning several 64 Ki chunks (so at::parallel_for splits inside a tensor).
const std::vector<int64_t> kSizes = {0, 1, 17, 33, 1000, 65536 + 3, 2 * 65536 + 77};

// Tolerances against torch::optim run in fp32 on the same gradients: same formulas, so a few ulps per step.
constexpr double kStateRtol = 1e-5;
constexpr double kStateAtol = 1e-7;
constexpr double kParamAtol = 1e-6;

/// How the parameters and gradients of a run are stored.
struct RunSetup {
  torch::ScalarType param_dtype = torch::kFloat;
  torch::ScalarType grad_dtype = torch::kFloat;
  bool masters = false;       // fp32 master copies carry the update
  bool scaled_grads = false;  // grads are fed multiplied by kGradScale, with inv_scale = 1 / kGradScale
  bool mixed_params = false;  // param i is fp32, fp16 or bf16 in turn (one call, several dtype groups)
};

const torch::ScalarType kMixedParamDtypes[] = {torch::kFloat, torch::kHalf, torch::kBFloat16};

std::string describe(const RunSetup& s) {
  return std::string("params ") + c10::toString(s.param_dtype) + ", grads " + c10::toString(s.grad_dtype) +
         (s.masters ? ", fp32 masters" : ", no masters") + (s.scaled_grads ? ", scaled grads" : "") +
         (s.mixed_params ? ", mixed param dtypes" : "");
}

/// Elementwise |a - e| <= rtol * |e| + atol, where atol is at least rtol times the largest |e| of the tensor:
/// values that are sums of terms (moments, momentum) can cancel to near zero, and their rounding error is
/// that of the terms, not of the result.
void expect_all_close(const TensorVector& actual, const TensorVector& expected, double rtol, double atol_floor,
                      const std::string& what) {
  ASSERT_EQ(actual.size(), expected.size()) << what;
  for (size_t i = 0; i < actual.size(); ++i) {
    const auto a = actual[i].detach().cpu().to(torch::kFloat64);
    const auto e = expected[i].detach().cpu().to(torch::kFloat64);
    if (e.numel() == 0) continue;
    const double atol = std::max(atol_floor, rtol * e.abs().max().item<double>());
    EXPECT_TRUE(torch::allclose(a, e, rtol, atol))
        << what << "[" << i << "] (" << a.numel() << " elements): max abs diff " << (a - e).abs().max().item<double>()
        << ", atol " << atol;
  }
}

void expect_all_equal(const TensorVector& actual, const TensorVector& expected, const std::string& what) {
  ASSERT_EQ(actual.size(), expected.size()) << what;
  for (size_t i = 0; i < actual.size(); ++i) {
    EXPECT_TRUE(torch::equal(actual[i].cpu(), expected[i].cpu())) << what << "[" << i << "] changed or differs";
  }
}

TensorVector zeros_fp32(const TensorVector& like) {
  TensorVector out;
  for (const auto& t : like) out.push_back(torch::zeros({t.numel()}, t.options().dtype(torch::kFloat)));
  return out;
}

TensorVector clone_all(const TensorVector& v) {
  TensorVector out;
  for (const auto& t : v) out.push_back(t.clone());
  return out;
}

/// Our parameters (and masters) next to a torch::optim reference run on fp32 copies of the same values, fed
/// the same gradients every step.
class Harness {
 public:
  Harness(const RunSetup& setup, const std::vector<int64_t>& sizes, const torch::Device& device = torch::kCPU)
      : setup_(setup), device_(device) {
    // Mixed dtypes without masters would need a per-tensor rounding of the reference; no test needs it.
    TORCH_CHECK(!setup.mixed_params || setup.masters, "mixed_params needs masters");
    for (size_t i = 0; i < sizes.size(); ++i) {
      const auto init = torch::randn({sizes[i]}, gen_);
      const auto param = init.to(setup.mixed_params ? kMixedParamDtypes[i % 3] : setup.param_dtype);
      params.push_back(param.to(device));
      if (setup.masters) masters.push_back(init.to(device));
      // Without masters our step starts from the stored (rounded) parameter, and so does the reference.
      ref.push_back((setup.masters ? init : param.to(torch::kFloat)).clone().requires_grad_(true));
    }
    const auto fp32 = torch::TensorOptions().dtype(torch::kFloat).device(device);
    for (size_t i = 0; i < sizes.size(); ++i) steps.push_back(torch::zeros({1}, fp32));
    lr = torch::full({1}, kLr, fp32);
    if (setup.scaled_grads) inv_scale = torch::full({1}, 1.0 / kGradScale, fp32);
  }

  /// Fresh random gradients: returns ours (in grad_dtype, scaled if asked) and gives the reference the exact
  /// fp32 values they stand for.
  TensorVector next_grads() {
    TensorVector ours;
    for (auto& p : ref) {
      const auto g = torch::randn({p.numel()}, gen_);
      const auto fed = setup_.scaled_grads ? (g * kGradScale).to(setup_.grad_dtype) : g.to(setup_.grad_dtype);
      p.mutable_grad() = setup_.scaled_grads ? fed.to(torch::kFloat) / kGradScale : fed.to(torch::kFloat);
      ours.push_back(fed.to(device_));
    }
    return ours;
  }

  /// After a reference step: without masters our parameters are stored in their dtype every step.
  void round_reference() {
    if (setup_.masters || setup_.param_dtype == torch::kFloat) return;
    torch::NoGradGuard no_grad;
    for (auto& p : ref) p.copy_(p.to(setup_.param_dtype).to(torch::kFloat));
  }

  /// Masters match the fp32 reference and params are the masters rounded; without masters, params match the
  /// reference within the tolerance of their dtype.
  void expect_params_match() const {
    const std::string what = describe(setup_);
    if (setup_.masters) {
      expect_all_close(masters, ref, kStateRtol, kParamAtol, "masters (" + what + ")");
      TensorVector rounded;
      for (size_t i = 0; i < masters.size(); ++i) rounded.push_back(masters[i].to(params[i].scalar_type()));
      expect_all_equal(params, rounded, "params vs masters rounded (" + what + ")");
    } else {
      const double rtol = setup_.param_dtype == torch::kFloat ? kStateRtol : test_util::rtol_for(setup_.param_dtype);
      expect_all_close(params, ref, rtol, kParamAtol, "params (" + what + ")");
    }
    for (size_t i = 0; i < steps.size(); ++i) {
      const float expected = counts_steps ? static_cast<float>(steps_taken) : 0.0f;
      EXPECT_EQ(steps[i].item<float>(), expected) << "step count of param " << i << " (" << what << ")";
    }
  }

  TensorVector params, masters, ref;
  TensorVector steps;  // one count per param
  torch::Tensor lr, inv_scale;
  int steps_taken = 0;
  bool counts_steps = true;  // false for plain SGD, which keeps no step counts

 private:
  RunSetup setup_;
  torch::Device device_;
  torch::Generator gen_ = at::make_generator<at::CPUGeneratorImpl>(test_util::fresh_seed());
};

/// Moments of one torch::optim::Adam/AdamW parameter (their state types differ, their fields do not).
template <typename State>
void collect_adam_state(torch::optim::Optimizer& opt, const TensorVector& ref, TensorVector& exp_avg,
                        TensorVector& exp_avg_sq, TensorVector& max_exp_avg_sq) {
  for (const auto& p : ref) {
    auto& state = static_cast<State&>(*opt.state().at(p.unsafeGetTensorImpl()));
    exp_avg.push_back(state.exp_avg());
    exp_avg_sq.push_back(state.exp_avg_sq());
    if (state.max_exp_avg_sq().defined()) max_exp_avg_sq.push_back(state.max_exp_avg_sq());
  }
}

/// Runs kSteps of ours and of torch::optim::AdamW (decoupled) or Adam (L2) and compares params and moments.
void check_adam_against_torch(const RunSetup& setup, const AdamStepOptions& options,
                              const std::vector<int64_t>& sizes = kSizes) {
  Harness h(setup, sizes);
  TensorVector exp_avgs = zeros_fp32(h.params), exp_avg_sqs = zeros_fp32(h.params);
  TensorVector max_exp_avg_sqs = options.amsgrad() ? zeros_fp32(h.params) : TensorVector{};
  const auto betas = std::make_tuple(options.beta1(), options.beta2());
  std::unique_ptr<torch::optim::Optimizer> opt;
  if (options.decoupled_weight_decay()) {
    opt = std::make_unique<torch::optim::AdamW>(h.ref, torch::optim::AdamWOptions(kLr)
                                                           .betas(betas)
                                                           .eps(options.eps())
                                                           .weight_decay(options.weight_decay())
                                                           .amsgrad(options.amsgrad()));
  } else {
    opt = std::make_unique<torch::optim::Adam>(h.ref, torch::optim::AdamOptions(kLr)
                                                          .betas(betas)
                                                          .eps(options.eps())
                                                          .weight_decay(options.weight_decay())
                                                          .amsgrad(options.amsgrad()));
  }
  for (int s = 0; s < kSteps; ++s) {
    const TensorVector grads = h.next_grads();
    opt->step();
    h.round_reference();
    kernels::fused_adam_step_(h.params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, h.masters, h.steps, h.lr,
                              options, h.inv_scale);
    ++h.steps_taken;
  }
  h.expect_params_match();
  TensorVector ref_avg, ref_avg_sq, ref_max;
  if (options.decoupled_weight_decay()) {
    collect_adam_state<torch::optim::AdamWParamState>(*opt, h.ref, ref_avg, ref_avg_sq, ref_max);
  } else {
    collect_adam_state<torch::optim::AdamParamState>(*opt, h.ref, ref_avg, ref_avg_sq, ref_max);
  }
  // Without masters the parameters (and so the L2 term) can differ by an ulp of their dtype.
  const bool exact_params = setup.masters || setup.param_dtype == torch::kFloat;
  const double rtol = exact_params ? kStateRtol : test_util::rtol_for(setup.param_dtype);
  expect_all_close(exp_avgs, ref_avg, rtol, kStateAtol, "exp_avgs (" + describe(setup) + ")");
  expect_all_close(exp_avg_sqs, ref_avg_sq, rtol, kStateAtol, "exp_avg_sqs (" + describe(setup) + ")");
  if (options.amsgrad()) expect_all_close(max_exp_avg_sqs, ref_max, rtol, kStateAtol, "max_exp_avg_sqs");
}

/// Runs kSteps of ours and of torch::optim::SGD and compares params and momentum buffers.
void check_sgd_against_torch(const RunSetup& setup, const SgdStepOptions& options) {
  Harness h(setup, kSizes);
  const bool momentum = options.momentum() != 0.0;
  // Filled with NaN: step 0 must overwrite the buffers with the gradient, never read them.
  TensorVector buffers;
  if (momentum) {
    for (const auto& p : h.params) buffers.push_back(torch::full({p.numel()}, NAN, torch::kFloat));
  }
  const TensorVector steps = momentum ? h.steps : TensorVector{};
  h.counts_steps = momentum;
  torch::optim::SGD opt(h.ref, torch::optim::SGDOptions(kLr)
                                   .momentum(options.momentum())
                                   .dampening(options.dampening())
                                   .weight_decay(options.weight_decay())
                                   .nesterov(options.nesterov()));
  for (int s = 0; s < kSteps; ++s) {
    const TensorVector grads = h.next_grads();
    opt.step();
    h.round_reference();
    kernels::fused_sgd_step_(h.params, grads, buffers, h.masters, steps, h.lr, options, h.inv_scale);
    ++h.steps_taken;
  }
  h.expect_params_match();
  if (momentum) {
    TensorVector ref_buffers;
    for (const auto& p : h.ref) {
      ref_buffers.push_back(
          static_cast<torch::optim::SGDParamState&>(*opt.state().at(p.unsafeGetTensorImpl())).momentum_buffer());
    }
    expect_all_close(buffers, ref_buffers, kStateRtol, kStateAtol, "momentum_buffers (" + describe(setup) + ")");
  }
}

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

/// Everything an Adam step may write, for bit-identity checks.
struct AdamState {
  TensorVector params, masters, exp_avgs, exp_avg_sqs, max_exp_avg_sqs;
  TensorVector steps;
  AdamState snapshot() const {
    return {clone_all(params),      clone_all(masters),         clone_all(exp_avgs),
            clone_all(exp_avg_sqs), clone_all(max_exp_avg_sqs), clone_all(steps)};
  }
};

void expect_bit_identical(const AdamState& now, const AdamState& before) {
  expect_all_equal(now.params, before.params, "params");
  expect_all_equal(now.masters, before.masters, "masters");
  expect_all_equal(now.exp_avgs, before.exp_avgs, "exp_avgs");
  expect_all_equal(now.exp_avg_sqs, before.exp_avg_sqs, "exp_avg_sqs");
  expect_all_equal(now.max_exp_avg_sqs, before.max_exp_avg_sqs, "max_exp_avg_sqs");
  expect_all_equal(now.steps, before.steps, "steps");
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

// Bad input: each error names the argument, the index and the offending value, and nothing is written.
using test_util::expect_error;

class FusedOptimizerErrorTest : public ::testing::Test {
 protected:
  void adam(const TensorVector& grads, const TensorVector& avgs, const TensorVector& avg_sqs,
            const TensorVector& masters, const torch::Tensor& found_inf = {},
            const AdamStepOptions& options = AdamStepOptions(), const TensorVector& max_avg_sqs = {}) {
    kernels::fused_adam_step_(params_, grads, avgs, avg_sqs, max_avg_sqs, masters, steps_, lr_, options, {}, found_inf);
  }
  TensorVector params_ = {torch::ones({6}), torch::ones({6})};
  TensorVector fp32_ = {torch::zeros({6}), torch::zeros({6})};
  TensorVector steps_ = {torch::zeros({1}), torch::zeros({1})};
  torch::Tensor lr_ = torch::full({1}, 0.1f);
};

TEST_F(FusedOptimizerErrorTest, ListLengthMismatchNamesBothLists) {
  expect_error([&] { adam(fp32_, {torch::zeros({6})}, fp32_, {}); }, "exp_avgs has 1 tensors but params has 2");
  expect_error([&] { adam(fp32_, fp32_, fp32_, {torch::zeros({6})}); }, "master_params has 1 tensors but params has 2");
}

TEST_F(FusedOptimizerErrorTest, MasterNotFp32NamesIndexAndDtype) {
  expect_error(
      [&] {
        adam(fp32_, fp32_, fp32_, {torch::zeros({6}), torch::zeros({6}, torch::kHalf)});
      },
      "master_params[1] must be Float, got Half");
}

TEST_F(FusedOptimizerErrorTest, MomentWithWrongNumelNamesIndexAndSizesAndWritesNothing) {
  expect_error(
      [&] {
        adam(fp32_, fp32_, {torch::zeros({6}), torch::zeros({5})}, {});
      },
      "exp_avg_sqs[1] has 5 elements but params[1] has 6");
  EXPECT_TRUE(torch::equal(params_[0], torch::ones({6}))) << "a failed call must not update earlier tensors";
  EXPECT_EQ(steps_[0].item<float>(), 0.0f);
}

TEST_F(FusedOptimizerErrorTest, FoundInfMustBeOneFp32Element) {
  expect_error([&] { adam(fp32_, fp32_, fp32_, {}, torch::zeros({2})); },
               "found_inf must be a 1-element Float tensor on cpu, got 2 element(s) of Float");
  expect_error([&] { adam(fp32_, fp32_, fp32_, {}, torch::zeros({1}, torch::kInt)); },
               "found_inf must be a 1-element Float tensor on cpu, got 1 element(s) of Int");
}

TEST_F(FusedOptimizerErrorTest, StepsAndLrMustBeOneFp32ElementEach) {
  steps_[1] = torch::zeros({1}, torch::kLong);
  expect_error([&] { adam(fp32_, fp32_, fp32_, {}); },
               "steps[1] must be a 1-element Float tensor on cpu, got 1 element(s) of Long");
  steps_ = {torch::zeros({1})};
  expect_error([&] { adam(fp32_, fp32_, fp32_, {}); },
               "steps must hold one step count per param for Adam: got 1 for 2 params");
  steps_ = {torch::zeros({1}), torch::zeros({1})};
  lr_ = torch::full({3}, 0.1f);
  expect_error([&] { adam(fp32_, fp32_, fp32_, {}); }, "lr must be a 1-element Float tensor on cpu, got 3 element(s)");
}

TEST_F(FusedOptimizerErrorTest, EachParamNeedsItsOwnStepCount) {
  const auto shared = torch::zeros({1});
  steps_ = {shared, shared};
  expect_error([&] { adam(fp32_, fp32_, fp32_, {}); },
               "steps[1] is the same count as steps[0]: each param needs its own step count");
  EXPECT_EQ(shared.item<float>(), 0.0f);
}

TEST_F(FusedOptimizerErrorTest, AmsgradListMustMatchTheOption) {
  expect_error([&] { adam(fp32_, fp32_, fp32_, {}, {}, AdamStepOptions(), fp32_); },
               "max_exp_avg_sqs must be empty unless options.amsgrad() is set, got 2 tensors");
  expect_error([&] { adam(fp32_, fp32_, fp32_, {}, {}, AdamStepOptions().amsgrad(true)); },
               "options.amsgrad() needs one max_exp_avg_sqs tensor per param: got 0 for 2 params");
}

TEST_F(FusedOptimizerErrorTest, SgdMomentumBuffersMustMatchTheOption) {
  expect_error([&] { kernels::fused_sgd_step_(params_, fp32_, fp32_, {}, {}, lr_, SgdStepOptions()); },
               "momentum_buffers must be empty when momentum == 0, got 2 tensors");
  expect_error([&] { kernels::fused_sgd_step_(params_, fp32_, {}, {}, steps_, lr_, SgdStepOptions()); },
               "steps must be empty when momentum == 0, got 2 tensors");
  expect_error([&] { kernels::fused_sgd_step_(params_, fp32_, {}, {}, steps_, lr_, SgdStepOptions().momentum(0.9)); },
               "momentum 0.9 needs one momentum_buffers tensor per param: got 0 for 2 params");
  expect_error([&] { kernels::fused_sgd_step_(params_, fp32_, fp32_, {}, {}, lr_, SgdStepOptions().momentum(0.9)); },
               "steps must hold one step count per param with momentum: got 0 for 2 params");
  expect_error(
      [&] {
        kernels::fused_sgd_step_(params_, fp32_, fp32_, {}, steps_, lr_,
                                 SgdStepOptions().momentum(0.9).dampening(0.1).nesterov(true));
      },
      "nesterov requires momentum > 0 and dampening == 0, got momentum 0.9 and dampening 0.1");
}

TEST(FusedOptimizerOptionsTest, SettersRejectOutOfRangeValues) {
  expect_error([] { AdamStepOptions().beta1(1.0); }, "beta1 must be in [0, 1), got 1");
  expect_error([] { AdamStepOptions().beta2(-0.5); }, "beta2 must be in [0, 1), got -0.5");
  expect_error([] { AdamStepOptions().eps(0.0); }, "eps must be finite and > 0, got 0");
  expect_error([] { AdamStepOptions().weight_decay(-1.0); }, "weight_decay must be finite and >= 0, got -1");
  expect_error([] { SgdStepOptions().momentum(-0.1); }, "momentum must be finite and >= 0, got -0.1");
  expect_error([] { SgdStepOptions().dampening(NAN); }, "dampening must be finite, got nan");
}

#ifdef LIBTORCH_AMP_WITH_CUDA

TensorVector to_device(const TensorVector& v, const torch::Device& device) {
  TensorVector out;
  for (const auto& t : v) out.push_back(t.to(device));
  return out;
}

// The CUDA functors and the CPU twin apply the same rule (kernels/optim/fused_optimizer_rules.h); only FMA
// contraction may differ, so results agree to fp32 rounding over many steps.
TEST(FusedOptimizerCudaTest, AdamMatchesCpuTwinOnThousandsOfTensors) {
  LTA_REQUIRE_CUDA();
  std::vector<int64_t> sizes = kSizes;
  for (int i = 0; i < 2500; ++i) sizes.push_back(1 + (i * 37) % 300);  // more tensors than one launch holds
  Harness cpu(RunSetup{torch::kBFloat16, torch::kBFloat16, true, true}, sizes);
  const torch::Device cuda(torch::kCUDA);
  AdamState c{cpu.params, cpu.masters, zeros_fp32(cpu.params), zeros_fp32(cpu.params), zeros_fp32(cpu.params),
              cpu.steps};
  AdamState g{to_device(c.params, cuda),      to_device(c.masters, cuda),         to_device(c.exp_avgs, cuda),
              to_device(c.exp_avg_sqs, cuda), to_device(c.max_exp_avg_sqs, cuda), to_device(c.steps, cuda)};
  const auto lr = cpu.lr.to(cuda), inv_scale = cpu.inv_scale.to(cuda);
  const auto options = AdamStepOptions().weight_decay(0.1).amsgrad(true);
  // The first tensors join late (their first gradients come at step s == index), so the counts differ per
  // tensor, also inside one launch and across the launches of one call.
  constexpr size_t kLate = 5;
  for (int s = 0; s < kSteps; ++s) {
    const TensorVector grads = cpu.next_grads();
    const size_t skip = s < static_cast<int>(kLate) ? kLate - static_cast<size_t>(s) : 0;
    auto tail = [&](const TensorVector& v) { return TensorVector(v.begin() + skip, v.end()); };
    kernels::fused_adam_step_(tail(c.params), tail(grads), tail(c.exp_avgs), tail(c.exp_avg_sqs),
                              tail(c.max_exp_avg_sqs), tail(c.masters), tail(c.steps), cpu.lr, options, cpu.inv_scale);
    kernels::fused_adam_step_(tail(g.params), tail(to_device(grads, cuda)), tail(g.exp_avgs), tail(g.exp_avg_sqs),
                              tail(g.max_exp_avg_sqs), tail(g.masters), tail(g.steps), lr, options, inv_scale);
  }
  expect_all_close(g.masters, c.masters, kStateRtol, kParamAtol, "masters");
  expect_all_close(g.exp_avgs, c.exp_avgs, kStateRtol, kStateAtol, "exp_avgs");
  expect_all_close(g.exp_avg_sqs, c.exp_avg_sqs, kStateRtol, kStateAtol, "exp_avg_sqs");
  expect_all_close(g.max_exp_avg_sqs, c.max_exp_avg_sqs, kStateRtol, kStateAtol, "max_exp_avg_sqs");
  expect_all_close(g.params, c.params, test_util::rtol_for(torch::kBFloat16), kParamAtol, "params");
  expect_all_equal(g.steps, c.steps, "steps");
  EXPECT_EQ(g.steps[0].item<float>(), static_cast<float>(kSteps - kLate));
  EXPECT_EQ(g.steps.back().item<float>(), static_cast<float>(kSteps));
}

TEST(FusedOptimizerCudaTest, SgdMatchesTorchOnCuda) {
  LTA_REQUIRE_CUDA();
  const torch::Device cuda(torch::kCUDA);
  Harness h(RunSetup{torch::kHalf, torch::kHalf, true, true}, kSizes, cuda);
  TensorVector buffers;
  for (const auto& p : h.params) buffers.push_back(torch::zeros({p.numel()}, p.options().dtype(torch::kFloat)));
  const auto options = SgdStepOptions().momentum(0.9).nesterov(true).weight_decay(0.05);
  torch::optim::SGD opt(h.ref, torch::optim::SGDOptions(kLr).momentum(0.9).nesterov(true).weight_decay(0.05));
  for (int s = 0; s < kSteps; ++s) {
    const TensorVector grads = h.next_grads();
    opt.step();
    kernels::fused_sgd_step_(h.params, grads, buffers, h.masters, h.steps, h.lr, options, h.inv_scale);
    ++h.steps_taken;
  }
  h.expect_params_match();
}

TEST(FusedOptimizerCudaTest, FoundInfSkipsOnDevice) {
  LTA_REQUIRE_CUDA();
  const torch::Device cuda(torch::kCUDA);
  Harness h(RunSetup{torch::kBFloat16, torch::kFloat, true, false}, kSizes, cuda);
  AdamState state{h.params, h.masters, zeros_fp32(h.params), zeros_fp32(h.params), zeros_fp32(h.params), h.steps};
  const auto options = AdamStepOptions().amsgrad(true);
  const auto found_inf = torch::zeros({1}, torch::TensorOptions().device(cuda));
  kernels::fused_adam_step_(state.params, h.next_grads(), state.exp_avgs, state.exp_avg_sqs, state.max_exp_avg_sqs,
                            state.masters, state.steps, h.lr, options, {}, found_inf);
  const AdamState before = state.snapshot();
  found_inf.fill_(1.0f);
  kernels::fused_adam_step_(state.params, h.next_grads(), state.exp_avgs, state.exp_avg_sqs, state.max_exp_avg_sqs,
                            state.masters, state.steps, h.lr, options, {}, found_inf);
  expect_bit_identical(state, before);
}

// The whole step (update, step count, lr and inv_scale read on device) is capturable: a host sync inside
// would make capture fail. Replaying the graph twice must equal two eager steps.
TEST(FusedOptimizerCudaTest, AdamStepIsCapturableInACudaGraph) {
  LTA_REQUIRE_CUDA();
  const torch::Device cuda(torch::kCUDA);
  Harness h(RunSetup{torch::kBFloat16, torch::kBFloat16, true, true}, kSizes, cuda);
  const TensorVector grads = h.next_grads();
  AdamState graph_state{h.params, h.masters, zeros_fp32(h.params), zeros_fp32(h.params), {}, h.steps};
  AdamState eager = graph_state.snapshot();
  const auto options = AdamStepOptions().weight_decay(0.1);
  const auto found_inf = torch::zeros({1}, torch::TensorOptions().device(cuda));
  auto step = [&](AdamState& s) {
    kernels::fused_adam_step_(s.params, grads, s.exp_avgs, s.exp_avg_sqs, {}, s.masters, s.steps, h.lr, options,
                              h.inv_scale, found_inf);
  };
  AdamState warmup = graph_state.snapshot();  // first launches (lazy module loading) happen outside the capture
  step(warmup);
  torch::cuda::synchronize();
  at::cuda::CUDAGraph graph;
  {
    const auto side = c10::cuda::getStreamFromPool();
    side.synchronize();
    const c10::cuda::CUDAStreamGuard guard(side);
    graph.capture_begin();
    step(graph_state);
    graph.capture_end();
  }
  EXPECT_EQ(graph_state.steps[3].item<float>(), 0.0f) << "capture must not run the step";
  graph.replay();
  graph.replay();
  step(eager);
  step(eager);
  torch::cuda::synchronize();
  expect_all_equal(graph_state.masters, eager.masters, "masters (graph vs eager)");
  expect_all_equal(graph_state.params, eager.params, "params (graph vs eager)");
  expect_all_equal(graph_state.exp_avg_sqs, eager.exp_avg_sqs, "exp_avg_sqs (graph vs eager)");
  expect_all_equal(graph_state.steps, eager.steps, "steps (graph vs eager)");
  EXPECT_EQ(graph_state.steps[3].item<float>(), 2.0f);
}

#endif  // LIBTORCH_AMP_WITH_CUDA

}  // namespace
