#pragma once

#include <cstdint>

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

#include <kernels/pointer_lists.h>  // kNoNonFiniteIndex

namespace kernels {

// Note [first non-finite index]
// A loss scaler wants to say *which* parameter's gradient overflowed, without stalling the step to ask.
// Ops that check for non-finite values therefore take an optional 1-element int32 tensor on the device and
// atomically lower it to the index (index_offset + position in the list) of every tensor in which they saw
// an inf or NaN; the caller initializes it to kNoNonFiniteIndex and reads it whenever convenient (e.g. with
// an asynchronous copy read one step later). After a call it holds the smallest such index.

/// Unscales gradients in place and checks them: g *= inv_scale (fp32 arithmetic) for every element of every
/// tensor, and sets found_inf to 1 if any input or result is inf or NaN (including a result that overflows
/// its storage dtype).
///
/// grads:       float32/float16/bfloat16 (mixed allowed), contiguous, all on one device (CPU or CUDA).
/// inv_scale:   1-element float32 tensor on the grads' device, read on device (no host sync).
/// found_inf:   1-element float32 tensor on the grads' device. Set to 1.0 when a non-finite value is seen;
///              never cleared here: the caller zeroes it (so several calls can accumulate into one flag).
/// first_nonfinite_index: optional 1-element int32 tensor on the device, see Note [first non-finite index].
/// index_offset: added to list positions before they are recorded (for callers that split one logical list).
/// CUDA: one fused launch per dtype on the current stream, bf16 included; never syncs the host.
void unscale_and_check_(at::TensorList grads, const at::Tensor& inv_scale, const at::Tensor& found_inf,
                        const at::Tensor& first_nonfinite_index = {}, int64_t index_offset = 0);

/// The same, recording indices[i] (instead of index_offset + i) for grads[i]: for callers whose tensors are
/// not consecutive in the index space they report in. indices.size() must equal grads.size().
void unscale_and_check_(at::TensorList grads, const at::Tensor& inv_scale, const at::Tensor& found_inf,
                        const at::Tensor& first_nonfinite_index, c10::ArrayRef<int64_t> indices);

}  // namespace kernels
