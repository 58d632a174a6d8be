// Question: what does amp's per-step bookkeeping cost against the loop a LibTorch user writes by hand today
// (at::autocast + at::_amp_foreach_non_finite_check_and_unscale_ + at::_amp_update_scale_ + torch::optim::AdamW,
// with the one .item() that decides the skip)? Same model (~200 parameter tensors), same data, same optimizer,
// timed side by side in one run. Prints ms/step and our ratio (hand-rolled time / ours: > 1 means we are faster).
// On CUDA also: the O2 step with FusedAdamW run eagerly against the same step replayed from a CUDA graph.
#include <memory>
#include <string>
#include <vector>

#include <ATen/autocast_mode.h>
#include <ATen/ops/_amp_foreach_non_finite_check_and_unscale.h>
#include <ATen/ops/_amp_update_scale.h>
#include <fmt/format.h>
#include <torch/torch.h>
#include <CLI/CLI.hpp>

#include <amp/amp.h>
#include <amp/optim/fused_optimizers.h>

#ifdef LIBTORCH_AMP_WITH_CUDA
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include "common/command_line.h"
#include "common/timing.h"
#include "common/workloads.h"

namespace {

/// A deep MLP: `layers` Linear layers (weight + bias each), so 2 * layers parameter tensors.
struct DeepMlpImpl : torch::nn::Module {
  DeepMlpImpl(int64_t layers, int64_t width) {
    for (int64_t i = 0; i < layers; ++i) {
      blocks.push_back(register_module("fc" + std::to_string(i), torch::nn::Linear(width, width)));
    }
  }
  torch::Tensor forward(torch::Tensor x) {
    for (auto& block : blocks) x = torch::tanh(block(x));  // bounded: no step overflows, every step is taken
    return x;
  }
  std::vector<torch::nn::Linear> blocks;
};
TORCH_MODULE(DeepMlp);

DeepMlp deep_mlp_on(int64_t layers, int64_t width, const torch::Device& device) {
  DeepMlp net(layers, width);
  net->to(device);
  return net;
}

/// One O2 step with FusedAdamW: forward, scale_loss scope, fused step.
void o2_step(amp::Initialized<DeepMlp>& s, const torch::Tensor& x) {
  s.optimizer.zero_grad();
  auto loss = s.model(x).pow(2).mean();
  {
    auto scaled = amp::scale_loss(loss, s.optimizer);
    scaled.backward();
  }
  s.optimizer.step();
}

#ifdef LIBTORCH_AMP_WITH_CUDA
/// The O2 + FusedAdamW step twice: run eagerly, and captured once in a CUDA graph and replayed (Note [capture-safe
/// step] in kernels/capture.h). Both on one side stream (a graph cannot be captured on the default stream).
struct GraphedO2 {
  GraphedO2(int64_t layers, int64_t width, const torch::Tensor& x, const torch::Device& device)
      : eager_net(deep_mlp_on(layers, width, device)),
        graph_net(deep_mlp_on(layers, width, device)),
        eager_adam(eager_net->parameters(), amp::FusedAdamOptions(1e-3).weight_decay(1e-2)),
        graph_adam(graph_net->parameters(), amp::FusedAdamOptions(1e-3).weight_decay(1e-2)),
        eager(amp::initialize(eager_net, eager_adam, options())),
        graph(amp::initialize(graph_net, graph_adam, options())),
        static_x(x.clone()),
        stream(c10::cuda::getStreamFromPool(false, device.index())) {
    const c10::cuda::CUDAStreamGuard on_stream(stream);
    for (int i = 0; i < 3; ++i) o2_step(graph, static_x);  // creates the optimizer state outside the capture
    cuda_graph.capture_begin();
    o2_step(graph, static_x);
    cuda_graph.capture_end();
  }
  static amp::Options options() {
    return amp::Options().opt_level(amp::OptLevel::O2).half_dtype(torch::kHalf).dynamic_loss_scale();
  }
  void run_eager() {
    const c10::cuda::CUDAStreamGuard on_stream(stream);
    o2_step(eager, static_x);
  }
  void replay() {
    const c10::cuda::CUDAStreamGuard on_stream(stream);
    cuda_graph.replay();
  }

  DeepMlp eager_net, graph_net;
  amp::FusedAdamW eager_adam, graph_adam;
  amp::Initialized<DeepMlp> eager, graph;
  torch::Tensor static_x;
  c10::cuda::CUDAStream stream;
  at::cuda::CUDAGraph cuda_graph;
};
#endif

}  // namespace

