// The fused optimizer kernels' bad input: each error names the argument, the index and the offending value, and
// nothing is written.

#include <kernels/optim/fused_optimizers.h>

#include <functional>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "test_util.h"

namespace {

using kernels::AdamStepOptions;
using kernels::SgdStepOptions;
using TensorVector = std::vector<torch::Tensor>;
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

}  // namespace
