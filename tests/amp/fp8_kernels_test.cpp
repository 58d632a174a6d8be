// FP8 kernels under amp::Float8Linear (docs/fp8.md): the GEMMs against fp64 references computed from the same
// quantized values (on the CPU, and the CUDA path against the CPU), and the scaling rules against Transformer
// Engine's formulas (tests/golden/fp8_scaling.csv). Training with FP8 is in fp8_test.cpp.

#include <amp/nn/float8_linear.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <amp/fp8/fp8_state.h>
#include <kernels/gemm/fp8.h>

#include "amp/fp8_test_util.h"
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

// ---- CUDA (the GPU check) --------------------------------------------------------------------------------------

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
}  // namespace
