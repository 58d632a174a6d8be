// Question: how fast is kernels::multi_tensor_scale_ against what LibTorch offers for the same job
// (at::_foreach_mul_ and a per-tensor mul_ loop), on a few large tensors and on thousands of small ones?
// Prints GB/s (bytes read + written) and our ratio to each peer, measured side by side in one run.
#include <cstdio>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <torch/torch.h>
#include <CLI/CLI.hpp>

#include <kernels/multi_tensor_scale.h>

#include "common/timing.h"

namespace {

struct Workload {
  std::string name;
  std::vector<int64_t> sizes;
};

std::vector<Workload> workloads(bool full) {
  Workload large{"large", {}};
  Workload small{"many-small", {}};
  const int64_t large_count = full ? 64 : 8;
  const int64_t large_elements = full ? (int64_t{1} << 22) : (int64_t{1} << 20);  // full: 64 x 16 MiB fp32 = 1 GiB
  for (int64_t i = 0; i < large_count; ++i) large.sizes.push_back(large_elements);
  const int64_t small_count = full ? 5000 : 2000;
  const int64_t small_max_kib = full ? 64 : 8;
  for (int64_t i = 0; i < small_count; ++i) small.sizes.push_back(1024 * (1 + (i * 7919) % small_max_kib));
  return {large, small};
}

}  // namespace

int main(int argc, char** argv) {
  bool full = false;
  std::string device_name = "auto";
  int rounds = 15;
  CLI::App app{"multi_tensor_scale_ vs at::_foreach_mul_ vs a per-tensor loop"};
  app.add_flag("--full", full, "The issue's sizes (1 GiB large; 5000 tensors of 1-64 Ki) instead of the quick ones");
  app.add_option("--device", device_name, "auto, cpu or cuda");
  app.add_option("--rounds", rounds, "Timed rounds per contender")->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);
  const torch::Device device =
      device_name == "auto" ? (torch::cuda::is_available() ? torch::Device(torch::kCUDA) : torch::Device(torch::kCPU))
                            : torch::Device(device_name);

  fmt::print("multi_tensor_scale on {} ({} mode, {} rounds, median)\n", device.str(), full ? "full" : "quick", rounds);
  fmt::print("{:<11} {:<9} {:>8} {:>12} {:>12} {:>12} {:>10} {:>10}\n", "workload", "dtype", "tensors", "ours GB/s",
             "foreach GB/s", "loop GB/s", "x foreach", "x loop");
  for (const Workload& w : workloads(full)) {
    for (auto dtype : {torch::kFloat32, torch::kHalf, torch::kBFloat16}) {
      std::vector<torch::Tensor> list;
      int64_t bytes = 0;
      for (int64_t n : w.sizes) {
        list.push_back(torch::randn({n}, torch::TensorOptions().dtype(dtype).device(device)));
        bytes += 2 * n * static_cast<int64_t>(list.back().element_size());
      }
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
