#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include <kernels/multi_tensor/loss_scale_rule.h>

namespace kernels::cuda {

/// Applies the loss-scale rule to device-resident state with a one-thread kernel on `stream`.
void update_scale(const LossScaleRule& rule, float* scale, int32_t* growth_tracker, int32_t* hysteresis_tracker,
                  const float* found_inf, cudaStream_t stream);

}  // namespace kernels::cuda
