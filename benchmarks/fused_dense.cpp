// Question: at transformer MLP shapes, how fast are forward + backward of amp::FusedDense and amp::FusedDenseGeluDense
// against torch::nn::Linear (+ torch::gelu, tanh) on ATen, which already uses cuBLASLt for the plain addmm? And how
// close do they come to the GPU's matmul rate, measured in the same run with one big at::mm?
// Prints TFLOP/s, the fraction of that rate, the ratio to ATen and the path DensePath::kAuto chose per shape (with
// the milliseconds it measured for each path). On a CPU every contender runs ATen ops (cuBLASLt is GPU-only):
// the table then compares the fallback with plain Linear.
#include <cstdio>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <torch/torch.h>
#include <CLI/CLI.hpp>

#include <amp/nn/fused_dense.h>
#include <kernels/gemm/path_autotune.h>

#include "common/command_line.h"
#include "common/flags.h"
#include "common/timing.h"

namespace {

struct MlpShape {
  int64_t tokens;
  int64_t hidden;  // the MLP expands hidden -> 4 hidden -> hidden
};

// The grid on the GPU (--full), a bounded subset on the GPU by default, CPU-sized shapes otherwise.
std::vector<MlpShape> shapes(bool full, bool cuda) {
  if (!cuda) return {{64, 64}, {256, 128}};
  if (!full) return {{2048, 1024}, {8192, 4096}};
  std::vector<MlpShape> grid;
  for (int64_t tokens : {2048, 8192, 16384}) {
    for (int64_t hidden : {1024, 4096, 8192}) grid.push_back({tokens, hidden});
  }
  return grid;
}

constexpr int64_t kExpansion = 4;
// Forward (1 GEMM) + backward (2 GEMMs) per linear layer, 2 flops per multiply-add.
constexpr double kFlopsPerMacFwdBwd = 3 * 2;

// The device's matmul rate: one large bf16 at::mm, median of `rounds`.
double peak_tflops(const torch::Device& device, int rounds) {
  const int64_t n = device.is_cuda() ? 8192 : 512;
  const auto opts = torch::TensorOptions().dtype(torch::kBFloat16).device(device);
  const auto a = torch::randn({n, n}, opts);
  const auto b = torch::randn({n, n}, opts);
  torch::Tensor c;
  std::vector<bench::Contender> mm = {{"mm", [&] { c = at::mm(a, b); }, {}}};
  bench::run_interleaved(mm, device, 3, rounds);
  return 2.0 * static_cast<double>(n * n * n) / bench::median(mm[0].seconds) / 1e12;
}

void clear_grads(torch::nn::Module& m) {
  for (auto& p : m.parameters()) p.mutable_grad().reset();
}

std::string path_note(const kernels::PathKey& key) {
  const auto choice = kernels::cached_path(key);
  if (!choice) return "aten (no GPU: cuBLASLt is GPU-only)";
  return fmt::format("{} (lt {:.2f} ms, aten {:.2f} ms)", kernels::gemm_path_name(choice->path), choice->cublaslt_ms,
                     choice->aten_ms);
}

struct Row {
  std::string layer;
  std::string dtype;
  MlpShape shape;
  double aten_tflops, auto_tflops, lt_tflops, fraction_of_peak, ratio;
  std::string chosen;
};

}  // namespace

