#pragma once

// The main job's three training loops (benchmarks/amp_vs_fp32.cpp) over one task: the plain LibTorch loop (FP32,
// TF32), amp (initialize, scale_loss, step) and the O1-equivalent loop a LibTorch user writes by hand today.

#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include <ATen/autocast_mode.h>
#include <torch/torch.h>

#include <amp/amp.h>

#include "common/amp_report.h"
#include "common/training_tasks.h"

namespace bench {

/// torch.amp.GradScaler's defaults, used by the hand-rolled loop (the values a user copies).
constexpr double kLoopInitScale = 65536.0;
constexpr double kLoopGrowthFactor = 2.0;
constexpr double kLoopBackoffFactor = 0.5;
constexpr int64_t kLoopGrowthInterval = 2000;
/// What one run needs from its precision configuration: a training step, inference under the same precision,
/// the module (for train()/eval()), and what to read after the last step.
struct Trainer {
  std::function<at::Tensor(const Batch&)> step;  // returns the step's loss on the device (no host sync)
  ForwardFn forward;                             // fp32 logits
  torch::nn::Module* module = nullptr;
  std::function<void(RunResult&)> finish;  // skipped steps and final loss scale, where there are any
};

// ---- The three training loops -----------------------------------------------------------------------------

/// FP32 and TF32: the plain LibTorch loop.
template <typename Task>
Trainer plain_trainer(const Task& task) {
  struct State {
    typename Task::Net net;
    std::unique_ptr<torch::optim::Optimizer> optimizer;
  };
  auto s = std::make_shared<State>(State{task.make_model(), nullptr});
  s->optimizer = task.make_optimizer(s->net);
  Trainer t;
  t.module = s->net.ptr().get();
  t.step = [s, &task](const Batch& b) {
    s->optimizer->zero_grad();
    auto loss = task.loss(s->net->forward(b.input), b);
    loss.backward();
    s->optimizer->step();
    return loss.detach();
  };
  t.forward = [s](const at::Tensor& x) { return s->net->forward(x); };
  t.finish = [s](RunResult&) {};
  return t;
}

/// amp: initialize, scale_loss, step (see amp/amp.h).
template <typename Task>
Trainer amp_trainer(const Task& task, amp::OptLevel level, c10::ScalarType dtype, bool fp8) {
  using Net = typename Task::Net;
  struct State {
    Net net;
    std::unique_ptr<torch::optim::Optimizer> inner;
    std::optional<amp::Initialized<Net>> amp;
  };
  auto s = std::make_shared<State>(State{task.make_model(), nullptr, std::nullopt});
  s->inner = task.make_optimizer(s->net);
  amp::Options options = amp::Options().opt_level(level).half_dtype(dtype);
  if (fp8) options.fp8(amp::Fp8Recipe());
  s->amp.emplace(amp::initialize(s->net, *s->inner, options));
  Trainer t;
  t.module = s->net.ptr().get();
  t.step = [s, &task](const Batch& b) {
    auto& model = s->amp->model;
    auto& optimizer = s->amp->optimizer;
    optimizer.zero_grad();
    auto loss = task.loss(model(b.input), b);
    {
      auto scaled = amp::scale_loss(loss, optimizer);
      scaled.backward();
    }
    optimizer.step();
    return loss.detach();
  };
  t.forward = [s](const at::Tensor& x) { return s->amp->model(x); };
  t.finish = [s](RunResult& r) {
    const amp::ScalerDiagnostics d = s->amp->optimizer.scaler().diagnostics_now();
    r.skipped_steps = d.skipped_steps;
    r.final_scale = d.scale;
  };
  return t;
}

/// Peer: the O1-equivalent loop a LibTorch user writes by hand today (what torch.amp does, spelled out in ATen).
template <typename Task>
Trainer loop_trainer(const Task& task, c10::ScalarType dtype, const torch::Device& device) {
  struct State {
    typename Task::Net net;
    std::unique_ptr<torch::optim::Optimizer> optimizer;
    at::Tensor scale, growth_tracker, found_inf;
    int64_t skipped = 0;
  };
  const auto f32 = torch::TensorOptions().dtype(torch::kFloat).device(device);
  auto s = std::make_shared<State>(State{task.make_model(), nullptr, torch::full({}, kLoopInitScale, f32),
                                         torch::zeros({}, f32.dtype(torch::kInt)), torch::zeros({}, f32), 0});
  s->optimizer = task.make_optimizer(s->net);
  const c10::DeviceType device_type = device.type();
  auto forward = [s, device_type, dtype](const at::Tensor& x) {
    at::autocast::set_autocast_enabled(device_type, true);
    at::autocast::set_autocast_dtype(device_type, dtype);
    auto logits = s->net->forward(x);
    at::autocast::set_autocast_enabled(device_type, false);
    at::autocast::clear_cache();  // the cast weights must not outlive the optimizer step
    return logits.to(torch::kFloat);
  };
  Trainer t;
  t.module = s->net.ptr().get();
  t.forward = forward;
  t.step = [s, &task, forward](const Batch& b) {
    s->optimizer->zero_grad();
    auto loss = task.loss(forward(b.input), b);
    (loss * s->scale).backward();
    std::vector<at::Tensor> grads;
    for (const auto& p : s->net->parameters()) {
      if (p.grad().defined()) grads.push_back(p.grad());
    }
    s->found_inf.zero_();
    at::_amp_foreach_non_finite_check_and_unscale_(grads, s->found_inf, s->scale.reciprocal());
    // torch::optim cannot skip on the device: one host read per step, as torch.amp's GradScaler.step does.
    if (s->found_inf.template item<float>() == 0.0f) {
      s->optimizer->step();
    } else {
      ++s->skipped;
    }
    at::_amp_update_scale_(s->scale, s->growth_tracker, s->found_inf, kLoopGrowthFactor, kLoopBackoffFactor,
                           kLoopGrowthInterval);
    return loss.detach();
  };
  t.finish = [s](RunResult& r) {
    r.skipped_steps = s->skipped;
    r.final_scale = s->scale.template item<double>();
  };
  return t;
}

}  // namespace bench
