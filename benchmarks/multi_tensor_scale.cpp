// Question: how fast is kernels::multi_tensor_scale_ against what LibTorch offers for the same job
// (at::_foreach_mul_ and a per-tensor mul_ loop), on a few large tensors and on thousands of small ones?
// Prints GB/s (bytes read + written) and our ratio to each peer, measured side by side in one run.
#include <cstdio>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <torch/torch.h>
#include <CLI/CLI.hpp>

#include <kernels/multi_tensor/multi_tensor_scale.h>

#include "common/command_line.h"
#include "common/flags.h"
#include "common/timing.h"
#include "common/workloads.h"

int main(int argc, char** argv) {
  bench::CommonFlags flags(15);
  CLI::App app{"multi_tensor_scale_ vs at::_foreach_mul_ vs a per-tensor loop"};
  flags.add_to(app, "The issue's sizes (1 GiB large; 5000 tensors of 1-64 Ki) instead of the quick ones");
  if (const auto status = examples::parse_flags(app, argc, argv)) return *status;
  const bool full = flags.full;
  const int rounds = flags.rounds;
  const torch::Device device = flags.device();

  fmt::print("multi_tensor_scale on {} ({} mode, {} rounds, median)\n", device.str(), full ? "full" : "quick", rounds);
  fmt::print("{:<11} {:<9} {:>8} {:>12} {:>12} {:>12} {:>10} {:>10}\n", "workload", "dtype", "tensors", "ours GB/s",
             "foreach GB/s", "loop GB/s", "x foreach", "x loop");
  for (const bench::Workload& w : bench::standard_workloads(full)) {
    for (auto dtype : {torch::kFloat32, torch::kHalf, torch::kBFloat16}) {
      int64_t bytes = 0;
      std::vector<torch::Tensor> list = bench::make_list(w.sizes, dtype, device, &bytes);
      bytes *= 2;  // read + write
      // Scaling by 1.0 keeps the values stable across many rounds; the work is the same for any scale.
      std::vector<bench::Contender> contenders = {{"ours", [&] { kernels::multi_tensor_scale_(list, 1.0); }, {}},
                                                  {"foreach", [&] { at::_foreach_mul_(list, 1.0); }, {}},
                                                  {"loop",
                                                   [&] {
                                                     for (auto& t : list) t.mul_(1.0);
                                                   },
                                                   {}}};
      bench::run_interleaved(contenders, device, 3, rounds);
      double gbs[3];
      for (int i = 0; i < 3; ++i) gbs[i] = static_cast<double>(bytes) / bench::median(contenders[i].seconds) / 1e9;
      fmt::print("{:<11} {:<9} {:>8} {:>12.1f} {:>12.1f} {:>12.1f} {:>9.2f}x {:>9.2f}x\n", w.name, c10::toString(dtype),
                 w.sizes.size(), gbs[0], gbs[1], gbs[2], gbs[0] / gbs[1], gbs[0] / gbs[2]);
    }
  }
  return 0;
}
