#include <kernels/batch_norm.h>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <kernels/cpu/batch_norm_cpu.h>
#include <kernels/cpu/capability.h>
#include <kernels/cpu/parallel.h>
#include <kernels/tensor_lists.h>

namespace kernels {
namespace cpu {
LTA_CPU_DISPATCH(batch_norm_stats, (const void* x, DType dtype, ChannelLayout layout, double* mean, double* var),
                 (x, dtype, layout, mean, var))
LTA_CPU_DISPATCH(batch_norm_grad_sums,
                 (const void* dy, const void* x, DType dtype, ChannelLayout layout, const float* mean, double* sum_dy,
                  double* sum_dy_xmu),
                 (dy, x, dtype, layout, mean, sum_dy, sum_dy_xmu))
LTA_CPU_DISPATCH(batch_norm_normalize,
                 (const void* x, void* y, DType dtype, ChannelLayout layout, const float* mean, const float* scale,
                  const float* shift),
                 (x, y, dtype, layout, mean, scale, shift))
LTA_CPU_DISPATCH(batch_norm_input_grad,
                 (const void* dy, const void* x, void* dx, DType dtype, ChannelLayout layout, const float* mean,
                  const float* mean_dy, const float* k, const float* scale),
                 (dy, x, dx, dtype, layout, mean, mean_dy, k, scale))
}  // namespace cpu

namespace {

cpu::ChannelLayout layout_of(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() >= 2, op, ": expected a CPU tensor of shape (N, C, *), got ", x.device(),
              " ", x.sizes());
  cpu::ChannelLayout l;
  l.samples = x.size(0);
  l.channels = x.size(1);
  l.inner = 1;
  for (int64_t d = 2; d < x.dim(); ++d) l.inner *= x.size(d);
  return l;
}

/// A contiguous (C) copy of a per-channel argument in `dtype`.
at::Tensor per_channel(const at::Tensor& t, const cpu::ChannelLayout& l, at::ScalarType dtype, const char* op,
                       const char* what) {
  TORCH_CHECK(t.dim() == 1 && t.size(0) == l.channels, op, ": ", what, " must have shape (", l.channels, "), got ",
              t.sizes());
  return t.to(at::kCPU, dtype).contiguous();
}

bool on_twins(const at::Tensor& x) { return x.scalar_type() != at::kDouble; }

// fp64 inputs: plain loops (no twin handles fp64).

void stats_fp64(const double* x, const cpu::ChannelLayout& l, double* mean, double* var) {
  const auto count = static_cast<double>(l.samples * l.inner);
  ::kernels::cpu::parallel_for(0, l.channels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      double sum = 0;
      for (int64_t s = 0; s < l.samples; ++s) {
        const double* run = x + (s * l.channels + c) * l.inner;
        for (int64_t i = 0; i < l.inner; ++i) sum += run[i];
      }
      const double mu = sum / count;
      double squares = 0;
      for (int64_t s = 0; s < l.samples; ++s) {
        const double* run = x + (s * l.channels + c) * l.inner;
        for (int64_t i = 0; i < l.inner; ++i) squares += (run[i] - mu) * (run[i] - mu);
      }
      mean[c] = mu;
      var[c] = squares / count;
    }
  });
}

void grad_sums_fp64(const double* dy, const double* x, const cpu::ChannelLayout& l, const double* mean, double* sum_dy,
                    double* sum_dy_xmu) {
  ::kernels::cpu::parallel_for(0, l.channels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      double s_dy = 0;
      double s_dy_xmu = 0;
      for (int64_t s = 0; s < l.samples; ++s) {
        const int64_t at = (s * l.channels + c) * l.inner;
        for (int64_t i = 0; i < l.inner; ++i) {
          s_dy += dy[at + i];
          s_dy_xmu += dy[at + i] * (x[at + i] - mean[c]);
        }
      }
      sum_dy[c] = s_dy;
      sum_dy_xmu[c] = s_dy_xmu;
    }
  });
}

/// fn(run, channel) over every (sample, channel) run, in parallel.
template <typename Fn>
void for_each_run_fp64(const cpu::ChannelLayout& l, const Fn& fn) {
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 15) / std::max<int64_t>(l.inner, 1));
  ::kernels::cpu::parallel_for(0, l.samples * l.channels, grain, [&](int64_t begin, int64_t end) {
    for (int64_t run = begin; run < end; ++run) fn(run, run % l.channels);
  });
}

}  // namespace

std::pair<at::Tensor, at::Tensor> batch_norm_stats_cpu(const at::Tensor& input) {
  const char* op = "kernels::batch_norm_stats_cpu";
  const cpu::ChannelLayout l = layout_of(input, op);
  TORCH_CHECK(l.samples > 0, op, ": needs at least one sample, got ", input.sizes());
  const at::Tensor x = input.contiguous();
  at::Tensor mean = at::empty({l.channels}, at::kDouble);
  at::Tensor var = at::empty({l.channels}, at::kDouble);
  if (on_twins(x)) {
    cpu::batch_norm_stats(x.const_data_ptr(), to_kernel_dtype(x.scalar_type(), "x"), l, mean.mutable_data_ptr<double>(),
                          var.mutable_data_ptr<double>());
  } else {
    stats_fp64(x.const_data_ptr<double>(), l, mean.mutable_data_ptr<double>(), var.mutable_data_ptr<double>());
  }
  return {mean, var};
}

