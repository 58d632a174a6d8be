// Question: how fast is one optimizer step with our fused kernels (kernels::fused_adam_step_, fused_sgd_step_)
// against what LibTorch offers for the same job (at::_fused_adamw_ / _fused_adam_ / _fused_sgd_, and
// torch::optim's AdamW / Adam / SGD step), on a transformer-like parameter list? --optimizer picks AdamW (the
// default), Adam (L2 weight decay) or SGD with momentum.
//
// Two jobs, each timed for all three contenders side by side (interleaved rounds, medians):
//  - "bf16+master": bf16 model params and bf16 grads, fp32 master weights (AMP O2). Ours does it in one pass.
//    The peers must widen the grads to fp32 (_foreach_copy_), step the masters, and copy the masters back into
//    the bf16 params (_foreach_copy_), which is what Apex's O2 and a C++ port of it do.
//  - "fp32": fp32 params and grads, no masters; every contender steps the params directly.
// GB/s is the job's minimal traffic divided by each contender's time, so the columns compare directly: 28 bytes
// per element for Adam(W) in both jobs (read grad, both moments and master or param; write them back, plus the
// bf16 param), 20 for SGD (one momentum buffer instead of two moments).
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <torch/torch.h>
#include <CLI/CLI.hpp>

#include <kernels/optim/fused_optimizers.h>

#include "common/command_line.h"
#include "common/flags.h"
#include "common/timing.h"

namespace {

constexpr double kLr = 1e-3;
constexpr double kWeightDecay = 0.01;
constexpr double kBeta1 = 0.9;
constexpr double kBeta2 = 0.999;
constexpr double kEps = 1e-8;
constexpr double kMomentum = 0.9;

/// Parameter sizes of a small transformer (quick) or the 5000 tensors of 1-64 Ki plus a few large
/// ones (full).
std::vector<int64_t> parameter_sizes(bool full) {
  std::vector<int64_t> sizes;
  if (full) {
    for (int64_t i = 0; i < 5000; ++i) sizes.push_back(1024 * (1 + (i * 7919) % 64));
    for (int i = 0; i < 4; ++i) sizes.push_back(int64_t{16} << 20);  // embeddings / output projections
    return sizes;
  }
  const int64_t d = 128;
  const int64_t vocab = 4096;
  const int64_t layers = 16;
  sizes.push_back(vocab * d);  // token embedding
  for (int64_t l = 0; l < layers; ++l) {
    for (int64_t n : {d, d, 3 * d * d, 3 * d, d * d, d, d, d, 4 * d * d, 4 * d, 4 * d * d, d}) sizes.push_back(n);
  }
  sizes.push_back(d);
  sizes.push_back(d);  // final layer norm
  return sizes;
}

struct Result {
  std::string job;
  double seconds[3];
  bool fused_available;
};

enum class Optimizer { kAdamW, kAdam, kSgd };

/// Bytes of minimal traffic per element (see the header comment); the same for both jobs.
int64_t bytes_per_element(Optimizer o) { return o == Optimizer::kSgd ? 20 : 28; }

const char* name_of(Optimizer o) { return o == Optimizer::kAdamW ? "AdamW" : o == Optimizer::kAdam ? "Adam" : "SGD"; }

std::unique_ptr<torch::optim::Optimizer> make_optim(Optimizer o, const std::vector<torch::Tensor>& params) {
  switch (o) {
    case Optimizer::kAdamW:
      return std::make_unique<torch::optim::AdamW>(
          params, torch::optim::AdamWOptions(kLr).betas({kBeta1, kBeta2}).eps(kEps).weight_decay(kWeightDecay));
    case Optimizer::kAdam:
      return std::make_unique<torch::optim::Adam>(
          params, torch::optim::AdamOptions(kLr).betas({kBeta1, kBeta2}).eps(kEps).weight_decay(kWeightDecay));
    case Optimizer::kSgd:
      break;
  }
  return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(kLr).momentum(kMomentum));
}

