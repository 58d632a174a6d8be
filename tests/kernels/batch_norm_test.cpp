// kernels/batch_norm.h: SyncBatchNorm's CPU passes against fp64 computed from the same (rounded) input values, for
// each dtype and for runs that exercise the vector steps, the 512-element chunks and the scalar tails (the suite
// also runs under each lower instruction set: kernels.all_under_cpu_capability_*).
#include <kernels/batch_norm.h>

#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

namespace {

/// Shapes (N, C, *): 1073 values per run is 2 chunks of 512 plus 49 (whole vector steps and a scalar tail); (N, C)
/// has runs of one value (all tail); a 3-d one with 5-value runs.
const std::vector<std::vector<int64_t>> kShapes = {{3, 4, 37, 29}, {9, 5}, {2, 3, 5}, {1, 2, 1100}};
const torch::ScalarType kDtypes[] = {torch::kFloat, torch::kHalf, torch::kBFloat16, torch::kDouble};

std::vector<int64_t> reduce_dims(int64_t dim) {
  std::vector<int64_t> dims{0};
  for (int64_t d = 2; d < dim; ++d) dims.push_back(d);
  return dims;
}

torch::Tensor per_channel(const torch::Tensor& t, int64_t dim) {
  std::vector<int64_t> shape(static_cast<size_t>(dim), 1);
  shape[1] = t.size(0);
  return t.view(shape);
}

/// Relative unit of one rounding of a result to `dtype` (fp32 results for fp32: a few ulps of fp32 accumulate).
double rounding_of(torch::ScalarType dtype) {
  switch (dtype) {
    case torch::kHalf:
      return 1.0 / 1024;
    case torch::kBFloat16:
      return 1.0 / 128;
    case torch::kDouble:
      return 1e-14;
    default:
      return 1e-6;
  }
}

/// Sums of up to 32 fp32 terms per lane: within 32 ulps (2^-19) of the sum of |terms| (Note [batch-norm twin
/// sums]); fp64 within 1e-14.
double sum_bound(torch::ScalarType dtype) { return dtype == torch::kDouble ? 1e-14 : std::ldexp(1.0, -19); }

void expect_within(const torch::Tensor& actual, const torch::Tensor& expected, const torch::Tensor& bound,
                   const std::string& what) {
  const auto diff = (actual.to(torch::kDouble) - expected).abs();
  const auto excess = (diff - bound).max().item<double>();
  EXPECT_LE(excess, 0.0) << what << ": max |difference| " << diff.max().item<double>();
}

TEST(BatchNormCpuTest, StatisticsAndGradientSumsAreWithinTheirBoundOfFp64) {
  torch::manual_seed(11);
  for (const auto dtype : kDtypes) {
    for (const auto& shape : kShapes) {
      const std::string what = c10::str(c10::toString(dtype), " ", shape);
      // A mean far from 0 against the spread: the case that defeats sum / sum-of-squares statistics.
      const auto x = (torch::randn(shape) * 2 + 30).to(dtype);
      const auto dy = torch::randn(shape).to(dtype);
      const auto xd = x.to(torch::kDouble);
      const auto dyd = dy.to(torch::kDouble);
      const auto dims = reduce_dims(x.dim());
      const double count = static_cast<double>(x.numel() / x.size(1));

      const auto [mean, var] = kernels::batch_norm_stats_cpu(x);
      ASSERT_EQ(mean.scalar_type(), torch::kDouble);
      const auto mean_ref = xd.mean(dims);
      const auto dev = xd - per_channel(mean_ref, x.dim());
      const auto var_ref = dev.square().mean(dims);
      expect_within(mean, mean_ref, xd.abs().sum(dims) / count * sum_bound(dtype), what + " mean");
      expect_within(var, var_ref, var_ref * sum_bound(dtype) * 4 + 1e-12, what + " variance");

      const auto m = mean_ref.to(torch::kFloat);  // the statistics' dtype SyncBatchNorm passes
      const auto [sum_dy, sum_dy_xmu] =
          kernels::batch_norm_grad_sums_cpu(dy, x, dtype == torch::kDouble ? mean_ref : m);
      const auto xmu = xd - per_channel(dtype == torch::kDouble ? mean_ref : m.to(torch::kDouble), x.dim());
      expect_within(sum_dy, dyd.sum(dims), dyd.abs().sum(dims) * sum_bound(dtype), what + " sum dy");
      expect_within(sum_dy_xmu, (dyd * xmu).sum(dims), (dyd * xmu).abs().sum(dims) * sum_bound(dtype) * 2,
                    what + " sum dy * (x - mean)");
    }
  }
}

TEST(BatchNormCpuTest, NormalizeAndInputGradientRoundOnceFromTheFormula) {
  torch::manual_seed(12);
  for (const auto dtype : kDtypes) {
    for (const auto& shape : kShapes) {
      const std::string what = c10::str(c10::toString(dtype), " ", shape);
      const auto p = dtype == torch::kDouble ? torch::kDouble : torch::kFloat;
      const int64_t c = shape[1];
      const auto x = (torch::randn(shape) * 2 + 30).to(dtype);
      const auto dy = torch::randn(shape).to(dtype);
      const auto mean = (torch::randn({c}) + 30).to(p);
      const auto scale = (torch::rand({c}) + 0.5).to(p);
      const auto shift = torch::randn({c}).to(p);
      const auto mean_dy = (torch::randn({c}) * 0.1).to(p);
      const auto k = (torch::randn({c}) * 0.1).to(p);
      const auto xd = x.to(torch::kDouble);
      const auto dyd = dy.to(torch::kDouble);
      const auto pc = [&](const torch::Tensor& t) { return per_channel(t.to(torch::kDouble), x.dim()); };
      const double r = rounding_of(dtype);

      const auto y = kernels::batch_norm_normalize_cpu(x, mean, scale, shift);
      ASSERT_EQ(y.scalar_type(), dtype);
      ASSERT_EQ(y.sizes(), x.sizes());
      const auto y_ref = (xd - pc(mean)) * pc(scale) + pc(shift);
      // One rounding of the result, plus fp32's error on the terms (|x - mean| * scale and |shift|).
      const auto y_terms = (xd - pc(mean)).abs() * pc(scale) + pc(shift).abs() + xd.abs() * pc(scale) * 1e-7;
      expect_within(y, y_ref, y_ref.abs() * r + y_terms * 1e-6, what + " normalize");
      const auto no_shift = kernels::batch_norm_normalize_cpu(x, mean, scale, torch::Tensor());
      expect_within(no_shift, y_ref - pc(shift), (y_ref - pc(shift)).abs() * r + y_terms * 1e-6,
                    what + " normalize without shift");

      const auto dx = kernels::batch_norm_input_grad_cpu(dy, x, mean, mean_dy, k, scale);
      ASSERT_EQ(dx.scalar_type(), dtype);
      const auto dx_ref = (dyd - pc(mean_dy) - (xd - pc(mean)) * pc(k)) * pc(scale);
      const auto dx_terms =
          (dyd.abs() + pc(mean_dy).abs() + (xd - pc(mean)).abs() * pc(k).abs() + xd.abs() * pc(k).abs() * 1e-7) *
          pc(scale);
      expect_within(dx, dx_ref, dx_ref.abs() * r + dx_terms * 1e-6, what + " input gradient");
    }
  }
}

TEST(BatchNormCpuTest, EmptyBatchesNonContiguousInputsAndBadArguments) {
  const auto empty = torch::zeros({0, 3, 4});
  const auto [sum_dy, sum_dy_xmu] = kernels::batch_norm_grad_sums_cpu(empty, empty, torch::zeros({3}));
  EXPECT_TRUE(torch::equal(sum_dy, torch::zeros({3}, torch::kDouble)));
  EXPECT_TRUE(torch::equal(sum_dy_xmu, torch::zeros({3}, torch::kDouble)));
  EXPECT_EQ(kernels::batch_norm_normalize_cpu(empty, torch::zeros({3}), torch::ones({3}), {}).numel(), 0);
  EXPECT_THROW(kernels::batch_norm_stats_cpu(empty), c10::Error);

  // A channels-last input gives the same values as its contiguous copy.
  const auto x = torch::randn({2, 3, 4, 5}).contiguous(torch::MemoryFormat::ChannelsLast);
  const auto [m1, v1] = kernels::batch_norm_stats_cpu(x);
  const auto [m2, v2] = kernels::batch_norm_stats_cpu(x.contiguous());
  EXPECT_TRUE(torch::equal(m1, m2) && torch::equal(v1, v2));
  EXPECT_TRUE(torch::equal(kernels::batch_norm_normalize_cpu(x, m1, v1, {}),
                           kernels::batch_norm_normalize_cpu(x.contiguous(), m1, v1, {})));

  EXPECT_THROW(kernels::batch_norm_normalize_cpu(x, torch::zeros({4}), torch::ones({3}), {}), c10::Error);
  EXPECT_THROW(kernels::batch_norm_stats_cpu(torch::zeros({5})), c10::Error);
  EXPECT_THROW(kernels::batch_norm_stats_cpu(torch::zeros({2, 3}, torch::kInt)), c10::Error);
}

}  // namespace