std::pair<at::Tensor, at::Tensor> batch_norm_grad_sums_cpu(const at::Tensor& dy_in, const at::Tensor& input,
                                                           const at::Tensor& mean_in) {
  const char* op = "kernels::batch_norm_grad_sums_cpu";
  const cpu::ChannelLayout l = layout_of(input, op);
  TORCH_CHECK(dy_in.sizes() == input.sizes(), op, ": dy ", dy_in.sizes(), " and x ", input.sizes(), " differ");
  const at::Tensor x = input.contiguous();
  const at::Tensor dy = dy_in.to(x.scalar_type()).contiguous();
  at::Tensor sum_dy = at::zeros({l.channels}, at::kDouble);
  at::Tensor sum_dy_xmu = at::zeros({l.channels}, at::kDouble);
  if (l.samples * l.inner == 0) return {sum_dy, sum_dy_xmu};
  if (on_twins(x)) {
    const at::Tensor mean = per_channel(mean_in, l, at::kFloat, op, "mean");
    cpu::batch_norm_grad_sums(dy.const_data_ptr(), x.const_data_ptr(), to_kernel_dtype(x.scalar_type(), "x"), l,
                              mean.const_data_ptr<float>(), sum_dy.mutable_data_ptr<double>(),
                              sum_dy_xmu.mutable_data_ptr<double>());
  } else {
    const at::Tensor mean = per_channel(mean_in, l, at::kDouble, op, "mean");
    grad_sums_fp64(dy.const_data_ptr<double>(), x.const_data_ptr<double>(), l, mean.const_data_ptr<double>(),
                   sum_dy.mutable_data_ptr<double>(), sum_dy_xmu.mutable_data_ptr<double>());
  }
  return {sum_dy, sum_dy_xmu};
}

at::Tensor batch_norm_normalize_cpu(const at::Tensor& input, const at::Tensor& mean_in, const at::Tensor& scale_in,
                                    const at::Tensor& shift_in) {
  const char* op = "kernels::batch_norm_normalize_cpu";
  const cpu::ChannelLayout l = layout_of(input, op);
  const at::Tensor x = input.contiguous();
  at::Tensor y = at::empty_like(x, at::MemoryFormat::Contiguous);
  if (x.numel() == 0) return y;
  const at::ScalarType p = on_twins(x) ? at::kFloat : at::kDouble;
  const at::Tensor mean = per_channel(mean_in, l, p, op, "mean");
  const at::Tensor scale = per_channel(scale_in, l, p, op, "scale");
  const at::Tensor shift = shift_in.defined() ? per_channel(shift_in, l, p, op, "shift") : at::zeros_like(mean);
  if (on_twins(x)) {
    cpu::batch_norm_normalize(x.const_data_ptr(), y.mutable_data_ptr(), to_kernel_dtype(x.scalar_type(), "x"), l,
                              mean.const_data_ptr<float>(), scale.const_data_ptr<float>(),
                              shift.const_data_ptr<float>());
    return y;
  }
  const double* xp = x.const_data_ptr<double>();
  double* yp = y.mutable_data_ptr<double>();
  const double* mp = mean.const_data_ptr<double>();
  const double* sp = scale.const_data_ptr<double>();
  const double* tp = shift.const_data_ptr<double>();
  for_each_run_fp64(l, [&](int64_t run, int64_t c) {
    for (int64_t i = run * l.inner; i < (run + 1) * l.inner; ++i) yp[i] = (xp[i] - mp[c]) * sp[c] + tp[c];
  });
  return y;
}

at::Tensor batch_norm_input_grad_cpu(const at::Tensor& dy_in, const at::Tensor& input, const at::Tensor& mean_in,
                                     const at::Tensor& mean_dy_in, const at::Tensor& k_in, const at::Tensor& scale_in) {
  const char* op = "kernels::batch_norm_input_grad_cpu";
  const cpu::ChannelLayout l = layout_of(input, op);
  TORCH_CHECK(dy_in.sizes() == input.sizes(), op, ": dy ", dy_in.sizes(), " and x ", input.sizes(), " differ");
  const at::Tensor x = input.contiguous();
  const at::Tensor dy = dy_in.to(x.scalar_type()).contiguous();
  at::Tensor dx = at::empty_like(x, at::MemoryFormat::Contiguous);
  if (x.numel() == 0) return dx;
  const at::ScalarType p = on_twins(x) ? at::kFloat : at::kDouble;
  const at::Tensor mean = per_channel(mean_in, l, p, op, "mean");
  const at::Tensor mean_dy = per_channel(mean_dy_in, l, p, op, "mean_dy");
  const at::Tensor k = per_channel(k_in, l, p, op, "k");
  const at::Tensor scale = per_channel(scale_in, l, p, op, "scale");
  if (on_twins(x)) {
    cpu::batch_norm_input_grad(dy.const_data_ptr(), x.const_data_ptr(), dx.mutable_data_ptr(),
                               to_kernel_dtype(x.scalar_type(), "x"), l, mean.const_data_ptr<float>(),
                               mean_dy.const_data_ptr<float>(), k.const_data_ptr<float>(),
                               scale.const_data_ptr<float>());
    return dx;
  }
  const double* dyp = dy.const_data_ptr<double>();
  const double* xp = x.const_data_ptr<double>();
  double* dxp = dx.mutable_data_ptr<double>();
  const double* mp = mean.const_data_ptr<double>();
  const double* mdp = mean_dy.const_data_ptr<double>();
  const double* kp = k.const_data_ptr<double>();
  const double* sp = scale.const_data_ptr<double>();
  for_each_run_fp64(l, [&](int64_t run, int64_t c) {
    for (int64_t i = run * l.inner; i < (run + 1) * l.inner; ++i) {
      dxp[i] = (dyp[i] - mdp[c] - (xp[i] - mp[c]) * kp[c]) * sp[c];
    }
  });
  return dx;
}

}  // namespace kernels
