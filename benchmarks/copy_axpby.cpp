// Question: how fast are kernels::scaled_copy_ and kernels::axpby_ (amp's gradient copies: unscaling half
// gradients into fp32 master gradients with an inf/NaN check; a*x + b*y when a delayed unscale accumulates) against
// the ATen ops a LibTorch user would call for the same job, on a few large tensors and on thousands of small ones?
//  - scaled copy, checked: ours in one pass; ATen: at::_foreach_copy_ (widen into the fp32 destination), then
//    at::_amp_foreach_non_finite_check_and_unscale_ (torch.amp's unscale) on it.
//  - axpby into fp32 (x in the dtype shown, y fp32): ours in one pass; ATen: _foreach_copy_ (x into out),
//    _foreach_mul_ (by a), _foreach_add_ (b * y).
// Prints GB/s (the job's minimal traffic: bytes read + written once) and our ratio, side by side in one run.
#include <string>
#include <vector>

#include <ATen/ops/_amp_foreach_non_finite_check_and_unscale.h>
#include <fmt/format.h>
#include <torch/torch.h>
#include <CLI/CLI.hpp>

#include <kernels/multi_tensor/axpby.h>
#include <kernels/multi_tensor/scaled_copy.h>

#include "common/command_line.h"
#include "common/flags.h"
#include "common/timing.h"
#include "common/workloads.h"

namespace {

std::vector<torch::Tensor> empty_like_list(const std::vector<torch::Tensor>& list, torch::ScalarType dtype) {
  std::vector<torch::Tensor> out;
  for (const auto& t : list) out.push_back(torch::empty(t.sizes(), t.options().dtype(dtype)));
  return out;
}

void print_row(const std::string& op, const bench::Workload& w, torch::ScalarType dtype, double bytes,
               const std::vector<bench::Contender>& contenders) {
  const double ours = bytes / bench::median(contenders[0].seconds) / 1e9;
  const double aten = bytes / bench::median(contenders[1].seconds) / 1e9;
  fmt::print("{:<12} {:<11} {:<9} {:>8} {:>10.1f} {:>10.1f} {:>9.2f}x\n", op, w.name, c10::toString(dtype),
             w.sizes.size(), ours, aten, ours / aten);
}

}  // namespace

int main(int argc, char** argv) {
  bench::CommonFlags flags(15);
  CLI::App app{"scaled_copy_ and axpby_ vs the ATen foreach ops for the same job"};
  flags.add_to(app, "The issue's sizes (1 GiB large; 5000 tensors of 1-64 Ki) instead of the quick ones");
  if (const auto status = examples::parse_flags(app, argc, argv)) return *status;
  const torch::Device device = flags.device();
  constexpr int kWarmup = 3;

  fmt::print("scaled copy and axpby on {} ({} mode, {} threads, ATen CPU capability {}, {} rounds, median)\n",
             device.str(), flags.full ? "full" : "quick", at::get_num_threads(), at::get_cpu_capability(),
             flags.rounds);
  fmt::print("{:<12} {:<11} {:<9} {:>8} {:>10} {:>10} {:>10}\n", "op", "workload", "dtype", "tensors", "ours GB/s",
             "ATen GB/s", "x ATen");
  for (const bench::Workload& w : bench::standard_workloads(flags.full)) {
    for (auto dtype : {torch::kFloat32, torch::kHalf, torch::kBFloat16}) {
      int64_t src_bytes = 0;
      const std::vector<torch::Tensor> src = bench::make_list(w.sizes, dtype, device, &src_bytes);
      std::vector<torch::Tensor> dst = empty_like_list(src, torch::kFloat);
      const double dst_bytes = static_cast<double>(src_bytes) / static_cast<double>(src[0].element_size()) * 4;
      torch::Tensor found_inf = torch::zeros({1}, torch::TensorOptions().device(device));
      const auto inv_scale = torch::full({1}, 1.0 / 1024, torch::TensorOptions().device(device));
      std::vector<bench::Contender> copy = {
          {"ours", [&] { kernels::scaled_copy_(src, dst, inv_scale, found_inf); }, {}},
          {"aten",
           [&] {
             at::_foreach_copy_(dst, src);
             at::_amp_foreach_non_finite_check_and_unscale_(dst, found_inf, inv_scale);
           },
           {}}};
      bench::run_interleaved(copy, device, kWarmup, flags.rounds);
      print_row("scaled copy", w, dtype, static_cast<double>(src_bytes) + dst_bytes, copy);

      int64_t y_bytes = 0;
      const std::vector<torch::Tensor> y = bench::make_list(w.sizes, torch::kFloat32, device, &y_bytes);
      std::vector<torch::Tensor> out = empty_like_list(src, torch::kFloat);
      constexpr double kA = 0.5;
      constexpr double kB = 0.25;
      std::vector<bench::Contender> axpby = {{"ours", [&] { kernels::axpby_(out, src, y, kA, kB); }, {}},
                                             {"aten",
                                              [&] {
                                                at::_foreach_copy_(out, src);
                                                at::_foreach_mul_(out, kA);
                                                at::_foreach_add_(out, y, kB);
                                              },
                                              {}}};
      bench::run_interleaved(axpby, device, kWarmup, flags.rounds);
      print_row("axpby", w, dtype, static_cast<double>(src_bytes + y_bytes) + dst_bytes, axpby);
    }
  }
  fmt::print("x ATen: our GB/s divided by ATen's (higher means ours is faster).\n");
  return 0;
}
