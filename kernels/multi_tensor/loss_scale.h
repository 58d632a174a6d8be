#pragma once

#include <cstdint>

#include <ATen/core/Tensor.h>

namespace kernels {

/// Updates the dynamic loss-scale state on its device after a step, following
/// Note [loss-scale state machine] (kernels/multi_tensor/loss_scale_rule.h). CUDA: a one-thread kernel on the current
/// stream; nothing is read back to the host.
///
/// scale:              1-element float32 tensor (updated in place).
/// growth_tracker:     1-element int32 tensor, clean steps since the last growth or overflow.
/// hysteresis_tracker: 1-element int32 tensor, overflows still tolerated before backing off (start it at
///                     `hysteresis`).
/// found_inf:          1-element float32 tensor, nonzero when the step saw a non-finite gradient.
///   All four on one device (CPU or CUDA).
/// growth_factor > 1, 0 < backoff_factor < 1, growth_interval >= 1 steps, hysteresis >= 1 overflows,
/// 0 <= min_scale <= max_scale (min_scale 0: no floor, as torch.amp; max_scale may be +inf: no ceiling).
void update_scale_(const at::Tensor& scale, const at::Tensor& growth_tracker, const at::Tensor& hysteresis_tracker,
                   const at::Tensor& found_inf, double growth_factor, double backoff_factor, int64_t growth_interval,
                   int64_t hysteresis, double min_scale, double max_scale);

}  // namespace kernels
