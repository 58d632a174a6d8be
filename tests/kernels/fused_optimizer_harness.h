#pragma once

// What the fused optimizer kernel tests share (fused_optimizers_test.cpp, fused_optimizers_cuda_test.cpp): a harness
// that runs our kernels next to torch::optim on the same gradients, and the comparisons.

#include <kernels/optim/fused_optimizers.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "test_util.h"

namespace fused_optimizer_test {

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

inline std::string describe(const RunSetup& s) {
  return std::string("params ") + c10::toString(s.param_dtype) + ", grads " + c10::toString(s.grad_dtype) +
         (s.masters ? ", fp32 masters" : ", no masters") + (s.scaled_grads ? ", scaled grads" : "") +
         (s.mixed_params ? ", mixed param dtypes" : "");
}

/// Elementwise |a - e| <= rtol * |e| + atol, where atol is at least rtol times the largest |e| of the tensor:
/// values that are sums of terms (moments, momentum) can cancel to near zero, and their rounding error is
/// that of the terms, not of the result.
inline void expect_all_close(const TensorVector& actual, const TensorVector& expected, double rtol, double atol_floor,
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

inline void expect_all_equal(const TensorVector& actual, const TensorVector& expected, const std::string& what) {
  ASSERT_EQ(actual.size(), expected.size()) << what;
  for (size_t i = 0; i < actual.size(); ++i) {
    EXPECT_TRUE(torch::equal(actual[i].cpu(), expected[i].cpu())) << what << "[" << i << "] changed or differs";
  }
}

inline TensorVector zeros_fp32(const TensorVector& like) {
  TensorVector out;
  for (const auto& t : like) out.push_back(torch::zeros({t.numel()}, t.options().dtype(torch::kFloat)));
  return out;
}

inline TensorVector clone_all(const TensorVector& v) {
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
inline void collect_adam_state(torch::optim::Optimizer& opt, const TensorVector& ref, TensorVector& exp_avg,
                               TensorVector& exp_avg_sq, TensorVector& max_exp_avg_sq) {
  for (const auto& p : ref) {
    auto& state = static_cast<State&>(*opt.state().at(p.unsafeGetTensorImpl()));
    exp_avg.push_back(state.exp_avg());
    exp_avg_sq.push_back(state.exp_avg_sq());
    if (state.max_exp_avg_sq().defined()) max_exp_avg_sq.push_back(state.max_exp_avg_sq());
  }
}

/// Runs kSteps of ours and of torch::optim::AdamW (decoupled) or Adam (L2) and compares params and moments.
inline void check_adam_against_torch(const RunSetup& setup, const AdamStepOptions& options,
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
inline void check_sgd_against_torch(const RunSetup& setup, const SgdStepOptions& options) {
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

/// Everything an Adam step may write, for bit-identity checks.
struct AdamState {
  TensorVector params, masters, exp_avgs, exp_avg_sqs, max_exp_avg_sqs;
  TensorVector steps;
  AdamState snapshot() const {
    return {clone_all(params),      clone_all(masters),         clone_all(exp_avgs),
            clone_all(exp_avg_sqs), clone_all(max_exp_avg_sqs), clone_all(steps)};
  }
};

inline void expect_bit_identical(const AdamState& now, const AdamState& before) {
  expect_all_equal(now.params, before.params, "params");
  expect_all_equal(now.masters, before.masters, "masters");
  expect_all_equal(now.exp_avgs, before.exp_avgs, "exp_avgs");
  expect_all_equal(now.exp_avg_sqs, before.exp_avg_sqs, "exp_avg_sqs");
  expect_all_equal(now.max_exp_avg_sqs, before.max_exp_avg_sqs, "max_exp_avg_sqs");
  expect_all_equal(now.steps, before.steps, "steps");
}

}  // namespace fused_optimizer_test
