// Question: at transformer MLP shapes (tokens x hidden -> 4 hidden), how fast are forward + backward of
// amp::Float8Linear (FP8 GEMMs through at::_scaled_mm, delayed and current scaling) against a bf16 layer: ATen's
// torch::nn::Linear and ours (amp::FusedDense, cuBLASLt epilogues)? The goal: >= 1.5x the bf16 layer at the
// largest shape on an H200, reported as TFLOP/s and as a fraction of the FP8 peak.
// Every contender runs the same three GEMMs (forward, input gradient, weight gradient) on the same data, interleaved
// (common/timing.h). Float8Linear's step includes its casts, amaxes and the once-per-step scale update.
// On a CPU _scaled_mm runs through oneDNN: the table then says what FP8 costs there, not what Hopper gains.
#include <algorithm>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <torch/torch.h>
#include <CLI/CLI.hpp>

#ifdef LIBTORCH_AMP_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#endif

#include <amp/nn/float8_linear.h>
#include <amp/nn/fused_dense.h>

#include "common/command_line.h"
#include "common/flags.h"
#include "common/timing.h"

namespace {

struct MlpShape {
  int64_t tokens;
  int64_t hidden;  // the layer maps hidden -> 4 hidden
};

// The grid on the GPU (--full: tokens 8K/16K/32K x hidden 4K/8K), two of them by default, CPU-sized shapes
// otherwise.
std::vector<MlpShape> shapes(bool full, bool cuda) {
  if (!cuda)
    return full ? std::vector<MlpShape>{{256, 256}, {1024, 512}, {2048, 1024}}
                : std::vector<MlpShape>{{256, 256}, {1024, 512}};
  if (!full) return {{8192, 4096}, {16384, 8192}};
  std::vector<MlpShape> grid;
  for (int64_t tokens : {8192, 16384, 32768}) {
    for (int64_t hidden : {4096, 8192}) grid.push_back({tokens, hidden});
  }
  return grid;
}

constexpr int64_t kExpansion = 4;
constexpr double kFlopsPerMacFwdBwd = 3 * 2;  // forward + 2 backward GEMMs, 2 flops per multiply-add
// NVIDIA's datasheet dense FP8 tensor-core rate of the H100/H200 SXM (sm_90), TFLOP/s, without sparsity.
constexpr double kHopperFp8PeakTflops = 1979.0;

void clear_grads(torch::nn::Module& m) {
  for (auto& p : m.parameters()) p.mutable_grad().reset();
}

}  // namespace

int main(int argc, char** argv) {
  bench::CommonFlags flags(10);
  CLI::App app{"Float8Linear (FP8 GEMMs) vs bf16 Linear (ATen) and FusedDense (ours), forward + backward"};
  flags.add_to(app, "The issue's grid on the GPU: tokens 8K/16K/32K x hidden 4K/8K (4x expansion)");
  if (const auto status = examples::parse_flags(app, argc, argv)) return *status;
  const torch::Device device = flags.device();
  const bool cuda = device.is_cuda();
  double fp8_peak = 0.0;
#ifdef LIBTORCH_AMP_WITH_CUDA
  if (cuda && at::cuda::getCurrentDeviceProperties()->major == 9) fp8_peak = kHopperFp8PeakTflops;
#endif
  fmt::print("fp8_linear on {} ({} mode, {} rounds, median), bf16 inputs and outputs, {} threads\n", device.str(),
             flags.full ? "full" : "quick", flags.rounds, at::get_num_threads());
  fmt::print("{:>7} {:>6} {:>6} {:>11} {:>11} {:>11} {:>11} {:>9} {:>9} {:>7}\n", "tokens", "hidden", "ffn",
             "ATen TF/s", "ours TF/s", "fp8 dly", "fp8 cur", "x ATen", "x ours", "%fp8pk");
  double last_ratio = 0.0;
  MlpShape last{};
  for (const MlpShape& s : shapes(flags.full, cuda)) {
    const int64_t ffn = kExpansion * s.hidden;
    const auto opts = torch::TensorOptions().dtype(torch::kBFloat16).device(device);
    const auto x = torch::randn({s.tokens, s.hidden}, opts).requires_grad_();
    const auto dy = torch::randn({s.tokens, ffn}, opts);
    torch::manual_seed(1);
    torch::nn::Linear aten(s.hidden, ffn);
    torch::manual_seed(1);
    amp::FusedDense ours(s.hidden, ffn);
    torch::manual_seed(1);
    amp::Float8Linear delayed(s.hidden, ffn);
    torch::manual_seed(1);
    amp::Float8Linear current(s.hidden, ffn);
    for (torch::nn::Module* m :
         std::initializer_list<torch::nn::Module*>{aten.get(), ours.get(), delayed.get(), current.get()}) {
      m->to(device, torch::kBFloat16);
    }
    delayed->enable_fp8(amp::Fp8Recipe());
    current->enable_fp8(amp::Fp8Recipe().scaling(amp::Fp8Scaling::kCurrent));
    auto step = [&](torch::nn::Module& m, const std::function<torch::Tensor()>& forward) {
      clear_grads(m);
      x.mutable_grad().reset();
      forward().backward(dy);
    };
    std::vector<bench::Contender> contenders = {{"aten", [&] { step(*aten, [&] { return aten(x); }); }, {}},
                                                {"ours", [&] { step(*ours, [&] { return ours(x); }); }, {}},
                                                {"fp8 delayed",
                                                 [&] {
                                                   step(*delayed, [&] { return delayed(x); });
                                                   delayed->update_fp8_scales();
                                                 },
                                                 {}},
                                                {"fp8 current",
                                                 [&] {
                                                   step(*current, [&] { return current(x); });
                                                   current->update_fp8_scales();
                                                 },
                                                 {}}};
    bench::run_interleaved(contenders, device, 3, flags.rounds);
    const double macs = static_cast<double>(s.tokens) * s.hidden * ffn;
    auto tflops = [&](int i) { return kFlopsPerMacFwdBwd * macs / bench::median(contenders[i].seconds) / 1e12; };
    const double best_fp8 = std::max(tflops(2), tflops(3));
    const double best_bf16 = std::max(tflops(0), tflops(1));
    last_ratio = best_fp8 / best_bf16;
    last = s;
    fmt::print("{:>7} {:>6} {:>6} {:>11.3f} {:>11.3f} {:>11.3f} {:>11.3f} {:>8.2f}x {:>8.2f}x {:>7}\n", s.tokens,
               s.hidden, ffn, tflops(0), tflops(1), tflops(2), tflops(3), best_fp8 / tflops(0), best_fp8 / tflops(1),
               fp8_peak > 0 ? fmt::format("{:.0f}%", 100 * best_fp8 / fp8_peak) : std::string("n/a"));
    std::fflush(stdout);
  }
  fmt::print(
      "largest shape ({} tokens x {} hidden -> {}): FP8 {:.2f}x the faster bf16 layer (goal on the H200: 1.5x)\n",
      last.tokens, last.hidden, kExpansion * last.hidden, last_ratio);
  return 0;
}