int main(int argc, char** argv) {
  bench::CommonFlags flags(10);
  CLI::App app{"FusedDense / FusedDenseGeluDense vs torch::nn::Linear + torch::gelu, forward + backward"};
  flags.add_to(app, "The issue's grid on the GPU: tokens 2K/8K/16K x hidden 1K/4K/8K (4x expansion)");
  if (const auto status = examples::parse_flags(app, argc, argv)) return *status;
  const torch::Device device = flags.device();
  const bool cuda = device.is_cuda();
  const int rounds = flags.rounds;

  const double peak = peak_tflops(device, rounds);
  fmt::print("fused_dense on {} ({} mode, {} rounds, median); measured bf16 at::mm rate: {:.1f} TFLOP/s\n",
             device.str(), flags.full ? "full" : "quick", rounds, peak);
  if (!cuda) fmt::print("no GPU: the cuBLASLt path is GPU-only; every contender runs ATen ops here\n");
  fmt::print("{:<6} {:<9} {:>7} {:>6} {:>6} {:>11} {:>11} {:>11} {:>7} {:>8}  {}\n", "layer", "dtype", "tokens",
             "hidden", "ffn", "ATen TF/s", "auto TF/s", "lt TF/s", "%peak", "x ATen", "path chosen by auto");

  std::vector<Row> rows;
  for (auto dtype : {torch::kBFloat16, torch::kHalf}) {
    if (!cuda && dtype == torch::kHalf) continue;  // CPU fp16 matmuls are not what this question is about
    const auto opts = torch::TensorOptions().dtype(dtype).device(device);
    for (const MlpShape& s : shapes(flags.full, cuda)) {
      const int64_t ffn = kExpansion * s.hidden;
      const auto x = torch::randn({s.tokens, s.hidden}, opts).requires_grad_();
      for (const std::string layer : {"dense", "mlp"}) {
        const bool mlp = layer == "mlp";
        torch::nn::Sequential reference;
        torch::nn::AnyModule ours_auto, ours_lt;
        if (mlp) {
          torch::nn::Linear first(s.hidden, ffn);
          torch::nn::Linear second(ffn, s.hidden);
          reference =
              torch::nn::Sequential(first, torch::nn::GELU(torch::nn::GELUOptions().approximate("tanh")), second);
          ours_auto = torch::nn::AnyModule(amp::FusedDenseGeluDense(s.hidden, ffn, s.hidden));
          ours_lt = torch::nn::AnyModule(amp::FusedDenseGeluDense(
              amp::FusedDenseGeluDenseOptions(s.hidden, ffn, s.hidden).path(amp::DensePath::kCublasLt)));
        } else {
          reference = torch::nn::Sequential(torch::nn::Linear(s.hidden, ffn));
          ours_auto = torch::nn::AnyModule(amp::FusedDense(s.hidden, ffn));
          ours_lt = torch::nn::AnyModule(
              amp::FusedDense(amp::FusedDenseOptions(s.hidden, ffn).path(amp::DensePath::kCublasLt)));
        }
        reference->to(device, dtype);
        ours_auto.ptr()->to(device, dtype);
        ours_lt.ptr()->to(device, dtype);
        const auto dy = torch::randn({s.tokens, mlp ? s.hidden : ffn}, opts);
        auto step = [&](torch::nn::Module& m, const std::function<torch::Tensor()>& forward) {
          clear_grads(m);
          x.mutable_grad().reset();
          forward().backward(dy);
        };
        std::vector<bench::Contender> contenders = {
            {"aten", [&] { step(*reference, [&] { return reference->forward(x); }); }, {}},
            {"auto", [&] { step(*ours_auto.ptr(), [&] { return ours_auto.forward(x); }); }, {}},
            {"lt", [&] { step(*ours_lt.ptr(), [&] { return ours_lt.forward(x); }); }, {}}};
        bench::run_interleaved(contenders, device, 3, rounds);
        const double macs = static_cast<double>(s.tokens) * s.hidden * ffn * (mlp ? 2 : 1);
        auto tflops = [&](int i) { return kFlopsPerMacFwdBwd * macs / bench::median(contenders[i].seconds) / 1e12; };
        const kernels::PathKey key = {mlp ? 2 : 1,
                                      s.tokens,
                                      s.hidden,
                                      mlp ? ffn : 0,
                                      mlp ? s.hidden : ffn,
                                      static_cast<int64_t>(dtype),
                                      device.index() < 0 ? 0 : device.index(),
                                      1};
        Row r{layer, c10::toString(dtype), s, tflops(0), tflops(1), tflops(2), 0.0, 0.0, path_note(key)};
        r.fraction_of_peak = r.auto_tflops / peak;
        r.ratio = r.auto_tflops / r.aten_tflops;
        fmt::print("{:<6} {:<9} {:>7} {:>6} {:>6} {:>11.2f} {:>11.2f} {:>11.2f} {:>6.0f}% {:>7.2f}x  {}\n", r.layer,
                   r.dtype, s.tokens, s.hidden, ffn, r.aten_tflops, r.auto_tflops, r.lt_tflops,
                   100 * r.fraction_of_peak, r.ratio, r.chosen);
        std::fflush(stdout);
        rows.push_back(r);
      }
    }
  }
  // Headline (the target: >= 1.1x ATen for the GELU MLP at the large shapes): the largest MLP row.
  const Row* best = nullptr;
  for (const Row& r : rows) {
    if (r.layer == "mlp" &&
        (best == nullptr || r.shape.tokens * r.shape.hidden >= best->shape.tokens * best->shape.hidden))
      best = &r;
  }
  if (best != nullptr) {
    fmt::print("largest mlp ({} tokens x {} hidden, {}): {:.2f}x ATen, {:.0f}% of the at::mm rate, auto chose {}\n",
               best->shape.tokens, best->shape.hidden, best->dtype, best->ratio, 100 * best->fraction_of_peak,
               best->chosen);
  }
  return 0;
}