/// LibTorch's fused step for `o` on (params, grads) with its own state; returns false (and says why, once) if this
/// build lacks it.
bool aten_fused_step(Optimizer o, const std::vector<torch::Tensor>& params, const std::vector<torch::Tensor>& grads,
                     const std::vector<torch::Tensor>& exp_avgs, const std::vector<torch::Tensor>& exp_avg_sqs,
                     const std::vector<torch::Tensor>& steps, const std::vector<torch::Tensor>& buffers,
                     bool first_step) {
  try {
    switch (o) {
      case Optimizer::kAdamW:
        at::_fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, {}, steps, kLr, kBeta1, kBeta2, kWeightDecay, kEps,
                          false, false);
        break;
      case Optimizer::kAdam:
        at::_fused_adam_(params, grads, exp_avgs, exp_avg_sqs, {}, steps, kLr, kBeta1, kBeta2, kWeightDecay, kEps,
                         false, false);
        break;
      case Optimizer::kSgd:
        at::_fused_sgd_(params, grads, buffers, 0.0, kMomentum, kLr, 0.0, false, false, first_step);
        break;
    }
    return true;
  } catch (const c10::Error& e) {
    fmt::print("LibTorch's fused {} step is not available here: {}\n", name_of(o), e.what_without_backtrace());
    return false;
  }
}

std::vector<torch::Tensor> make_list(const std::vector<int64_t>& sizes, const torch::TensorOptions& options,
                                     bool random) {
  std::vector<torch::Tensor> list;
  for (int64_t n : sizes) list.push_back(random ? torch::randn({n}, options) : torch::zeros({n}, options));
  return list;
}

