#pragma once

// The clipping decision of clip_grad_norm_, written once for the host and the device (it is evaluated by every
// block of the CUDA scaling kernel from the device-resident norm). Plain C++ (no ATen): included by
// kernels/multi_tensor/l2_norm.cpp and kernels/cuda/l2_norm.cu.

#include <cmath>

#include <kernels/host_device.h>

namespace kernels {

/// Added to the total norm before dividing, as torch.nn.utils.clip_grad_norm_ does (it keeps a zero norm from
/// dividing by zero).
constexpr float kClipNormEpsilon = 1e-6f;

/// The factor gradients are multiplied by: max_norm / (total_norm + kClipNormEpsilon) in fp32 when that is
/// < 1, else exactly 1 (leave them alone). A non-finite total_norm also gives 1: scaling by 0 or NaN would
/// destroy gradients that a loss scaler is about to skip anyway.
LTA_HOST_DEVICE inline float clip_coefficient(float total_norm, float max_norm) {
#if defined(__CUDA_ARCH__)
  const bool finite = isfinite(total_norm);
#else
  const bool finite = std::isfinite(total_norm);
#endif
  if (!finite) return 1.0f;
  const float coef = max_norm / (total_norm + kClipNormEpsilon);
  return coef < 1.0f ? coef : 1.0f;
}

}  // namespace kernels
