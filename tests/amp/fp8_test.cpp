// amp::Float8Linear and FP8 training (docs/fp8.md): the GEMMs against fp64 references computed from the same
// quantized values, the scaling rules against Transformer Engine's formulas (tests/golden/fp8_scaling.csv), and
// training under amp (convergence against bf16, checkpoints, DDP).

#include <amp/nn/float8_linear.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <amp/amp.h>
#ifdef LIBTORCH_AMP_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAFunctions.h>
#endif
#include <amp/autocast.h>
#include <amp/fp8/fp8_state.h>
#include <amp/optim/fused_optimizers.h>
#include <ddp/distributed_data_parallel.h>
#include <kernels/gemm/fp8.h>

#include "ddp/ddp_test_util.h"
#include "test_util.h"

namespace {

using amp::Fp8Recipe;
using amp::Fp8Scaling;
using test_util::expect_error;

// Normwise closeness: err relative to the largest magnitude of the reference.
void expect_close(const torch::Tensor& actual, const torch::Tensor& expected, double rtol, const std::string& what) {
  ASSERT_TRUE(actual.defined()) << what << " is undefined";
  ASSERT_EQ(actual.sizes(), expected.sizes()) << what;
  const auto e = expected.detach().to(torch::kFloat64);
  const double scale = e.abs().max().item<double>();
  const double err = (actual.detach().to(torch::kFloat64) - e).abs().max().item<double>();
  EXPECT_LE(err, rtol * scale + 1e-30) << what << ": max error " << err << " vs scale " << scale;
}

float amax_of(const torch::Tensor& t) { return t.abs().max().item<float>(); }

/// The fp64 value of t quantized to `dtype` with scale s (float), read back with 1/s (float), as the layer does.
torch::Tensor dequantized(const torch::Tensor& t, float s, c10::ScalarType dtype) {
  const auto q = kernels::fp8_quantize(t, torch::full({1}, s), dtype, torch::Tensor());
  return q.to(torch::kFloat64) * static_cast<double>(1.0f / s);
}

struct GemmCase {
  int64_t rows, in, out;
  Fp8Scaling scaling;
  amp::Fp8Format format = amp::Fp8Format::kHybrid;
};

class Fp8GemmTest : public ::testing::TestWithParam<GemmCase> {};

// Forward, input gradient and weight gradient each equal the fp64 product of the quantized operands within fp32
// accumulation error; the bias gradient is the sum of the unquantized output gradient; the amaxes are recorded.
TEST_P(Fp8GemmTest, EachGemmEqualsTheFp64ProductOfTheQuantizedOperands) {
  const GemmCase c = GetParam();
  torch::manual_seed(7);
  amp::Float8Linear layer(c.in, c.out);
  const Fp8Recipe recipe = Fp8Recipe().scaling(c.scaling).format(c.format).amax_history_len(4);
  layer->enable_fp8(recipe);
  const c10::ScalarType g_dtype = recipe.dtype(amp::kFp8GradOutput);
  const float g_max = kernels::fp8_max(g_dtype);
  const auto x = (torch::randn({c.rows, c.in}) * 3.0).requires_grad_(true);
  const auto g = torch::randn({c.rows, c.out}) * 1e-3;
  // Delayed scaling casts with the state's scales: give them values that do not saturate (and one that does not
  // fit 448 exactly), as a history would.
  float sx, sw, sg;
  if (c.scaling == Fp8Scaling::kDelayed) {
    sx = 448.0f / (amax_of(x) * 1.5f);
    sw = 448.0f / amax_of(layer->weight);
    sg = g_max / (amax_of(g) * 3.0f);
    layer->fp8_meta().scale.copy_(torch::tensor({sx, sw, sg}));
    layer->fp8_meta().scale_inv.copy_(1.0f / layer->fp8_meta().scale);
  } else {
    sx = 448.0f / amax_of(x);
    sw = 448.0f / amax_of(layer->weight);
    sg = g_max / amax_of(g);
  }
  const auto y = layer(x);
  y.backward(g);

  // The CPU FP8 GEMM is an fp32 at::mm of exact FP8 values (detail::fp8_mm): on every kernel path an fp32 sum of
  // K <= 80 exact products (Note [bounds on every CPU kernel path]), ~sqrt(K) 2^-24 of max |y| in practice (1e-7;
  // worst case K 2^-24 sum |a b|), so 1e-5 normwise has a margin of ~100 and tolerates no quantization error (~1e-2).
  // check_kernel_paths.py checks that fp32 GEMMs stay fp32 on three settings (no bf16 down-conversion on AMX). The
  // bias gradient is ATen's fp32 sum over <= 48 rows, each column's in row order on every vector width: 1e-6.
  const auto xq = dequantized(x.detach(), sx, at::kFloat8_e4m3fn);
  const auto wq = dequantized(layer->weight.detach(), sw, at::kFloat8_e4m3fn);
  const auto gq = dequantized(g, sg, g_dtype);
  expect_close(y, xq.mm(wq.t()) + layer->bias.detach().to(torch::kFloat64), 1e-5, "forward");
  expect_close(x.grad(), gq.mm(wq), 1e-5, "input gradient");
  expect_close(layer->weight.grad(), gq.t().mm(xq), 1e-5, "weight gradient");
  expect_close(layer->bias.grad(), g.to(torch::kFloat64).sum(0), 1e-6, "bias gradient");
  // The quantization is real: the fp32 product differs from the quantized one by far more than rounding.
  EXPECT_GT((y.detach().to(torch::kFloat64) -
             torch::addmm(layer->bias.detach(), x.detach(), layer->weight.detach().t()).to(torch::kFloat64))
                .abs()
                .max()
                .item<double>(),
            1e-3);
  const auto history = layer->fp8_meta().history;
  EXPECT_EQ(history[amp::kFp8Input][0].item<float>(), amax_of(x));
  EXPECT_EQ(history[amp::kFp8Weight][0].item<float>(), amax_of(layer->weight));
  EXPECT_EQ(history[amp::kFp8GradOutput][0].item<float>(), amax_of(g));
}

// The CPU's FP8 GEMM (an exact upcast and an fp32 GEMM; LibTorch's CPU _scaled_mm is a slow reference path) agrees
// with at::_scaled_mm on the CPU: within fp32 accumulation error for fp32 outputs, within one rounding for bf16
// outputs, with and without bias, for E4M3 x E4M3 and E5M2 x E4M3.
TEST(Fp8GemmCpuTest, CpuGemmAgreesWithScaledMm) {
  torch::manual_seed(13);
  for (const auto& [m, k, n] : {std::make_tuple(32, 48, 16), std::make_tuple(48, 64, 80)}) {
    for (const auto a_dtype : {at::kFloat8_e4m3fn, at::kFloat8_e5m2}) {
      const auto a = (torch::randn({m, k}) * 8.0).to(a_dtype);
      const auto b = (torch::randn({n, k}) * 8.0).to(at::kFloat8_e4m3fn).t();  // column-major [k, n]
      const auto sa = torch::full({1}, 0.375f);
      const auto sb = torch::full({1}, 1.0f / 3.0f);
      const auto bias = torch::randn({n}).to(torch::kBFloat16);
      const auto ours32 = amp::detail::fp8_mm(a, b, sa, sb, std::nullopt, torch::kFloat);
      const auto aten32 = at::_scaled_mm(a, b, sa, sb, std::nullopt, std::nullopt, torch::kFloat);
      expect_close(ours32, aten32, 1e-6, "fp32 output");
      const auto ours16 = amp::detail::fp8_mm(a, b, sa, sb, bias, torch::kBFloat16);
      const auto aten16 = at::_scaled_mm(a, b, sa, sb, bias, std::nullopt, torch::kBFloat16);
      EXPECT_EQ(ours16.scalar_type(), torch::kBFloat16);
      expect_close(ours16, aten16, 1.0 / 128, "bf16 output with bias");
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, Fp8GemmTest,
                         ::testing::Values(GemmCase{32, 64, 48, Fp8Scaling::kDelayed},
                                           GemmCase{32, 64, 48, Fp8Scaling::kCurrent},
                                           GemmCase{37, 80, 16, Fp8Scaling::kDelayed},
                                           GemmCase{37, 80, 16, Fp8Scaling::kCurrent},
                                           GemmCase{5, 16, 32, Fp8Scaling::kCurrent},
                                           GemmCase{48, 32, 64, Fp8Scaling::kDelayed, amp::Fp8Format::kE4M3},
                                           GemmCase{21, 32, 64, Fp8Scaling::kCurrent, amp::Fp8Format::kE4M3}),
                         [](const auto& info) {
                           const GemmCase& c = info.param;
                           return std::to_string(c.rows) + "x" + std::to_string(c.in) + "x" + std::to_string(c.out) +
                                  (c.scaling == Fp8Scaling::kDelayed ? "_delayed" : "_current") +
                                  (c.format == amp::Fp8Format::kE4M3 ? "_e4m3" : "");
                         });

// ---- The scaling rules ----------------------------------------------------------------------------------------

uint32_t bits_of(float x) {
  uint32_t b;
  std::memcpy(&b, &x, sizeof(b));
  return b;
}

float float_of(const std::string& hex) {
  const auto b = static_cast<uint32_t>(std::stoul(hex, nullptr, 16));
  float x;
  std::memcpy(&x, &b, sizeof(x));
  return x;
}

struct GoldenStep {
  std::string case_name;
  float fp8_max = 0;
  int64_t length = 0, margin = 0;
  bool use_max = true;
  float amax = 0;
  bool skip = false;
  uint32_t scale = 0, scale_inv = 0;
};

std::vector<GoldenStep> read_fp8_golden() {
  const std::string path = std::string(LTA_GOLDEN_DIR) + "/fp8_scaling.csv";
  std::ifstream in(path);
  EXPECT_TRUE(in.good()) << "cannot open " << path;
  std::vector<GoldenStep> rows;
  std::string line;
  std::getline(in, line);  // case,fp8_max,length,margin,algo,step,amax,skip,scale,scale_inv
  while (std::getline(in, line)) {
    std::stringstream fields(line);
    std::vector<std::string> f;
    std::string field;
    while (std::getline(fields, field, ',')) f.push_back(field);
    EXPECT_EQ(f.size(), 10u) << line;
    if (f.size() != 10u) break;
    GoldenStep row;
    row.case_name = f[0];
    row.fp8_max = std::stof(f[1]);
    row.length = std::stoll(f[2]);
    row.margin = std::stoll(f[3]);
    row.use_max = f[4] == "max";
    row.amax = float_of(f[6]);
    row.skip = f[7] == "1";
    row.scale = static_cast<uint32_t>(std::stoul(f[8], nullptr, 16));
    row.scale_inv = static_cast<uint32_t>(std::stoul(f[9], nullptr, 16));
    rows.push_back(row);
  }
  return rows;
}

// Transformer Engine's delayed-scaling formulas (tests/golden/generate_fp8_scaling_golden.py): the amax of each
// step goes through the cast kernel's amax into column 0 of a history, the update kernel rolls it and computes the
// scale; every scale and scale_inv equals the reference bit for bit, over zero, subnormal, inf and NaN amaxes
// (the last two skip the step), history lengths 1 to 1024, margins and both amax algorithms.
TEST(Fp8ScalingTest, DelayedScalingFollowsTransformerEnginesFormulasBitForBit) {
  const auto rows = read_fp8_golden();
  ASSERT_EQ(rows.size(), 200u);
  std::string current;
  torch::Tensor history, scale, scale_inv, max;
  int checked = 0, skipped = 0;
  for (const auto& row : rows) {
    if (row.case_name != current) {
      current = row.case_name;
      history = torch::zeros({2, row.length});  // two rows: a second tensor with its own (constant) amax
      scale = torch::ones({2});
      scale_inv = torch::ones({2});
      max = torch::full({2}, row.fp8_max);
    }
    kernels::fp8_amax_(torch::full({3}, row.amax) * torch::tensor({1.0f, -1.0f, 0.5f}), history[0].narrow(0, 0, 1));
    kernels::fp8_amax_(torch::full({1}, 2.0f), history[1].narrow(0, 0, 1));
    const auto found_inf = torch::full({1}, std::isfinite(row.amax) ? 0.0f : 1.0f);
    kernels::fp8_update_scales_(history, scale, scale_inv, max, found_inf, row.margin, row.use_max);
    EXPECT_EQ(bits_of(scale[0].item<float>()), row.scale) << row.case_name << " amax " << row.amax;
    EXPECT_EQ(bits_of(scale_inv[0].item<float>()), row.scale_inv) << row.case_name << " amax " << row.amax;
    EXPECT_EQ(history[0][0].item<float>(), 0.0f) << "column 0 is cleared by every update";
    EXPECT_TRUE(torch::isfinite(history).all().item<bool>()) << row.case_name << ": a non-finite amax got in";
    ++checked;
    skipped += row.skip ? 1 : 0;
  }
  EXPECT_EQ(checked, 200);
  EXPECT_GT(skipped, 10) << "the golden script should exercise skipped steps";
}

// With a history of length 1, delayed scaling casts each step with the scale current scaling gave the previous
// step's tensor.
TEST(Fp8ScalingTest, HistoryOfLengthOneEqualsCurrentScalingOfThePreviousStep) {
  torch::manual_seed(3);
  amp::Float8Linear layer(32, 16);
  layer->enable_fp8(Fp8Recipe().amax_history_len(1).margin(1));
  torch::Tensor previous;
  for (int step = 0; step < 5; ++step) {
    const auto x = torch::randn({8, 32}) * std::pow(10.0, step - 2);
    if (previous.defined()) {
      auto amax = torch::zeros({1});
      auto s = torch::empty({1});
      auto s_inv = torch::empty({1});
      kernels::fp8_amax_(previous, amax);
      kernels::fp8_current_scale_(amax, s, s_inv, 448.0f, 1);
      EXPECT_EQ(layer->fp8_meta().scale[amp::kFp8Input].item<float>(), s.item<float>()) << "step " << step;
      EXPECT_EQ(layer->fp8_meta().scale_inv[amp::kFp8Input].item<float>(), s_inv.item<float>()) << "step " << step;
      EXPECT_TRUE(torch::equal(
          kernels::fp8_quantize(x, layer->fp8_meta().scale.narrow(0, 0, 1), at::kFloat8_e4m3fn, torch::Tensor())
              .view(torch::kByte),
          kernels::fp8_quantize(x, s, at::kFloat8_e4m3fn, torch::Tensor()).view(torch::kByte)));
    }
    layer(x).sum().backward();
    layer->update_fp8_scales();
    previous = x;
  }
}

// The cast saturates to the format's largest finite value and keeps NaN, as Transformer Engine's satfinite casts;
// the amax is the largest |x|, and a NaN anywhere makes it NaN.
TEST(Fp8ScalingTest, CastSaturatesKeepsNanAndRecordsTheAmax) {
  const float inf = std::numeric_limits<float>::infinity();
  const auto x = torch::tensor({1.0f, -1000.0f, 500.0f, 3.0f, -inf, inf});
  auto amax = torch::zeros({1});
  const auto q = kernels::fp8_quantize(x, torch::ones({1}), at::kFloat8_e4m3fn, amax).to(torch::kFloat);
  EXPECT_TRUE(torch::equal(q, torch::tensor({1.0f, -448.0f, 448.0f, 3.0f, -448.0f, 448.0f})));
  EXPECT_EQ(amax.item<float>(), inf);
  const auto e5 =
      kernels::fp8_quantize(torch::tensor({1e6f, -7e4f}), torch::ones({1}), at::kFloat8_e5m2, torch::Tensor())
          .to(torch::kFloat);
  EXPECT_TRUE(torch::equal(e5, torch::tensor({57344.0f, -57344.0f})));
  auto nan_amax = torch::full({1}, 5.0f);
  const auto with_nan = torch::tensor({1.0f, std::nanf(""), 2.0f});
  const auto qn = kernels::fp8_quantize(with_nan, torch::full({1}, 2.0f), at::kFloat8_e4m3fn, nan_amax);
  EXPECT_TRUE(std::isnan(nan_amax.item<float>()));
  EXPECT_TRUE(std::isnan(qn.to(torch::kFloat)[1].item<float>()));
  EXPECT_EQ(qn.to(torch::kFloat)[2].item<float>(), 4.0f);
  // Large tensors go through the parallel path: the amax is the same.
  const auto big = torch::randn({300000});
  auto big_amax = torch::zeros({1});
  kernels::fp8_amax_(big, big_amax);
  EXPECT_EQ(big_amax.item<float>(), big.abs().max().item<float>());
  expect_error([] { kernels::fp8_quantize(torch::ones({2}, torch::kInt), torch::ones({1}), at::kFloat8_e4m3fn, {}); },
               "can cast fp32, fp16 or bf16");
  expect_error([] { kernels::fp8_quantize(torch::ones({2}), torch::ones({1}), at::kHalf, {}); },
               "FP8 dtype must be Float8_e4m3fn or Float8_e5m2");
}

// The cast-transpose writes q and its transpose (rows zero-padded to the GEMM's multiple) from one pass, identical to
// the plain cast, with the same amax, for shapes at and off the 32 x 32 tiles and both formats.
TEST(Fp8ScalingTest, CastTransposeWritesBothLayoutsAndZeroPadding) {
  torch::manual_seed(8);
  for (const auto& [rows, cols, dtype] :
       {std::make_tuple(37, 80, at::kFloat8_e4m3fn), std::make_tuple(64, 48, at::kFloat8_e5m2),
        std::make_tuple(300, 33, at::kFloat8_e4m3fn)}) {
    const auto x = (torch::randn({rows, cols}) * 50.0).to(torch::kBFloat16);
    const auto scale = torch::full({1}, 3.0f);
    const int64_t padded = (rows + 15) / 16 * 16;
    auto amax = torch::zeros({1});
    const kernels::Fp8Cast cast = kernels::fp8_cast_transpose(x, scale, dtype, amax, padded, true, true);
    const auto plain = kernels::fp8_quantize(x, scale, dtype, torch::Tensor()).view(torch::kByte);
    auto expected = torch::zeros({padded, cols}, torch::kByte);
    expected.narrow(0, 0, rows).copy_(plain);
    EXPECT_TRUE(torch::equal(cast.q.view(torch::kByte), plain)) << rows << "x" << cols;
    EXPECT_TRUE(torch::equal(cast.qt.view(torch::kByte), expected.t().contiguous())) << rows << "x" << cols;
    EXPECT_EQ(amax.item<float>(), x.abs().max().item<float>());
    const kernels::Fp8Cast only_t = kernels::fp8_cast_transpose(x, scale, dtype, torch::Tensor(), padded, false, true);
    EXPECT_FALSE(only_t.q.defined());
    EXPECT_TRUE(torch::equal(only_t.qt.view(torch::kByte), expected.t().contiguous()));
  }
  expect_error(
      [] {
        kernels::fp8_cast_transpose(torch::ones({4, 4}), torch::ones({1}), at::kFloat8_e4m3fn, {}, 3, true, true);
      },
      "padded_rows 3 < rows 4");
}

// ---- The layer ------------------------------------------------------------------------------------------------

// Same parameter names, initialization draws and checkpoint layout as torch::nn::Linear, and exactly Linear's
// results until FP8 is enabled.
TEST(Float8LinearTest, IsADropInForTorchLinear) {
  torch::manual_seed(11);
  torch::nn::Linear linear(48, 32);
  torch::manual_seed(11);
  amp::Float8Linear fp8(48, 32);
  ASSERT_EQ(linear->named_parameters().keys(), fp8->named_parameters().keys());
  EXPECT_TRUE(torch::equal(linear->weight, fp8->weight));
  EXPECT_TRUE(torch::equal(linear->bias, fp8->bias));
  const auto x = torch::randn({5, 48});
  EXPECT_TRUE(torch::equal(linear(x), fp8(x)));
  // A Linear checkpoint loads into Float8Linear.
  char path[] = "/tmp/lta_fp8_linearXXXXXX";
  const int fd = mkstemp(path);
  ASSERT_GE(fd, 0);
  close(fd);
  torch::manual_seed(12);
  torch::nn::Linear other(48, 32);
  torch::save(other, path);
  torch::load(fp8, path);
  std::remove(path);
  EXPECT_TRUE(torch::equal(other->weight, fp8->weight));
  EXPECT_TRUE(torch::equal(other(x), fp8(x)));
}

TEST(Float8LinearTest, RefusesDimensionsTheFp8GemmCannotTakeNamingThem) {
  amp::Float8Linear odd(10, 32);
  EXPECT_NE(odd->fp8_ineligibility().find("in_features=10 is not a multiple of 16"), std::string::npos);
  expect_error([&] { odd->enable_fp8(Fp8Recipe()); }, "Float8Linear(10 -> 32) cannot run in FP8: in_features=10");
  expect_error([] { amp::Float8Linear(16, 16)->enable_fp8(Fp8Recipe().amax_history_len(0)); },
               "amax_history_len must be in [1, 1048576], got 0");
  expect_error([] { amp::Float8Linear(16, 16)->enable_fp8(Fp8Recipe().margin(64)); },
               "margin must be in [0, 63], got 64");
  amp::Float8Linear layer(16, 16);
  layer->enable_fp8(Fp8Recipe());
  expect_error([&] { layer(torch::randn({4, 15})); }, "input's last dimension must be in_features=16");
  // An evaluation forward under no_grad casts with the current scales and records nothing.
  {
    torch::NoGradGuard no_grad;
    layer(torch::randn({4, 16}));
  }
  EXPECT_EQ(layer->fp8_meta().history.abs().sum().item<float>(), 0.0f);
}

// ---- amp::Options::fp8 ----------------------------------------------------------------------------------------

TEST(Fp8AmpTest, OptionsAcceptO1AndO2AndNameTheRecipe) {
  const auto o2 = amp::Options().opt_level(amp::OptLevel::O2).half_dtype(torch::kBFloat16).fp8(Fp8Recipe());
  EXPECT_NE(o2.to_string().find("fp8=scaling=delayed,format=hybrid,history=1024,margin=0,amax=max"), std::string::npos);
  EXPECT_EQ(amp::Options().to_string().find("fp8"), std::string::npos) << "no FP8: the text older checkpoints have";
  expect_error([] { amp::Options().opt_level(amp::OptLevel::O0).fp8(Fp8Recipe()).resolve(); },
               "fp8() needs opt level O1 or O2, got O0");
  expect_error([] { amp::Options().opt_level(amp::OptLevel::O3).fp8(Fp8Recipe()).resolve(); },
               "fp8() needs opt level O1 or O2, got O3");
}

/// A model with two FP8-able layers, one whose width the GEMM cannot take, and a plain Linear.
struct MixedNetImpl : torch::nn::Module {
  MixedNetImpl() {
    a = register_module("a", amp::Float8Linear(32, 64));
    b = register_module("b", amp::Float8Linear(64, 48));
    odd = register_module("odd", amp::Float8Linear(48, 10));
    plain = register_module("plain", torch::nn::Linear(10, 10));
  }
  torch::Tensor forward(torch::Tensor x) { return plain(odd(torch::gelu(b(torch::gelu(a(x)))))); }
  amp::Float8Linear a{nullptr}, b{nullptr}, odd{nullptr};
  torch::nn::Linear plain{nullptr};
};
TORCH_MODULE(MixedNet);

amp::Options o2_fp8(const Fp8Recipe& recipe = Fp8Recipe().amax_history_len(16)) {
  return amp::Options().opt_level(amp::OptLevel::O2).half_dtype(torch::kBFloat16).fp8(recipe);
}

TEST(Fp8AmpTest, InitializeRunsEligibleLayersInFp8AndLogsTheRest) {
  torch::manual_seed(5);
  MixedNet net;
  amp::FusedAdam adam(net->parameters(), amp::FusedAdamOptions(1e-3));
  auto [model, optimizer] = amp::initialize(net, adam, o2_fp8());
  EXPECT_TRUE(net->a->fp8_enabled());
  EXPECT_TRUE(net->b->fp8_enabled());
  EXPECT_FALSE(net->odd->fp8_enabled());
  const auto report = optimizer.fp8_report();
  ASSERT_EQ(report.size(), 3u);
  EXPECT_NE(report[0].find("'odd' stays in its amp precision: out_features=10 is not a multiple of 16"),
            std::string::npos)
      << report[0];
  EXPECT_NE(report[1].find("'plain' is a torch::nn::Linear and stays in its amp precision"), std::string::npos)
      << report[1];
  EXPECT_NE(report[2].find("2 of 3 Float8Linear layers run in FP8"), std::string::npos) << report[2];
  expect_error([&] { net->a->update_fp8_scales(); }, "this layer's FP8 state belongs to amp");
  // The layers' state is amp's: one buffer, the layers hold views of it.
  EXPECT_EQ(optimizer.state().fp8()->history().sizes(), (std::vector<int64_t>{6, 16}));
  EXPECT_EQ(net->b->fp8_meta().history.data_ptr<float>(), optimizer.state().fp8()->history()[3].data_ptr<float>());
  const auto y = model(torch::randn({4, 32}));
  EXPECT_EQ(y.scalar_type(), torch::kFloat);
}

/// One amp step of `model` (forwarding through `forward`, e.g. DDP's) on (x, target) with an MSE loss; the loss.
template <typename Model, typename Forward>
float amp_step(Model& model, amp::Optimizer& optimizer, const Forward& forward, const torch::Tensor& x,
               const torch::Tensor& target) {
  optimizer.zero_grad();
  const torch::Tensor loss = torch::mse_loss(model.call(forward, x), target);
  {
    auto scaled = amp::scale_loss(loss, optimizer);
    scaled.backward();
  }
  optimizer.step();
  return loss.item<float>();
}

struct Fp8Run {
  std::vector<torch::Tensor> params;
  torch::Tensor history, scale;
  std::vector<float> losses;
  std::vector<int64_t> skipped;
};

/// Trains MixedNet under O2 + FP8 with FusedAdamW for `steps` steps of the seeded data (an inf in the input at
/// `inf_step`), optionally saving a checkpoint after `save_after` steps or starting from `resume`.
Fp8Run train_mixed(int steps, const Fp8Recipe& recipe, int inf_step = -1, int save_after = -1,
                   const std::string& checkpoint = "", bool resume = false) {
  torch::manual_seed(21);
  MixedNet net;
  amp::FusedAdam adam(net->parameters(), amp::FusedAdamOptions(3e-3).weight_decay(1e-2).decoupled_weight_decay(true));
  auto [model, optimizer] = amp::initialize(net, adam, o2_fp8(recipe));
  int first = 0;
  if (resume) {
    amp::load_checkpoint(checkpoint, model, optimizer);
    first = save_after;
  }
  Fp8Run run;
  for (int s = first; s < steps; ++s) {
    auto generator = at::make_generator<at::CPUGeneratorImpl>(1000 + s);
    torch::Tensor x = torch::randn({24, 32}, generator) * 4.0;
    const torch::Tensor target = torch::randn({24, 10}, generator);
    if (s == inf_step) x[3][5] = std::numeric_limits<float>::infinity();
    optimizer.zero_grad();
    const auto loss = torch::mse_loss(model(x), target);
    {
      auto scaled = amp::scale_loss(loss, optimizer);
      scaled.backward();
    }
    optimizer.step();
    run.losses.push_back(loss.item<float>());
    run.skipped.push_back(static_cast<int64_t>(optimizer.last_step_now().skipped));
    if (s + 1 == save_after && !resume) amp::save_checkpoint(checkpoint, model, optimizer);
  }
  for (const auto& p : net->parameters()) run.params.push_back(p.detach().clone());
  run.history = optimizer.state().fp8()->history().clone();
  run.scale = optimizer.state().fp8()->scale().clone();
  return run;
}

// A non-finite amax (an inf in a forward input, which the cast saturates, so the loss stays finite) skips the
// step as an overflow would: parameters, histories and scales are those of a run without that step's update.
TEST(Fp8AmpTest, ANonFiniteAmaxSkipsTheStepAndKeepsTheHistoryClean) {
  const Fp8Recipe recipe = Fp8Recipe().amax_history_len(8);
  const Fp8Run clean = train_mixed(4, recipe);
  const Fp8Run with_inf = train_mixed(5, recipe, /*inf_step=*/4);
  EXPECT_EQ(with_inf.skipped[4], 1);
  EXPECT_TRUE(std::isfinite(with_inf.losses[4])) << "the saturating cast keeps the loss finite";
  EXPECT_EQ(clean.skipped, std::vector<int64_t>(4, 0));
  for (size_t i = 0; i < clean.params.size(); ++i) EXPECT_TRUE(torch::equal(clean.params[i], with_inf.params[i]));
  EXPECT_TRUE(torch::equal(clean.history, with_inf.history));
  EXPECT_TRUE(torch::equal(clean.scale, with_inf.scale));
  EXPECT_FALSE(torch::equal(clean.scale, torch::ones_like(clean.scale))) << "the scales moved from 1";
}

// fp16 with dynamic loss scaling: an output gradient that overflows fp16 is clipped by the saturating E5M2 cast, so
// the weight gradient of a bias-free FP8 layer stays finite; its amax is inf all the same, and that counts as the
// loss's overflow: the scale backs off and the step is skipped, until the gradients fit and training goes on.
TEST(Fp8AmpTest, AnOverflowingOutputGradientBacksOffTheLossScale) {
  torch::manual_seed(19);
  amp::Float8Linear layer(amp::Float8LinearOptions(32, 16).bias(false));
  amp::FusedSGD sgd(layer->parameters(), amp::FusedSgdOptions(1e-4));
  auto [model, optimizer] = amp::initialize(
      layer, sgd, amp::Options().opt_level(amp::OptLevel::O2).half_dtype(torch::kHalf).fp8(Fp8Recipe()));
  // Small inputs keep the weight gradient finite even from saturated output gradients (57344 x 1e-3 x 32 rows).
  const auto x = torch::randn({32, 32}) * 1e-3;
  const auto target = torch::full({32, 16}, 1000.0f);  // dy = scale * 2 (y - t) / 512: beyond fp16 at 2^16, 2^15
  std::vector<float> scales;
  std::vector<int64_t> skipped;
  for (int s = 0; s < 4; ++s) {
    amp_step(
        model, optimizer, [&](const torch::Tensor& in) { return model->forward(in); }, x, target);
    scales.push_back(optimizer.scaler().diagnostics_now().scale);
    skipped.push_back(static_cast<int64_t>(optimizer.last_step_now().skipped));
  }
  EXPECT_EQ(skipped, (std::vector<int64_t>{1, 1, 0, 0}));
  EXPECT_EQ(scales, (std::vector<float>{32768.0f, 16384.0f, 16384.0f, 16384.0f}));
  EXPECT_TRUE(torch::isfinite(optimizer.state().fp8()->history()).all().item<bool>());
}

// The output is a tensor of its own (not a view), so in-place ops on it work as on Linear's.
TEST(Float8LinearTest, InPlaceOpsOnTheOutputWork) {
  torch::manual_seed(23);
  amp::Float8Linear layer(32, 16);
  layer->enable_fp8(Fp8Recipe());
  const auto x = torch::randn({5, 32}).requires_grad_(true);
  auto y = layer(x);
  y.add_(1.0);  // on the layer's output itself
  y.relu_();
  y.sum().backward();
  EXPECT_TRUE(x.grad().defined());
  EXPECT_TRUE(layer->weight.grad().defined());
}

// An amp checkpoint holds the amax histories and scales: a run broken after 6 steps and resumed from the file ends
// bit-identical to the unbroken run (parameters, histories, scales), for both recipes.
TEST(Fp8AmpTest, CheckpointResumeIsBitIdentical) {
  for (const Fp8Recipe& recipe : {Fp8Recipe().amax_history_len(4), Fp8Recipe().scaling(Fp8Scaling::kCurrent)}) {
    char path[] = "/tmp/lta_fp8_ckptXXXXXX";
    const int fd = mkstemp(path);
    ASSERT_GE(fd, 0);
    close(fd);
    const Fp8Run whole = train_mixed(12, recipe, -1, /*save_after=*/6, path);
    const Fp8Run resumed = train_mixed(12, recipe, -1, 6, path, /*resume=*/true);
    std::remove(path);
    ASSERT_EQ(whole.params.size(), resumed.params.size());
    for (size_t i = 0; i < whole.params.size(); ++i) EXPECT_TRUE(torch::equal(whole.params[i], resumed.params[i]));
    EXPECT_TRUE(torch::equal(whole.history, resumed.history)) << recipe.to_string();
    EXPECT_TRUE(torch::equal(whole.scale, resumed.scale)) << recipe.to_string();
    EXPECT_GT(whole.history.abs().sum().item<float>(), 0.0f);
  }
}

TEST(Fp8AmpTest, ACheckpointOfAnotherFp8SetupIsRefusedNamingTheSetting) {
  char path[] = "/tmp/lta_fp8_ckptXXXXXX";
  const int fd = mkstemp(path);
  ASSERT_GE(fd, 0);
  close(fd);
  train_mixed(2, Fp8Recipe().amax_history_len(4), -1, 2, path);
  torch::manual_seed(21);
  MixedNet net;
  amp::FusedAdam adam(net->parameters(), amp::FusedAdamOptions(3e-3));
  auto [model, optimizer] = amp::initialize(net, adam, o2_fp8(Fp8Recipe().amax_history_len(8)));
  const auto before = optimizer.state().fp8()->history().clone();
  expect_error([&] { amp::load_checkpoint(path, model, optimizer); }, "history=4");
  std::remove(path);
  EXPECT_TRUE(torch::equal(before, optimizer.state().fp8()->history()));
}

// O1: autocast runs the model in bf16 around fp32 weights; the FP8 layers cast the fp32 input and weight straight
// to FP8 and return the autocast dtype. Training on a fixed batch lowers the loss, and the GEMMs are FP8 (the run
// differs from O1 without FP8).
TEST(Fp8AmpTest, O1AutocastTrainsWithFp8Gemms) {
  auto run = [](bool fp8) {
    torch::manual_seed(17);
    MixedNet net;
    amp::FusedAdam adam(net->parameters(), amp::FusedAdamOptions(1e-2));
    amp::Options options = amp::Options().opt_level(amp::OptLevel::O1).half_dtype(torch::kBFloat16);
    if (fp8) options.fp8(Fp8Recipe().amax_history_len(4));
    auto [model, optimizer] = amp::initialize(net, adam, options);
    auto generator = at::make_generator<at::CPUGeneratorImpl>(3);
    const auto x = torch::randn({32, 32}, generator);
    const auto target = torch::randn({32, 10}, generator);
    {
      const amp::AutocastScope autocast(torch::kCPU, torch::kBFloat16);
      const torch::NoGradGuard no_grad;
      EXPECT_EQ(net->a(x).scalar_type(), torch::kBFloat16);
    }
    EXPECT_EQ(net->a->weight.scalar_type(), torch::kFloat) << "O1 keeps fp32 weights";
    std::vector<float> losses;
    for (int s = 0; s < 30; ++s) {
      optimizer.zero_grad();
      const auto loss = torch::mse_loss(model(x), target);
      {
        auto scaled = amp::scale_loss(loss, optimizer);
        scaled.backward();
      }
      optimizer.step();
      losses.push_back(loss.item<float>());
    }
    if (fp8) {
      EXPECT_GT(optimizer.state().fp8()->history().abs().sum().item<float>(), 0.0f);
    }
    return losses;
  };
  const auto fp8 = run(true);
  const auto bf16 = run(false);
  // A training outcome, one-sided (Note [bounds on every CPU kernel path]): 30 Adam steps on one fixed batch halve the
  // loss with a wide margin on any kernel path (the printed ratio); a broken FP8 GEMM does not learn or diverges.
  std::printf("O1 FP8: loss %.4f -> %.4f (ratio %.3f, bound 0.5); bf16 %.4f -> %.4f\n", fp8.front(), fp8.back(),
              fp8.back() / fp8.front(), bf16.front(), bf16.back());
  EXPECT_LT(fp8.back(), 0.5f * fp8.front());
  EXPECT_NE(fp8, bf16);
}

// ZeRO stage 2 with FP8 layers trains bit-identically to DDP + amp with FP8 layers (the amax reduction and the skip
// flag happen before the sharded step), with identical scales on both ranks.
TEST(Fp8AmpTest, ZeroStageTwoWithFp8TrainsLikeDdpWithFp8) {
  LTA_REQUIRE_GLOO();
  ddp_test::run_ranks(
      [](int rank, const ddp::ProcessGroup& pg) {
        auto train = [&](amp::ZeroStage stage) {
          torch::manual_seed(33);
          MixedNet net;
          amp::FusedAdam adam(net->parameters(),
                              amp::FusedAdamOptions(3e-3).weight_decay(1e-2).decoupled_weight_decay(true));
          auto [model, optimizer] = amp::initialize(net, adam, o2_fp8(Fp8Recipe().amax_history_len(4)));
          ddp::DistributedDataParallel ddp_net(
              net, pg, ddp::DistributedDataParallelOptions().bucket_cap_mb(0.005).rebuild_buckets(false));
          optimizer.attach(ddp_net, stage);
          auto generator = at::make_generator<at::CPUGeneratorImpl>(700 + rank);
          for (int s = 0; s < 6; ++s) {
            torch::Tensor x = torch::randn({16, 32}, generator) * (1.0 + rank);
            if (s == 3 && rank == 1) x[0][0] = std::numeric_limits<float>::infinity();  // skipped on both ranks
            const auto target = torch::randn({16, 10}, generator);
            amp_step(
                model, optimizer, [&](const torch::Tensor& in) { return ddp_net.forward(in); }, x, target);
            TORCH_CHECK(optimizer.last_step_now().skipped == (s == 3), "rank ", rank, " step ", s,
                        ": skipped=", optimizer.last_step_now().skipped);
          }
          std::vector<torch::Tensor> out;
          for (const auto& p : net->parameters()) out.push_back(p.detach().clone());
          out.push_back(optimizer.state().fp8()->scale().clone());
          out.push_back(optimizer.state().fp8()->history().clone());
          return out;
        };
        const auto ddp_run = train(amp::ZeroStage::kNone);
        const auto zero_run = train(amp::ZeroStage::kTwo);
        for (size_t i = 0; i < ddp_run.size(); ++i) {
          TORCH_CHECK(torch::equal(ddp_run[i], zero_run[i]), "rank ", rank, ": tensor ", i, " differs");
          auto root = zero_run[i].clone();
          pg.broadcast_(root, 0);
          TORCH_CHECK(torch::equal(root, zero_run[i]), "rank ", rank, ": tensor ", i, " differs from rank 0's");
        }
      },
      2);
}

// Under DDP the amaxes are max-reduced once per step, so ranks that see different data cast with the same scales
// (without the reduction each rank's input scale would follow its own data).
TEST(Fp8AmpTest, TwoRankDdpKeepsIdenticalScalesOnBothRanks) {
  LTA_REQUIRE_GLOO();
  ddp_test::run_ranks(
      [](int rank, const ddp::ProcessGroup& pg) {
        torch::manual_seed(31);
        MixedNet net;
        amp::FusedAdam adam(net->parameters(), amp::FusedAdamOptions(3e-3));
        auto [model, optimizer] = amp::initialize(net, adam, o2_fp8(Fp8Recipe().amax_history_len(4)));
        ddp::DistributedDataParallel ddp_net(net, pg);
        optimizer.attach(ddp_net);
        auto generator = at::make_generator<at::CPUGeneratorImpl>(500 + rank);
        std::vector<float> local_input_amax;
        for (int s = 0; s < 6; ++s) {
          const auto x = torch::randn({16, 32}, generator) * (rank == 0 ? 1.0 : 8.0);  // different amaxes per rank
          const auto target = torch::randn({16, 10}, generator);
          local_input_amax.push_back(x.to(torch::kBFloat16).abs().max().item<float>());  // O2 casts inputs
          amp_step(
              model, optimizer, [&](const torch::Tensor& in) { return ddp_net.forward(in); }, x, target);
        }
        auto same_as_rank0 = [&](const torch::Tensor& t) {
          auto root = t.clone();
          pg.broadcast_(root, 0);
          return torch::equal(t, root);
        };
        const auto& fp8 = *optimizer.state().fp8();
        TORCH_CHECK(same_as_rank0(fp8.scale().clone()), "rank ", rank, ": FP8 scales differ from rank 0's");
        TORCH_CHECK(same_as_rank0(fp8.history().clone()), "rank ", rank, ": FP8 histories differ from rank 0's");
        // The input's history holds the larger of the two ranks' amaxes (rank 1's data is 8x larger).
        auto theirs = torch::tensor(local_input_amax);
        auto other = theirs.clone();
        pg.broadcast_(other, 1);
        // After 6 steps a length-4 row is [0 (this step's slot), step 3, step 4, step 5].
        const auto expected = torch::cat({torch::zeros({1}), torch::maximum(theirs, other).narrow(0, 3, 3)});
        TORCH_CHECK(torch::equal(fp8.history()[amp::kFp8Input], expected), "rank ", rank,
                    ": the input amax history is not the max over the ranks: ", fp8.history()[amp::kFp8Input], " vs ",
                    expected);
        for (const auto& p : net->parameters()) TORCH_CHECK(same_as_rank0(p.detach().clone()), "parameters differ");
      },
      2);
}

// ---- CUDA (the GPU check) --------------------------------------------------------------------------------------

bool fp8_gpu() {
#ifdef LIBTORCH_AMP_WITH_CUDA
  if (!test_util::cuda_available()) return false;
  const auto* props = at::cuda::getCurrentDeviceProperties();
  return props->major > 8 || (props->major == 8 && props->minor >= 9);
#else
  return false;
#endif
}

#define LTA_REQUIRE_FP8_GPU()                                                                                \
  do {                                                                                                       \
    LTA_REQUIRE_CUDA();                                                                                      \
    if (!fp8_gpu()) GTEST_SKIP() << "needs a GPU with FP8 tensor cores (sm_89 or newer); this one has none"; \
  } while (0)

// Note [FP8 GEMM tolerance on Hopper]
// The product of two FP8 values is exact, but Hopper's FP8 tensor cores do not add the products in fp32: a block
// FMA aligns its addends (the running sum and a block of products) to the largest and keeps about 13-14 bits below
// it, truncating. So adding the j-th product to a running sum of size ~ sqrt(j) sigma (sigma: the products' scale;
// their signs are random) loses up to 2^-13 sqrt(j) sigma, with a random sign, and over n products these losses add
// up like a random walk, to ~ 2^-13 sigma sqrt(n^2 / 2). cuBLASLt without fast accumulation (we do not ask for it)
// promotes the running sum into fp32 every few MMAs (CUTLASS's FP8 kernels: every 128 products), which caps n; we
// do not rely on the interval and take n = K. The result is ~ sqrt(K) sigma, so normwise (max |error| / max |y|,
// expect_close's measure) the error is ~ 2^-13 sqrt(K / 2). A model of just this on this test's shapes and data
// (tests/amp/fp8_accumulation_model.py: 13 bits, blocks of 32) gives 0.25 to 0.85 x 2^-13 sqrt(K) without
// promotion, 0.10 to 0.46 with promotion every 128 products (2e-4 to 6e-4); 14 bits roughly halve it. The bound is
// 2 x 2^-13 sqrt(K), plus K 2^-24 for the fp32 sums (the promotions' and the CPU reference's): 1.5e-3 (K = 37) to
// 7.8e-3 (K = 1024). A wrong scale (off by a factor of 2 or more), or a transposed or swapped operand, is off by
// O(max |y|): at least 60 times the bound.
double fp8_gemm_rtol(int64_t k) {
  constexpr int kKeptBits = 13;
  const auto products = static_cast<double>(k);
  return 2.0 * std::ldexp(std::sqrt(products), -kKeptBits) + products * std::ldexp(1.0, -24);
}

// The CUDA path (our cast kernel, cuBLASLt through _scaled_mm) against the CPU path: the FP8 bytes of input, weight
// and output gradient are identical, and every GEMM equals the CPU's (the product of those quantized values with an
// fp32 sum) within the tensor cores' accumulation error (Note [FP8 GEMM tolerance on Hopper]), for shapes at and
// off multiples of 16 and both recipes. The bias gradient is an fp32 sum on both sides.
TEST(Fp8CudaTest, CudaPathEqualsTheCpuQuantizedReference) {
  LTA_REQUIRE_FP8_GPU();
  for (const GemmCase& c : {GemmCase{64, 256, 128, Fp8Scaling::kDelayed}, GemmCase{37, 80, 48, Fp8Scaling::kCurrent},
                            GemmCase{1000, 512, 1024, Fp8Scaling::kDelayed}}) {
    torch::manual_seed(41);
    amp::Float8Linear cpu(c.in, c.out);
    amp::Float8Linear gpu(c.in, c.out);
    {
      torch::NoGradGuard no_grad;
      gpu->weight.copy_(cpu->weight);
      gpu->bias.copy_(cpu->bias);
    }
    gpu->to(torch::kCUDA);
    const Fp8Recipe recipe = Fp8Recipe().scaling(c.scaling).amax_history_len(4);
    cpu->enable_fp8(recipe);
    gpu->enable_fp8(recipe);
    const auto scales = torch::tensor({0.5f, 64.0f, 3.0e4f});
    for (auto* layer : {&cpu, &gpu}) {
      (*layer)->fp8_meta().scale.copy_(scales);
      (*layer)->fp8_meta().scale_inv.copy_(1.0f / scales);
    }
    const auto x = torch::randn({c.rows, c.in}) * 20.0;
    const auto g = torch::randn({c.rows, c.out}) * 1e-3;
    const auto xc = x.clone().requires_grad_(true);
    const auto xg = x.cuda().requires_grad_(true);
    const auto yc = cpu(xc);
    yc.backward(g);
    const auto yg = gpu(xg);
    yg.backward(g.cuda());
    for (int role : {amp::kFp8Input, amp::kFp8Weight, amp::kFp8GradOutput}) {
      EXPECT_EQ(cpu->fp8_meta().history[role][0].item<float>(), gpu->fp8_meta().history[role][0].item<float>())
          << "amax of tensor " << role;
    }
    EXPECT_TRUE(torch::equal(
        kernels::fp8_quantize(x, cpu->fp8_meta().scale.narrow(0, 0, 1), at::kFloat8_e4m3fn, {}).view(torch::kByte),
        kernels::fp8_quantize(x.cuda(), gpu->fp8_meta().scale.narrow(0, 0, 1), at::kFloat8_e4m3fn, {})
            .cpu()
            .view(torch::kByte)));
    // The inner dimension: in_features forward, out_features for the input gradient, the rows for the weight's.
    expect_close(yg.cpu(), yc, fp8_gemm_rtol(c.in), "forward");
    expect_close(xg.grad().cpu(), xc.grad(), fp8_gemm_rtol(c.out), "input gradient");
    expect_close(gpu->weight.grad().cpu(), cpu->weight.grad(), fp8_gemm_rtol(c.rows), "weight gradient");
    expect_close(gpu->bias.grad().cpu(), cpu->bias.grad(), 1e-5, "bias gradient");
    // The scale update on the device equals the CPU's.
    cpu->update_fp8_scales();
    gpu->update_fp8_scales();
    EXPECT_TRUE(torch::equal(cpu->fp8_meta().scale, gpu->fp8_meta().scale.cpu()));
    EXPECT_TRUE(torch::equal(cpu->fp8_meta().history, gpu->fp8_meta().history.cpu()));
  }
}

// An FP8 amp step (O2 bf16, FusedAdamW, delayed scaling: casts, amaxes, GEMMs, the non-finite check and the
// scale update) performs no host synchronization: c10's sync debug mode turns any sync into an error.
TEST(Fp8CudaTest, CudaFp8AmpStepHasNoHostSync) {
  LTA_REQUIRE_FP8_GPU();
#ifdef LIBTORCH_AMP_WITH_CUDA
  torch::manual_seed(9);
  MixedNet net;
  net->to(torch::kCUDA);
  amp::FusedAdamW adam(net->parameters(), amp::FusedAdamOptions(1e-3));
  auto [model, optimizer] = amp::initialize(net, adam, o2_fp8());
  const auto x = torch::randn({64, 32}, torch::kCUDA);
  const auto target = torch::randn({64, 10}, torch::kCUDA);
  auto step = [&] {
    optimizer.zero_grad();
    const auto loss = torch::mse_loss(model(x), target);
    {
      auto scaled = amp::scale_loss(loss, optimizer);
      scaled.backward();
    }
    optimizer.step();
  };
  step();  // warm-up: allocations and lazy state
  c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_ERROR);
  try {
    for (int i = 0; i < 3; ++i) step();
  } catch (...) {
    c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_DISABLED);
    throw;
  }
  c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_DISABLED);
  EXPECT_EQ(optimizer.scaler().diagnostics_now().skipped_steps, 0);
  EXPECT_GT(optimizer.state().fp8()->history().abs().sum().item<float>(), 0.0f);
#endif
}

}  // namespace