Result run_job(Optimizer o, bool with_masters, const std::vector<int64_t>& sizes, const torch::Device& device,
               int rounds) {
  const auto fp32 = torch::TensorOptions().dtype(torch::kFloat).device(device);
  const auto model_dtype = with_masters ? torch::kBFloat16 : torch::kFloat;
  const auto model = fp32.dtype(model_dtype);
  auto masters = with_masters ? make_list(sizes, fp32, true) : std::vector<torch::Tensor>{};
  auto params = make_list(sizes, model, true);
  const auto grads = make_list(sizes, model, true);
  // Ours and LibTorch's fused step share the state buffers (the values only drift; the work is the same).
  const bool adam = o != Optimizer::kSgd;
  auto exp_avgs = adam ? make_list(sizes, fp32, false) : std::vector<torch::Tensor>{};
  auto exp_avg_sqs = adam ? make_list(sizes, fp32, false) : std::vector<torch::Tensor>{};
  auto buffers = adam ? std::vector<torch::Tensor>{} : make_list(sizes, fp32, false);
  const auto lr = torch::full({1}, kLr, fp32);
  std::vector<torch::Tensor> steps, fused_steps;  // per parameter, for ours and for LibTorch's fused step
  for (size_t i = 0; i < sizes.size(); ++i) {
    steps.push_back(torch::zeros({1}, fp32));
    fused_steps.push_back(torch::zeros({}, fp32));
  }

  // The peers update fp32 tensors from fp32 grads: the masters and widened grads, or the fp32 params.
  auto& peer_params = with_masters ? masters : params;
  auto peer_grads = with_masters ? make_list(sizes, fp32, false) : grads;
  for (size_t i = 0; i < sizes.size(); ++i) peer_params[i].mutable_grad() = peer_grads[i];
  const std::unique_ptr<torch::optim::Optimizer> optim = make_optim(o, peer_params);

  auto widen_grads = [&] {
    if (with_masters) at::_foreach_copy_(peer_grads, grads);
  };
  auto write_back = [&] {
    if (with_masters) at::_foreach_copy_(params, masters);
  };
  // The first call (untimed) also takes SGD's first step, which fills the momentum buffers.
  const bool fused_ok = aten_fused_step(o, peer_params, peer_grads, exp_avgs, exp_avg_sqs, fused_steps, buffers, true);
  const auto adam_options = kernels::AdamStepOptions()
                                .beta1(kBeta1)
                                .beta2(kBeta2)
                                .eps(kEps)
                                .weight_decay(kWeightDecay)
                                .decoupled_weight_decay(o == Optimizer::kAdamW);
  const auto sgd_options = kernels::SgdStepOptions().momentum(kMomentum);
  std::vector<bench::Contender> contenders = {
      {"ours",
       [&] {
         if (adam) {
           kernels::fused_adam_step_(params, grads, exp_avgs, exp_avg_sqs, {}, masters, steps, lr, adam_options);
         } else {
           kernels::fused_sgd_step_(params, grads, buffers, masters, steps, lr, sgd_options);
         }
       },
       {}},
      {"fused",
       [&] {
         if (!fused_ok) return;
         widen_grads();
         aten_fused_step(o, peer_params, peer_grads, exp_avgs, exp_avg_sqs, fused_steps, buffers, false);
         write_back();
       },
       {}},
      {"optim",
       [&] {
         widen_grads();
         optim->step();
         write_back();
       },
       {}}};
  constexpr int kWarmup = 2;
  bench::run_interleaved(contenders, device, kWarmup, rounds);
  Result r{with_masters ? "bf16+master" : "fp32", {}, fused_ok};
  for (int i = 0; i < 3; ++i) r.seconds[i] = bench::median(contenders[i].seconds);
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  bench::CommonFlags flags(10);
  std::string optimizer_name = "adamw";
  CLI::App app{
      "Our fused optimizer step vs LibTorch's fused step (at::_fused_adamw_ / _fused_adam_ / _fused_sgd_) vs "
      "torch::optim's step"};
  flags.add_to(app, "The issue's 5000 tensors of 1-64 Ki plus 4 x 16 Mi instead of a small transformer");
  app.add_option("--optimizer", optimizer_name, "adamw, adam (L2 weight decay) or sgd (momentum 0.9)")
      ->check(CLI::IsMember({"adamw", "adam", "sgd"}))
      ->default_str("adamw");
  if (const auto status = examples::parse_flags(app, argc, argv)) return *status;
  const bool full = flags.full;
  const int rounds = flags.rounds;
  const torch::Device device = flags.device();

  const Optimizer optimizer = optimizer_name == "adam"  ? Optimizer::kAdam
                              : optimizer_name == "sgd" ? Optimizer::kSgd
                                                        : Optimizer::kAdamW;
  const std::vector<int64_t> sizes = parameter_sizes(full);
  int64_t elements = 0;
  for (int64_t n : sizes) elements += n;
  fmt::print(
      "fused {} step on {} ({} mode: {} tensors, {:.2f} M elements; {} threads, ATen CPU capability {}; {} rounds, "
      "median)\n",
      name_of(optimizer), device.str(), full ? "full" : "quick", sizes.size(), static_cast<double>(elements) / 1e6,
      at::get_num_threads(), at::get_cpu_capability(), rounds);
  fmt::print("{:<12} {:>9} {:>9} {:>9} {:>10} {:>10} {:>10} {:>8} {:>8}\n", "job", "ours ms", "fused ms", "optim ms",
             "ours GB/s", "fused GB/s", "optim GB/s", "x fused", "x optim");
  const double bytes = static_cast<double>(elements * bytes_per_element(optimizer));
  for (bool with_masters : {true, false}) {
    const Result r = run_job(optimizer, with_masters, sizes, device, rounds);
    auto ms = [](double s) { return fmt::format("{:.2f}", s * 1e3); };
    auto gbs = [&](double s) { return fmt::format("{:.1f}", bytes / s / 1e9); };
    auto ratio = [&](double s) { return fmt::format("{:.2f}x", s / r.seconds[0]); };
    const std::string na = "n/a";
    fmt::print("{:<12} {:>9} {:>9} {:>9} {:>10} {:>10} {:>10} {:>8} {:>8}\n", r.job, ms(r.seconds[0]),
               r.fused_available ? ms(r.seconds[1]) : na, ms(r.seconds[2]), gbs(r.seconds[0]),
               r.fused_available ? gbs(r.seconds[1]) : na, gbs(r.seconds[2]),
               r.fused_available ? ratio(r.seconds[1]) : na, ratio(r.seconds[2]));
  }
  fmt::print("x fused / x optim: the peer's time divided by ours (higher means ours is faster).\n");
  return 0;
}
