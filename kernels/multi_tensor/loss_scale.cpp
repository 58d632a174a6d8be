#include <kernels/multi_tensor/loss_scale.h>

#include <cmath>
#include <limits>

#include <c10/util/Exception.h>

#include <kernels/device_call.h>
#include <kernels/multi_tensor/loss_scale_rule.h>
#include <kernels/tensor_lists.h>
#ifdef LIBTORCH_AMP_WITH_CUDA
#include <kernels/cuda/loss_scale_cuda.h>
#endif

namespace kernels {

void update_scale_(const at::Tensor& scale, const at::Tensor& growth_tracker, const at::Tensor& hysteresis_tracker,
                   const at::Tensor& found_inf, double growth_factor, double backoff_factor, int64_t growth_interval,
                   int64_t hysteresis, double min_scale, double max_scale) {
  TORCH_CHECK(scale.defined(), "scale is an undefined tensor");
  const c10::Device device = scale.device();
  check_scalar_tensor(scale, "scale", device, c10::ScalarType::Float);
  check_scalar_tensor(growth_tracker, "growth_tracker", device, c10::ScalarType::Int);
  check_scalar_tensor(hysteresis_tracker, "hysteresis_tracker", device, c10::ScalarType::Int);
  check_flag_tensor(found_inf, "found_inf", device);
  TORCH_CHECK(growth_factor > 1.0 && std::isfinite(growth_factor), "growth_factor must be finite and > 1, got ",
              growth_factor);
  TORCH_CHECK(backoff_factor > 0.0 && backoff_factor < 1.0, "backoff_factor must be in (0, 1), got ", backoff_factor);
  constexpr int64_t kMaxInt32 = std::numeric_limits<int32_t>::max();
  TORCH_CHECK(growth_interval >= 1 && growth_interval <= kMaxInt32, "growth_interval must be in [1, ", kMaxInt32,
              "] steps, got ", growth_interval);
  TORCH_CHECK(hysteresis >= 1 && hysteresis <= kMaxInt32, "hysteresis must be in [1, ", kMaxInt32, "], got ",
              hysteresis);
  TORCH_CHECK(std::isfinite(min_scale) && min_scale >= 0.0, "min_scale must be finite and >= 0, got ", min_scale);
  TORCH_CHECK(max_scale >= min_scale, "max_scale must be >= min_scale, got max_scale ", max_scale, " and min_scale ",
              min_scale);
  const LossScaleRule rule{static_cast<float>(growth_factor),     static_cast<float>(backoff_factor),
                           static_cast<int32_t>(growth_interval), static_cast<int32_t>(hysteresis),
                           static_cast<float>(min_scale),         static_cast<float>(max_scale)};
  auto* s = scale.data_ptr<float>();
  auto* g = growth_tracker.data_ptr<int32_t>();
  auto* h = hysteresis_tracker.data_ptr<int32_t>();
  const auto* f = found_inf.data_ptr<float>();
  on_device(
      device, [&] { apply_loss_scale_rule(rule, s, g, h, *f != 0.0f); },
      [&]([[maybe_unused]] CudaStreamHandle stream) {
#ifdef LIBTORCH_AMP_WITH_CUDA
        cuda::update_scale(rule, s, g, h, f, stream);
#endif
      });
}

}  // namespace kernels