int main(int argc, char** argv) {
  std::string device_name = "auto";
  int rounds = 20;
  int64_t layers = 100, width = 64, batch = 32;
  CLI::App app{"amp bookkeeping vs a hand-rolled at::autocast + GradScaler-equivalent loop"};
  app.add_option("--device", device_name, "auto, cpu or cuda");
  app.add_option("--rounds", rounds, "Timed steps per contender")->check(CLI::PositiveNumber);
  app.add_option("--layers", layers, "Linear layers (2 parameter tensors each)")->check(CLI::PositiveNumber);
  app.add_option("--width", width, "Layer width")->check(CLI::PositiveNumber);
  app.add_option("--batch", batch, "Batch size")->check(CLI::PositiveNumber);
  if (const auto status = examples::parse_flags(app, argc, argv)) return *status;
  const torch::Device device = bench::parse_device(device_name);
  const auto half = device.is_cuda() ? torch::kHalf : torch::kBFloat16;

  torch::manual_seed(0);
  DeepMlp ours_net(layers, width), hand_net(layers, width), fused_net(layers, width);
  ours_net->to(device);
  hand_net->to(device);
  fused_net->to(device);
  torch::optim::AdamW ours_adam(ours_net->parameters(), 1e-3), hand_adam(hand_net->parameters(), 1e-3);
  // Dynamic scaling in both, so both pay for the same scaler work.
  auto [model, optimizer] = amp::initialize(
      ours_net, ours_adam, amp::Options().opt_level(amp::OptLevel::O1).half_dtype(half).dynamic_loss_scale());
  amp::FusedAdamW fused_adam(fused_net->parameters(), amp::FusedAdamOptions(1e-3).weight_decay(1e-2));
  auto fused = amp::initialize(fused_net, fused_adam,
                               amp::Options().opt_level(amp::OptLevel::O1).half_dtype(half).dynamic_loss_scale());
  const auto x = torch::randn({batch, width}, torch::TensorOptions().device(device));

  auto f32 = torch::TensorOptions().device(device);
  auto scale = torch::full({1}, 65536.0f, f32);
  auto growth_tracker = torch::zeros({1}, f32.dtype(torch::kInt));
  auto found_inf = torch::zeros({1}, f32);
  const auto params = hand_net->parameters();

  std::vector<bench::Contender> contenders = {
      {"amp",
       [&] {
         optimizer.zero_grad();
         auto loss = model(x).pow(2).mean();
         {
           auto scaled = amp::scale_loss(loss, optimizer);
           scaled.backward();
         }
         optimizer.step();
       },
       {}},
      {"amp+fused",
       [&] {
         fused.optimizer.zero_grad();
         auto loss = fused.model(x).pow(2).mean();
         {
           auto scaled = amp::scale_loss(loss, fused.optimizer);
           scaled.backward();
         }
         fused.optimizer.step();
       },
       {}},
      {"hand-rolled",
       [&] {
         hand_adam.zero_grad();
         at::autocast::set_autocast_enabled(device.type(), true);
         at::autocast::set_autocast_dtype(device.type(), half);
         at::autocast::increment_nesting();
         auto loss = hand_net->forward(x).to(torch::kFloat).pow(2).mean();
         if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
         at::autocast::set_autocast_enabled(device.type(), false);
         (loss * scale).backward();
         std::vector<torch::Tensor> grads;
         for (const auto& p : params) grads.push_back(p.grad());
         found_inf.zero_();
         const auto inv_scale = scale.to(torch::kDouble).reciprocal().to(torch::kFloat);
         at::_amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale);
         if (found_inf.item<float>() == 0.0f) hand_adam.step();
         at::_amp_update_scale_(scale, growth_tracker, found_inf, 2.0, 0.5, 2000);
       },
       {}}};
#ifdef LIBTORCH_AMP_WITH_CUDA
  std::unique_ptr<GraphedO2> graphed;
  if (device.is_cuda()) {
    graphed = std::make_unique<GraphedO2>(layers, width, x, device);
    contenders.push_back({"amp O2+fused eager", [&] { graphed->run_eager(); }, {}});
    contenders.push_back({"amp O2+fused graph", [&] { graphed->replay(); }, {}});
  }
#endif
  bench::run_interleaved(contenders, device, 5, rounds);
  const double ours = bench::median(contenders[0].seconds), fused_time = bench::median(contenders[1].seconds),
               hand = bench::median(contenders[2].seconds);
  fmt::print("amp overhead on {} ({} parameter tensors, width {}, batch {}, {} autocast, torch::optim::AdamW)\n",
             device.str(), 2 * layers, width, batch, c10::toString(half));
  fmt::print("{:<14} {:>10}\n", "loop", "ms/step");
  fmt::print("{:<14} {:>10.3f}\n", "amp (O1)", ours * 1e3);
  fmt::print("{:<14} {:>10.3f}\n", "amp + FusedAdamW", fused_time * 1e3);
  fmt::print("{:<14} {:>10.3f}\n", "hand-rolled", hand * 1e3);
  fmt::print("skipped steps: amp {}, amp+fused {}; hand-rolled clean steps in a row {} (no step may overflow)\n",
             optimizer.scaler().diagnostics_now().skipped_steps,
             fused.optimizer.scaler().diagnostics_now().skipped_steps, growth_tracker.item<int>());
  fmt::print("amp speed vs hand-rolled: {:.2f}x (torch::optim::AdamW), {:.2f}x (amp::FusedAdamW)\n", hand / ours,
             hand / fused_time);
  if (contenders.size() == 5) {
    const double eager = bench::median(contenders[3].seconds), replayed = bench::median(contenders[4].seconds);
    fmt::print("{:<28} {:>10.3f}\n", "amp O2 + FusedAdamW, eager", eager * 1e3);
    fmt::print("{:<28} {:>10.3f}\n", "amp O2 + FusedAdamW, graph", replayed * 1e3);
    fmt::print("CUDA graph replay vs eager O2 step: {:.2f}x\n", eager / replayed);
  } else {
    fmt::print("amp O2 + FusedAdamW, CUDA graph replay vs eager: skipped on {} (needs a CUDA device)\n", device.str());
  }
  return 0;
}
