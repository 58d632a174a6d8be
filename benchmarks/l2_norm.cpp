// Question: how fast are kernels::l2_norm and kernels::clip_grad_norm_ against what torch's clip_grad_norm_
// does (at::_foreach_norm(list, 2), then at::linalg_vector_norm(at::stack(norms)); for clipping, then
// clamp(max_norm / (total + 1e-6), max = 1) and at::_foreach_mul_), on a few large tensors and on thousands of
// small ones? Prints GB/s (norm: bytes read; clip: bytes read twice and written once), medians in microseconds
// and our ratio to torch, measured side by side in one run.
#include <cstdio>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <torch/torch.h>
#include <CLI/CLI.hpp>

#include <kernels/multi_tensor/l2_norm.h>

#include "common/command_line.h"
#include "common/flags.h"
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

/// What torch.nn.utils.clip_grad_norm_ computes for the L2 norm (its foreach path), without a host sync.
torch::Tensor torch_total_norm(const std::vector<torch::Tensor>& list) {
  return at::linalg_vector_norm(at::stack(at::_foreach_norm(list, 2)), 2);
}

/// torch.nn.utils.clip_grad_norm_'s clipping step after the norm (foreach path, no host sync).
void torch_clip(const std::vector<torch::Tensor>& list, double max_norm) {
  const torch::Tensor coef = max_norm / (torch_total_norm(list) + 1e-6);
  at::_foreach_mul_(list, at::clamp_max(coef, 1.0));
}

/// Each clip contender lowers its max_norm by this factor per call, so that every call clips (scales every
/// element) although the previous call already brought the norm down to the previous max_norm.
constexpr double kMaxNormDecay = 0.999;

struct Row {
  std::string op;
  double bytes;
  double ours_s;
  double torch_s;
};

void print_row(const Row& row, const Workload& w, torch::ScalarType dtype) {
  const double ours_gbs = row.bytes / row.ours_s / 1e9;
  const double torch_gbs = row.bytes / row.torch_s / 1e9;
  fmt::print("{:<5} {:<11} {:<9} {:>8} {:>11.1f} {:>11.1f} {:>10.1f} {:>10.1f} {:>9.2f}x\n", row.op, w.name,
             c10::toString(dtype), w.sizes.size(), ours_gbs, torch_gbs, row.ours_s * 1e6, row.torch_s * 1e6,
             ours_gbs / torch_gbs);
}

}  // namespace

int main(int argc, char** argv) {
  bench::CommonFlags flags(15);
  CLI::App app{"l2_norm / clip_grad_norm_ vs torch's foreach_norm + stack + vector_norm (+ foreach_mul_)"};
  flags.add_to(app, "The issue's sizes (1 GiB large; 5000 tensors of 1-64 Ki) instead of the quick ones");
  if (const auto status = examples::parse_flags(app, argc, argv)) return *status;
  const bool full = flags.full;
  const int rounds = flags.rounds;
  const torch::Device device = flags.device();
  constexpr int kWarmup = 3;

  fmt::print("l2_norm on {} ({} mode, {} rounds, median)\n", device.str(), full ? "full" : "quick", rounds);
  fmt::print("{:<5} {:<11} {:<9} {:>8} {:>11} {:>11} {:>10} {:>10} {:>10}\n", "op", "workload", "dtype", "tensors",
             "ours GB/s", "torch GB/s", "ours us", "torch us", "x torch");
  for (const Workload& w : workloads(full)) {
    for (auto dtype : {torch::kFloat32, torch::kHalf, torch::kBFloat16}) {
      std::vector<torch::Tensor> list;
      double bytes = 0;
      for (int64_t n : w.sizes) {
        list.push_back(torch::randn({n}, torch::TensorOptions().dtype(dtype).device(device)));
        bytes += static_cast<double>(n * list.back().element_size());
      }

      std::vector<bench::Contender> norms = {{"ours", [&] { kernels::l2_norm(list); }, {}},
                                             {"torch", [&] { torch_total_norm(list); }, {}}};
      bench::run_interleaved(norms, device, kWarmup, rounds);
      print_row({"norm", bytes, bench::median(norms[0].seconds), bench::median(norms[1].seconds)}, w, dtype);

      // Each clip contender works on its own copy, with its own decreasing max_norm (see kMaxNormDecay).
      std::vector<torch::Tensor> ours_grads;
      std::vector<torch::Tensor> torch_grads;
      for (const auto& t : list) {
        ours_grads.push_back(t.clone());
        torch_grads.push_back(t.clone());
      }
      list.clear();
      const double start_max_norm = 0.5 * torch_total_norm(ours_grads).item<double>();
      double ours_max_norm = start_max_norm;
      double torch_max_norm = start_max_norm;
      std::vector<bench::Contender> clips = {{"ours",
                                              [&] {
                                                kernels::clip_grad_norm_(ours_grads, ours_max_norm);
                                                ours_max_norm *= kMaxNormDecay;
                                              },
                                              {}},
                                             {"torch",
                                              [&] {
                                                torch_clip(torch_grads, torch_max_norm);
                                                torch_max_norm *= kMaxNormDecay;
                                              },
                                              {}}};
      bench::run_interleaved(clips, device, kWarmup, rounds);
      print_row({"clip", 3 * bytes, bench::median(clips[0].seconds), bench::median(clips[1].seconds)}, w, dtype);
    }
  }
  return 0;
}
