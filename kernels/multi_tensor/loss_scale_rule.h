#pragma once

// The dynamic loss-scale state machine, written once for the host and the device (one-thread CUDA kernel).
// Plain C++ (no ATen): included by kernels/multi_tensor/loss_scale.cpp and kernels/cuda/loss_scale.cu.
//
// Note [loss-scale state machine]
// On a step with a non-finite gradient: growth_tracker = 0 and hysteresis_tracker -= 1; once the hysteresis
// tracker reaches 0 the scale backs off (scale * backoff_factor, never below min_scale), and it backs off on
// every further overflow until the scale grows again. On a clean step growth_tracker += 1; when it reaches
// growth_interval the scale grows (scale * growth_factor, never above max_scale, and not at all if the
// product is not finite), growth_tracker = 0 and the hysteresis tracker is refilled. With hysteresis = 1
// this is torch.amp.GradScaler's update (exactly, with min_scale 0 and max_scale +inf: no floor, no ceiling);
// with hysteresis = 2 it is Megatron's and DeepSpeed's "tolerate one overflow". The scale can never become NaN
// or inf, nor 0 with a floor above 0: a corrupt incoming scale is reset to min_scale.

#include <cstdint>

#include <kernels/host_device.h>

namespace kernels {

/// The fixed parameters of Note [loss-scale state machine], as update_scale_ validated them, narrowed to fp32/int32.
struct LossScaleRule {
  float growth_factor;      ///< multiplies the scale after growth_interval clean steps (> 1)
  float backoff_factor;     ///< multiplies the scale when it backs off (in (0, 1))
  int32_t growth_interval;  ///< clean steps before the scale grows (>= 1)
  int32_t hysteresis;       ///< overflows tolerated before backing off; refill value of the hysteresis tracker (>= 1)
  float min_scale;          ///< floor of the scale (0: none); a NaN scale is reset to it
  float max_scale;          ///< ceiling of the scale (+inf: none)
};

/// One update of `scale`, `growth_tracker` and `hysteresis_tracker` after a step, per Note [loss-scale state
/// machine]; `found_inf`: the step saw a non-finite gradient. Runs on the host or in a one-thread CUDA kernel.
LTA_HOST_DEVICE inline void apply_loss_scale_rule(const LossScaleRule& rule, float* scale, int32_t* growth_tracker,
                                                  int32_t* hysteresis_tracker, bool found_inf) {
  float s = *scale;
  if (found_inf) {
    *growth_tracker = 0;
    const int32_t h = *hysteresis_tracker - 1;
    *hysteresis_tracker = h > 0 ? h : 0;
    if (h <= 0) {
      s = s * rule.backoff_factor;
      s = s > rule.min_scale ? s : rule.min_scale;
    }
  } else {
    const int32_t g = *growth_tracker + 1;
    if (g >= rule.growth_interval) {
      const float grown = s * rule.growth_factor;
      if (grown - grown == 0.0f) s = grown < rule.max_scale ? grown : rule.max_scale;  // finite products only
      *growth_tracker = 0;
      *hysteresis_tracker = rule.hysteresis;
    } else {
      *growth_tracker = g;
    }
  }
  // NaN fails both comparisons: a corrupt scale becomes min_scale, an out-of-range one is clamped.
  if (!(s >= rule.min_scale)) s = rule.min_scale;
  if (!(s <= rule.max_scale)) s = rule.max_scale;
  *scale = s;
}

}  // namespace kernels
