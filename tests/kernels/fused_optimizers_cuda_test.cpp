// The fused optimizer kernels on CUDA (the GPU check): agreement with the CPU twin and torch::optim, skipping on
// device, and CUDA graph capture.

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

#include "kernels/fused_optimizer_harness.h"
#include "test_util.h"

namespace {

using namespace fused_optimizer_test;  // NOLINT(google-build-using-namespace): the shared harness
using kernels::AdamStepOptions;
using kernels::SgdStepOptions;

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
