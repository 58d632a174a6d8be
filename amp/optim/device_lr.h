#pragma once

// Internal: the learning rate amp's fused optimizers read on the device (amp/optim/fused_optimizers.h).

#include <cstddef>
#include <string>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

namespace amp::detail {

/// Brings a param group's device learning rate `device_lr` (1-element fp32 on `device`; created when undefined)
/// to the host value `lr`. `written` is the value last written to it (NaN: none yet, or unknown after a load).
/// Writes (one device fill, no host sync) only when `lr` differs from `written`, so that a step captured in a
/// CUDA graph contains no write and a replay reads what sync_lr() wrote before it.
/// capturing: the stream captures a CUDA graph. Nothing is written then (a captured fill would replay the value
/// of the capture and ignore every later change): an lr that differs from the written one, or a tensor that does
/// not exist yet, is an error naming `who` (the optimizer), the group, both values and the fix.
void update_device_lr(at::Tensor& device_lr, double& written, double lr, const c10::Device& device, bool capturing,
                      const std::string& who, size_t group);

}  // namespace amp::detail
