// Question: how fast is kernels::unscale_and_check_ against PyTorch's own unscale
// (at::_amp_foreach_non_finite_check_and_unscale_, what torch.amp.GradScaler calls) and against a per-tensor
// loop of it, on a few large tensors and on thousands of small ones, in fp32, fp16 and bf16?
// Prints GB/s (bytes read + written), ratios to each peer, and on a GPU the fraction of the device-to-device
// copy bandwidth measured in the same run (the physical limit for a read-modify-write pass).
#include <string>
#include <vector>

#include <ATen/ops/_amp_foreach_non_finite_check_and_unscale.h>
#include <fmt/format.h>
#include <torch/torch.h>
#include <CLI/CLI.hpp>

#include <kernels/multi_tensor/unscale.h>

#include "common/command_line.h"
#include "common/flags.h"
#include "common/timing.h"
#include "common/workloads.h"

namespace {

/// Device-to-device copy bandwidth (read + write bytes per second) on a buffer of `bytes`.
double copy_bandwidth(const torch::Device& device, int64_t bytes, int rounds) {
  auto src = torch::empty({bytes}, torch::TensorOptions().dtype(torch::kUInt8).device(device));
  auto dst = torch::empty_like(src);
  std::vector<bench::Contender> copy = {{"copy", [&] { dst.copy_(src); }, {}}};
  bench::run_interleaved(copy, device, 3, rounds);
  return 2.0 * static_cast<double>(bytes) / bench::median(copy[0].seconds);
}

std::string format_gbs(double bytes_per_second) {
  return bytes_per_second > 0 ? fmt::format("{:.1f}", bytes_per_second / 1e9) : "n/a";
}
std::string format_ratio(double ours, double peer) { return peer > 0 ? fmt::format("{:.2f}x", ours / peer) : "n/a"; }

}  // namespace

int main(int argc, char** argv) {
  bench::CommonFlags flags(15);
  CLI::App app{"unscale_and_check_ vs at::_amp_foreach_non_finite_check_and_unscale_ vs a per-tensor loop"};
  flags.add_to(app, "The issue's sizes (1 GiB large; 5000 tensors of 1-64 Ki) instead of the quick ones");
  if (const auto status = examples::parse_flags(app, argc, argv)) return *status;
  const bool full = flags.full;
  const int rounds = flags.rounds;
  const torch::Device device = flags.device();
  const auto on = torch::TensorOptions().device(device);
  const double copy_bw = device.is_cuda() ? copy_bandwidth(device, int64_t{1} << 30, rounds) : 0.0;

  fmt::print("unscale_and_check_ on {} ({} mode, {} rounds, median){}\n", device.str(), full ? "full" : "quick", rounds,
             device.is_cuda() ? fmt::format(", copy bandwidth {:.0f} GB/s", copy_bw / 1e9) : "");
  fmt::print("{:<11} {:<9} {:>8} {:>10} {:>10} {:>10} {:>9} {:>9} {:>8}\n", "workload", "dtype", "tensors", "ours GB/s",
             "aten GB/s", "loop GB/s", "x aten", "x loop", "of copy");
  for (const bench::Workload& w : bench::standard_workloads(full)) {
    for (auto dtype : {torch::kFloat32, torch::kHalf, torch::kBFloat16}) {
      int64_t bytes = 0;
      std::vector<torch::Tensor> grads = bench::make_list(w.sizes, dtype, device, &bytes);
      bytes *= 2;  // read + write
      // inv_scale 1 keeps the values stable over many rounds; every contender still reads and writes all.
      auto inv_scale = torch::ones({1}, on);
      auto found_inf = torch::zeros({1}, on);
      auto first = torch::full({1}, kernels::kNoNonFiniteIndex, on.dtype(torch::kInt));
      std::vector<bench::Contender> contenders = {
          {"ours", [&] { kernels::unscale_and_check_(grads, inv_scale, found_inf, first); }, {}},
          {"aten", [&] { at::_amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale); }, {}},
          {"loop",
           [&] {
             for (auto& g : grads) at::_amp_foreach_non_finite_check_and_unscale_({g}, found_inf, inv_scale);
           },
           {}}};
      // ATen's CUDA unscale rejects bf16 (pytorch #127176): time only what runs.
      std::vector<bool> runs(contenders.size(), true);
      for (size_t i = 1; i < contenders.size(); ++i) {
        try {
          contenders[i].run();
        } catch (const c10::Error&) {
          runs[i] = false;
          contenders[i].run = [] {};
        }
      }
      bench::run_interleaved(contenders, device, 3, rounds);
      double bw[3];
      for (size_t i = 0; i < 3; ++i) {
        bw[i] = runs[i] ? static_cast<double>(bytes) / bench::median(contenders[i].seconds) : 0.0;
      }
      fmt::print("{:<11} {:<9} {:>8} {:>10} {:>10} {:>10} {:>9} {:>9} {:>8}\n", w.name, c10::toString(dtype),
                 w.sizes.size(), format_gbs(bw[0]), format_gbs(bw[1]), format_gbs(bw[2]), format_ratio(bw[0], bw[1]),
                 format_ratio(bw[0], bw[2]), copy_bw > 0 ? fmt::format("{:.0f}%", 100.0 * bw[0] / copy_bw) : "-");
    }
  }
  return 0;
}
